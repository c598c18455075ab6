import errno
import logging
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from vitlab.training.callbacks.standard import BestCheckpoint, EpochLog, LastCheckpoint
from vitlab.training.checkpoint_io import AtomicCheckpointIO
from vitlab.utils.errors import UserError


def test_atomic_checkpoint_round_trip_and_overwrite(tmp_path):
    io, path = AtomicCheckpointIO(), tmp_path / "sub" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, path)
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 2}, path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["epoch"] == 2 and torch.equal(ckpt["state_dict"]["w"], torch.zeros(2))
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, path)
    good = path.read_bytes()

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        try:  # as torch.save reports it: its C++ writer's RuntimeError, the OSError as context
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from None

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(UserError) as e:
        io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 2}, path)
    assert str(e.value).startswith(f"cannot write checkpoint {path} (No space left on device); the previous last.ckpt")
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the temporary file is gone too


def test_a_bug_while_saving_is_not_called_a_full_disk(tmp_path, monkeypatch):
    def bug(obj, f, *args, **kwargs):
        raise RuntimeError("something else broke")

    monkeypatch.setattr(torch, "save", bug)
    with pytest.raises(RuntimeError, match="something else broke"):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, tmp_path / "last.ckpt")


class _Scored(L.LightningModule):
    """A linear model whose val/acc follows `scores` per epoch."""

    def __init__(self, scores):
        super().__init__()
        self.net, self.scores = torch.nn.Linear(2, 1), scores

    def training_step(self, batch, _):
        return self.net(batch[0]).sum()

    def validation_step(self, batch, _):
        self.log("val/acc", float(self.scores[self.current_epoch]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_last_checkpoint_links_the_best_when_both_fall_due_and_is_written_otherwise(tmp_path, monkeypatch):
    from torch.utils.data import DataLoader, TensorDataset

    saves = []
    real_save = torch.save
    monkeypatch.setattr(
        torch, "save", lambda obj, f, *a, **k: saves.append(obj["global_step"]) or real_save(obj, f, *a, **k)
    )
    best = ModelCheckpoint(dirpath=tmp_path, filename="best_{epoch}", monitor="val/acc", mode="max", save_top_k=1)
    last = LastCheckpoint(dirpath=tmp_path)
    data = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)
    trainer = L.Trainer(
        max_epochs=3,
        callbacks=[best, last],
        logger=False,
        enable_progress_bar=False,
        plugins=[AtomicCheckpointIO()],
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(_Scored([0.1, 0.5, 0.2]), data, data)
    # epochs 1 and 2 improve: one serialisation each, last.ckpt the same file; epoch 3 does not: last.ckpt alone
    assert saves == [2, 4, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best_epoch=1.ckpt", "last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 6
    assert torch.load(tmp_path / "best_epoch=1.ckpt", weights_only=True)["global_step"] == 4
    assert last.best_model_path == str(tmp_path / "last.ckpt")

    saves.clear()
    trainer = L.Trainer(
        max_epochs=1,
        callbacks=[
            best := ModelCheckpoint(dirpath=tmp_path / "b", monitor="val/acc", mode="max"),
            LastCheckpoint(dirpath=tmp_path / "b"),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(_Scored([0.3]), data, data)
    files = {p.name: p.stat().st_ino for p in (tmp_path / "b").iterdir()}
    assert saves == [2] and len(files) == 2 and len(set(files.values())) == 1  # a hard link, not a copy


@pytest.mark.parametrize("accumulate", [1, 2])
def test_throughput_is_read_once_per_logging_interval(tmp_path, accumulate):
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from vitlab.training.callbacks.standard import Throughput

    data = DataLoader(TensorDataset(torch.randn(24, 2), torch.zeros(24)), batch_size=2)  # 12 batches an epoch
    module = _Scored([0.1, 0.2])
    module.train_flops_per_image = 10.0

    def fit():
        L.Trainer(
            max_epochs=2, callbacks=[Throughput()], logger=CSVLogger(tmp_path), log_every_n_steps=2,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
            accumulate_grad_batches=accumulate, limit_val_batches=1,
        ).fit(module, data, data)  # fmt: skip

    readings = []
    module.log_dict = lambda values, **kw: readings.append(module.global_step)
    fit()
    assert readings == list(range(2, 24 // accumulate + 1, 2))  # one reading (one sync) per interval
    del module.log_dict
    fit()
    rows = (tmp_path / "lightning_logs" / "version_1" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = [dict(zip(header, r.split(","), strict=True)) for r in rows[1:]]
    logged = [r for r in logged if r["train/device/samples_per_sec"]]
    # every 2nd optimizer step (24 / accumulate of them), once, also when batches accumulate
    assert [int(r["step"]) for r in logged] == list(range(1, 24 // accumulate, 2))
    for r in logged:
        rate = float(r["train/device/samples_per_sec"])
        assert rate > 0 and float(r["train/device/flops_per_sec"]) == pytest.approx(10.0 * rate, rel=1e-6)


def test_ema_warmup_decay_is_timms():
    """callbacks.ema.warmup: the decay of each update is timm's ModelEmaV3.get_decay at the same optimizer step."""
    from timm.utils.model_ema import ModelEmaV3

    from vitlab.training.callbacks.ema import EMA

    net = torch.nn.Linear(2, 2)
    for gamma, power in ((1.0, 2 / 3), (10.0, 0.75)):
        ours = EMA(decay=0.9999, warmup=True, warmup_gamma=gamma, warmup_power=power)
        timm = ModelEmaV3(net, decay=0.9999, use_warmup=True, warmup_gamma=gamma, warmup_power=power)
        for step in (2, 3, 10, 100, 1000, 10**6):
            assert ours.decay_at(step) == pytest.approx(timm.get_decay(step), abs=1e-12), (gamma, step)
    assert EMA(decay=0.99).decay_at(5) == 0.99
    with pytest.raises(UserError, match=r"callbacks.ema.decay 1.5 must be in \[0, 1\]"):
        EMA(decay=1.5)


def test_ema_updates_equal_timms_model_ema(tmp_path):
    """The average after a few optimizer steps with warm-up equals timm's ModelEmaV3 fed the same weights."""
    from timm.utils.model_ema import ModelEmaV3
    from torch.optim.swa_utils import AveragedModel

    from vitlab.training.callbacks.ema import EMA

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    ema = EMA(decay=0.99, warmup=True)
    averaged = AveragedModel(net, use_buffers=True, multi_avg_fn=ema._lerp)
    timm = ModelEmaV3(net, decay=0.99, use_warmup=True)
    for step in range(1, 8):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ema._step = step
        averaged.update_parameters(net)
        timm.update(net, step=step)
    for a, b in zip(averaged.module.parameters(), timm.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("monitor", ["val/acc_ema", "val/acc"])
def test_ema_is_validated_beside_the_raw_weights_and_the_checkpoint_keeps_the_chosen(compose_cfg, tmp_path, monitor):
    """Both weights are validated every epoch (val/acc and val/acc_ema); the best checkpoint is chosen by
    model_checkpoint.monitor and holds those weights, the other set kept for resuming. With decay 0 the average is
    the raw weights, so both validations agree exactly: the EMA's is measured on the same batches."""
    import json

    from vitlab.train import train

    base = ["debug=limit", "progress_bar=none", "callbacks=ema", f"callbacks.model_checkpoint.monitor={monitor}"]
    train(compose_cfg("train", [*base, "callbacks.ema.decay=0.9", "callbacks.ema.warmup=true"]))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert {"val/acc", "val/acc_ema", "val/loss_ema", "val/acc_top5_ema"} <= metrics.keys()
    ckpt = torch.load(metrics["tested_checkpoint"], weights_only=True)
    other = "current_model_state" if monitor == "val/acc_ema" else "average_model_state"
    assert not torch.equal(ckpt["state_dict"]["model.head.weight"], ckpt[other]["model.head.weight"])

    same = tmp_path / "same"
    train(compose_cfg("train", [*base, "callbacks.ema.decay=0.0"], output_dir=same))
    metrics = json.loads((same / "metrics.json").read_text())
    assert metrics["val/acc_ema"] == metrics["val/acc"] and metrics["val/loss_ema"] == pytest.approx(
        metrics["val/loss"], abs=1e-6
    )


def test_the_epoch_a_run_resumes_in_gets_its_line(caplog):
    """Lightning calls no on_train_epoch_start for the epoch a run resumed mid-way goes on with (here the 4th, from
    step 32 of its 36): its line still comes, counting the steps since the resume; a fresh run's first epoch too."""
    trainer = SimpleNamespace(is_global_zero=True, progress_bar_callback=None, max_epochs=8, callback_metrics={})
    log = EpochLog()
    with caplog.at_level(logging.INFO, logger="vitlab.training.callbacks.standard"):
        for epoch, step, hook in [(3, 32, "on_train_start"), (4, 36, "on_train_epoch_start"), (5, 45, "on_fit_end")]:
            trainer.current_epoch, trainer.global_step = epoch, step
            getattr(log, hook)(trainer, None)
        fresh = EpochLog()
        for epoch, step, hook in [(0, 0, "on_train_start"), (0, 0, "on_train_epoch_start"), (1, 9, "on_fit_end")]:
            trainer.current_epoch, trainer.global_step = epoch, step
            getattr(fresh, hook)(trainer, None)
    lines = [r.getMessage().split(" (")[0] + " " + r.getMessage().split(" (")[1].split(",")[0] for r in caplog.records]
    assert lines == ["epoch 4/8 4 steps", "epoch 5/8 9 steps", "epoch 1/8 9 steps"]


def test_a_resumed_run_says_the_best_checkpoint_is_gone_only_when_there_was_one(tmp_path, caplog):
    """A run stopped before its first validation had no best checkpoint: its resumption in a new directory says
    nothing about one (it said "the earlier run's best checkpoint is gone"); one whose best file was deleted says so."""
    earlier = tmp_path / "old" / "checkpoints"
    state = {"dirpath": str(earlier), "best_model_path": "", "best_k_models": {}, "best_model_score": None}
    with caplog.at_level(logging.INFO, logger="vitlab.training.callbacks.standard"):
        BestCheckpoint(dirpath=tmp_path / "new").load_state_dict(state)
        assert "gone" not in caplog.text
        gone = str(earlier / "epoch=1.ckpt")
        BestCheckpoint(dirpath=tmp_path / "new").load_state_dict(
            state | {"best_model_path": gone, "best_k_models": {gone: torch.tensor(0.5)}}
        )
    assert caplog.text.count("best checkpoint is gone") == 1
