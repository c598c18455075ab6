import errno

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from vitlab.callbacks import LastCheckpoint
from vitlab.errors import UserError
from vitlab.plugins import AtomicCheckpointIO


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

    from vitlab.callbacks import Throughput

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
