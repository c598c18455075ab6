"""python -m vitlab.train as typed, the longer runs: DDP on two CPU processes, a -m sweep of DDP runs refused, runs
started together, unknown keys, fine-tuning timm's ViT-B/16 at 384, compile=true (tests/test_train.py has the quick
ones; the README's grid sweep and Optuna search: test_fresh_clone.py)."""

import concurrent.futures
import json

import pytest
import torch

from tests.helpers.commands import TESTS_ON_PATH, run_cli
from tests.helpers.configs import extra_callback

SHORT = ["debug=limit", "progress_bar=none"]
METRICS = ["train/loss", "train/acc", "val/loss", "val/acc", "val/acc_best", "test/loss", "test/acc", "test/acc_top5"]


def test_ddp_on_two_cpu_processes_shares_one_run_dir_and_syncs_metrics(tmp_path):
    """Two processes: one run directory, synced metrics, and the digits held on each process's device, each
    training on its own contiguous share of each global batch of the epoch's permutation (data/seeded.py
    GlobalOrder), none twice, as the loader path shares it."""
    from vitlab.data.seeded import GlobalOrder

    run_dir, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    r = run_cli(
        "train",
        "trainer=ddp_cpu",
        "trainer.devices=2",
        *SHORT,
        "trainer.limit_test_batches=1.0",
        "optimized_metric=val/never_logged",  # warned about by rank 0 only (issue 41: once per process)
        f"hydra.run.dir={run_dir}",
        *extra_callback("record", "RecordTrainIndices", path=record),
        cwd=tmp_path,
        env=TESTS_ON_PATH,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sync_dist" not in r.stderr  # no advice to sync values torchmetrics has already synced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record", "run"]  # rank 1 wrote into rank 0's directory
    assert (run_dir / "train_rank1.log").is_file() and not list(run_dir.glob("*ddp_process*"))  # named as README says
    assert "data on cpu: 1,257 train, 270 val, 270 test images as uint8" in r.stderr + r.stdout
    assert (r.stderr + r.stdout).count("optimized_metric 'val/never_logged' was not logged") == 1
    trained = [json.loads((record / f"indices.{rank}.json").read_text()) for rank in (0, 1)]
    for epoch in range(2):
        shares = []
        for rank in (0, 1):
            sampler = GlobalOrder(range(1257), num_replicas=2, rank=rank, seed=42, batch_size=32)
            sampler.set_epoch(epoch)
            shares.append(trained[rank][epoch])
            assert len(shares[-1]) == 3 * 32 and shares[-1] == list(sampler)[: 3 * 32]  # debug=limit: 3 batches
        assert not set(shares[0]) & set(shares[1])
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # Each rank tested half of the test set; the synced accuracy equals one process testing all of it.
    r = run_cli(
        "eval", f"ckpt_path={metrics['tested_checkpoint']}", "progress_bar=none", f"hydra.run.dir={tmp_path / 'e'}"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    single = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert metrics["test/acc"] == pytest.approx(single["test/acc"], abs=1e-6)


def test_multirun_with_multi_process_ddp_stops_at_once(tmp_path):
    r = run_cli("train", "-m", "trainer=ddp_cpu", "optim.lr=1e-3,3e-3", *SHORT, f"hydra.sweep.dir={tmp_path / 's'}")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: 2 of 2 sweep jobs failed (jobs 0, 1; job 0: -m sweeps run each job in this process")
    assert "trainer.devices=2" in line
    assert not list((tmp_path / "s").glob("*/metrics.json"))


def test_runs_started_together_get_their_own_directories(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # (the fork server starts them side by side)
        done = list(pool.map(lambda _: run_cli("train", "debug=fdr", "progress_bar=none", cwd=tmp_path), range(2)))
    assert [r.returncode for r in done] == [0, 0], done[0].stderr[-2000:] + done[1].stderr[-2000:]
    runs = list((tmp_path / "outputs" / "debug" / "runs").iterdir())
    assert len(runs) == 2 and all((r / "config.yaml").is_file() for r in runs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["model.depth=three"], "error: depth 'three' must be an integer"),
        (["model.drop_path_rate=1.5"], "error: drop_path_rate 1.5 must be in [0, 1)"),
        (["data.batch_size=0"], "data.batch_size 0 must be 'auto' or an integer >= 1"),
        (["progress_bar=fancy"], "error: progress_bar 'fancy' must be one of 'auto', 'rich', 'tqdm', 'none'"),
        (["optim.layer_decay=2"], "error: optim.layer_decay 2 must be in (0, 1]"),
    ],
)
def test_bad_values_fail_in_one_line(tmp_path, args, message):
    r = run_cli("train", *args, "debug=fdr", f"hydra.run.dir={tmp_path / 'r'}")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_key_and_option_are_named_in_one_line(tmp_path):
    r = run_cli("train", "model.depht=3", f"hydra.run.dir={tmp_path / 'r'}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: model.depht is not a key of model; its keys: ['act_layer', 'attn_drop_rate',")
    assert "'depth'" in r.stderr  # the key meant is among them (Hydra's hint, +model.depht=3, led to a second error)
    r = run_cli("train", "model=vit_x", f"hydra.run.dir={tmp_path / 'r'}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "Could not find 'model/vit_x'" in r.stderr and "vit_b16" in r.stderr  # names what is allowed
    assert "search path" not in r.stderr
    assert not (tmp_path / "r").exists()  # nothing was written


def test_finetune_random_timm_vit_b16_from_224_to_384_on_digits(tmp_path):
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = timm.create_model("vit_base_patch16_224", pretrained=False)
    weights = tmp_path / "vit_b16_224.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(weights))
    run = tmp_path / "run"
    # One step at lr 0 runs the whole pipeline and leaves the loaded weights as they were loaded.
    r = run_cli(
        "train",
        "experiment=digits_finetune_timm_384",
        f"model.pretrained={weights}",
        "optim.lr=0.0",
        "trainer.max_steps=1",
        "data.batch_size=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "trainer.num_sanity_val_steps=0",
        "progress_bar=none",
        f"hydra.run.dir={run}",
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ours = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, mmap=True, map_location="cpu")["state_dict"]
    # timm's own loader, same file, same target: 384 px, one channel, ten classes.
    theirs = timm.create_model(
        "vit_base_patch16_224",
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(weights)),
        img_size=384,
        in_chans=1,
        num_classes=10,
    )
    assert ours["model.pos_embed"].shape == (1, 1 + 24 * 24, 768)
    torch.testing.assert_close(ours["model.pos_embed"], theirs.pos_embed.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours["model.patch_embed.proj.weight"], theirs.patch_embed.proj.weight.detach())
    torch.testing.assert_close(ours["model.blocks.7.attn.qkv.weight"], source.blocks[7].attn.qkv.weight.detach())
    assert ours["model.head.weight"].shape == (10, 768)


def test_compile_option_trains_a_compiled_model(tmp_path):
    r = run_cli(
        "train",
        "compile=true",
        *SHORT,
        *extra_callback("compiled", "AssertCompiled"),
        f"hydra.run.dir={tmp_path / 'r'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert 0.0 <= json.loads((tmp_path / "r" / "metrics.json").read_text())["test/acc"] <= 1.0


@pytest.mark.parametrize("bar", ["tqdm", "rich"])
def test_the_progress_bar_counts_epochs_from_1_as_the_log_and_the_stop_line_do(tmp_path, bar):
    """Issue 53: Lightning's bars say `Epoch 0` for the first epoch, which the epoch log and the interrupt line call
    epoch 1."""
    run = ["trainer.max_epochs=2", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "test=false"]
    r = run_cli("train", f"progress_bar={bar}", *run, f"hydra.run.dir={tmp_path / 'r'}")
    assert r.returncode == 0, r.stderr[-3000:]
    shown = r.stdout + r.stderr
    assert "Epoch 2" in shown and "Epoch 0" not in shown and "Epoch 1/1" not in shown
    assert "Epoch 1:" in shown if bar == "tqdm" else "Epoch 2/2" in shown  # (rich, not on a terminal: its last state)
