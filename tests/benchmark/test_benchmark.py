"""vitlab.benchmark's mechanics on tiny models: it runs, its JSON holds every field and its numbers are
consistent with each other; FLOPs and memory match hand counts. Never its speed (experiments/throughput)."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.commands import run_cli
from tests.helpers.configs import tiny
from vitlab.benchmark.config import BenchmarkConfig
from vitlab.benchmark.measure import MB, peak_matmul_flops, step_peak_bytes, tensor_bytes
from vitlab.benchmark.models import Contender, build_contenders
from vitlab.training.optim import OptimConfig

# A 32-px ViT with 4 blocks: 16 patches + class token.
TINY = [
    "model.img_size=32",
    "model.patch_size=8",
    "model.embed_dim=32",
    "model.depth=4",
    "model.num_heads=4",
    "model.in_chans=3",
    "model.num_classes=7",
]
ROW_KEYS = {
    "median_ms",
    "times_ms",
    "images_per_s",
    "achieved_flops_per_s",
    "mfu",
    "state_memory_mb",
    "step_memory_mb",
    "peak_memory_mb",
}
RATIO_KEYS = {"throughput", "throughput_paired_min", "throughput_paired_max", "peak_memory", "step_memory"}


def test_flops_per_image_is_the_hand_count():
    # N = 17 tokens, D = 32, MLP 128: per block 2*17*(4*32*32 + 2*32*128) + 4*17*17*32; the last block, under the
    # class-token head, keys and values of the 17 tokens and the rest for row 0 only: 2*(3*17*32*32 + 32*32 + 2*32*128)
    # + 4*17*32; patch embedding 2*16*(8*8*3)*32; head 2*32*7.
    per_block = 2 * 17 * (4 * 32 * 32 + 2 * 32 * 128) + 4 * 17 * 17 * 32
    last = 2 * (3 * 17 * 32 * 32 + 32 * 32 + 2 * 32 * 128) + 4 * 17 * 32
    assert tiny(depth=4).flops_per_image() == 3 * per_block + last + 2 * 16 * 192 * 32 + 2 * 32 * 7 == 1_686_464
    # SwiGLU: three D x 128 matrices instead of two; packed: fc1 32->128, fc2 64->32 (the halves' product)
    swiglu, packed = 2 * 32 * 128, 2 * (32 * 128 + 64 * 32 - 2 * 32 * 128)
    assert tiny(depth=4, mlp_layer="swiglu").flops_per_image() == 1_686_464 + (3 * 17 + 1) * swiglu
    assert tiny(depth=4, mlp_layer="swiglu_packed").flops_per_image() == 1_686_464 + (3 * 17 + 1) * packed


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("bench") / "run"
    r = run_cli(
        "benchmark",
        *TINY,
        "benchmark.batch_size=4",
        "benchmark.contenders=[vitlab,timm,vitlab_ckpt]",
        "benchmark.modes=[train,fwd_bwd,infer]",
        "benchmark.warmup=1",
        "benchmark.repeats=3",
        "benchmark.peak_matmul_size=256",
        f"hydra.run.dir={run_dir}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vitlab/timm" not in r.stderr and "img/s" in r.stdout  # the table went to stdout
    return json.loads((run_dir / "benchmark.json").read_text())


def test_report_has_every_field_and_consistent_numbers(report):
    assert report["task"] == "models" and report["model"] == "vit_digits"
    assert report["flops"]["forward_per_image"] == 1_686_464
    assert report["flops"]["train_gflops_per_image"] == pytest.approx(3 * 1_686_464 / 1e9)
    assert report["peak"]["dtype"] == "float32" and report["peak"]["size"] == 256 and report["peak"]["flops_per_s"] > 0
    assert {"torch", "timm", "lightning", "device", "threads"} <= report["environment"].keys()
    for mode, factor in (("train", 3), ("fwd_bwd", 3), ("infer", 1)):
        rows = report["results"][mode]
        assert list(rows) == ["vitlab", "timm", "vitlab_ckpt"]
        for row in rows.values():
            assert row.keys() == ROW_KEYS
            assert len(row["times_ms"]) == 3 and row["median_ms"] == pytest.approx(sorted(row["times_ms"])[1], abs=1e-3)
            assert row["images_per_s"] == pytest.approx(4 / (row["median_ms"] / 1e3))
            assert row["achieved_flops_per_s"] == pytest.approx(factor * 1_686_464 * row["images_per_s"])
            assert row["mfu"] == pytest.approx(row["achieved_flops_per_s"] / report["peak"]["flops_per_s"])
            assert row["peak_memory_mb"] == pytest.approx(row["state_memory_mb"] + row["step_memory_mb"])
        ratios = report["ratios"][mode]
        assert set(ratios) == {"vitlab/timm", "vitlab/vitlab_ckpt"}
        for name, ratio in ratios.items():
            assert ratio.keys() == RATIO_KEYS
            other = name.split("/")[1]
            assert ratio["throughput"] == pytest.approx(rows[other]["median_ms"] / rows["vitlab"]["median_ms"])
            assert ratio["throughput_paired_min"] <= ratio["throughput_paired_max"]


def test_memory_figures_are_the_tensors_that_exist(report):
    model = __import__("vitlab").model.ViT(tiny(depth=4))
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # (the draw sites' numbers: model/draws.py)
    batch = 4 * 3 * 32 * 32 * 4 + 4 * 8  # images fp32 + int64 labels
    train, infer = report["results"]["train"], report["results"]["infer"]
    # Weights (and buffers), then AdamW's two moments (and a step counter per tensor) while training.
    assert 0 < buffers < 100 and infer["vitlab"]["state_memory_mb"] * MB == pytest.approx(4 * params + buffers + batch)
    assert 3 * 4 * params + batch < train["vitlab"]["state_memory_mb"] * MB < 3 * 4 * params + batch + 4096
    # Same weights and the same optimizer state in timm (no buffers in its model; a few bytes in ours).
    assert train["timm"]["state_memory_mb"] == pytest.approx(train["vitlab"]["state_memory_mb"], rel=0.01)
    # Gradient checkpointing keeps block inputs only: the step needs less memory, the weights do not change.
    assert train["vitlab_ckpt"]["step_memory_mb"] < train["vitlab"]["step_memory_mb"]
    assert train["vitlab_ckpt"]["state_memory_mb"] == train["vitlab"]["state_memory_mb"]
    assert report["ratios"]["train"]["vitlab/vitlab_ckpt"]["step_memory"] > 1


def test_step_peak_bytes_counts_live_tensors_on_cpu():
    def two_at_once():
        a = torch.ones(1000, 1000)
        b = torch.ones(1000, 1000)
        del a, b
        torch.ones(500, 1000)

    assert step_peak_bytes(two_at_once, torch.device("cpu")) == pytest.approx(8_000_000, rel=1e-3)
    view = torch.ones(10, 10)
    assert tensor_bytes([view, view[1:], view.t()]) == 400  # one storage, counted once


def test_contenders_start_from_the_same_weights_and_step_alike():
    cfg = tiny()
    b = BenchmarkConfig(contenders=("vitlab", "timm", "timm_ckpt"), timm_optimizer="timm")
    torch.manual_seed(0)
    contenders = build_contenders(cfg, b, OptimConfig(fused=None), torch.device("cpu"))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    losses = [c.loss(x, y).item() for c in contenders]
    assert losses == pytest.approx([losses[0]] * 3, abs=1e-6)
    assert contenders[2].model.grad_checkpointing and not contenders[1].model.grad_checkpointing
    for c in contenders:
        c.step("train", x, y)
        assert isinstance(c, Contender) and all(p.grad is None for p in c.model.parameters())
    # One AdamW step from the same point with the same hyper-parameters: the same weights after it.
    ours, theirs = contenders[0].model.state_dict(), contenders[1].model.state_dict()
    torch.testing.assert_close(ours["head.weight"], theirs["head.weight"], atol=1e-6, rtol=0)
    assert peak_matmul_flops(torch.device("cpu"), torch.float32, size=64, repeats=2)["flops_per_s"] > 0


def test_the_step_variants_change_one_thing_of_vitlabs_step(monkeypatch):
    """vitlab_unfused: AdamW without its fused kernel; vitlab_cudagraphs: compiled with mode reduce-overhead where the
    others are not compiled; vitlab_cudnn: the same step here (a CPU has no cuDNN kernel to choose); same weights."""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append((type(self).__name__, kw)))
    b = BenchmarkConfig(contenders=("vitlab", "vitlab_unfused", "vitlab_cudagraphs", "vitlab_cudnn"))
    base, unfused, graphs, cudnn = build_contenders(tiny(), b, OptimConfig(fused=True), torch.device("cpu"))
    assert [c.optimizer.defaults["fused"] for c in (base, unfused, graphs, cudnn)] == [True, False, True, True]
    assert compiled == [("ViT", {"mode": "reduce-overhead"})]
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    assert cudnn.loss(x, y).item() == pytest.approx(base.loss(x, y).item(), abs=1e-6)


def test_overhead_mode_times_lightning_a_bare_lightning_module_and_a_plain_loop(tmp_path: Path):
    run_dir = tmp_path / "run"
    r = run_cli(
        "benchmark",
        "benchmark.task=overhead",
        "benchmark.overhead.epochs=1",
        "benchmark.overhead.rounds=2",
        'benchmark.train_overrides=["model.depth=1","data.batch_size=256","logger=csv","progress_bar=none"]',
        f"hydra.run.dir={run_dir}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((run_dir / "benchmark.json").read_text())
    assert report["train_overrides"][0] == "model.depth=1"
    for loop in ("lightning", "bare_lightning", "plain"):
        res = report["results"][loop]
        assert res["steps_per_epoch"] == 4  # 1,257 training digits // 256 (drop_last)
        assert len(res["step"]["times_ms"]) == 2 * 4 and len(res["epoch"]["times_ms"]) == 2
    for floor in ("plain", "bare_lightning"):
        assert report["ratios"][f"lightning/{floor}"]["step_time"] == pytest.approx(
            report["results"]["lightning"]["step"]["median_ms"] / report["results"][floor]["step"]["median_ms"]
        )
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()  # vitlab.train's callbacks ran, in this run dir
    refused = run_cli("benchmark", "benchmark.task=overhead", "model=vit_s16", f"hydra.run.dir={tmp_path / 'r2'}")
    assert refused.returncode == 2 and "benchmark.train_overrides" in refused.stderr


def test_pipeline_times_the_train_loader_against_the_old_one_timms_and_a_decode_and_crop_ceiling(tmp_path: Path):
    from tests.helpers.images import image_tree

    image_tree(tmp_path / "photos", per_class=8, size=(30, 40))
    packed = run_cli(
        "pack", "data=imagefolder", f"data.data_dir={tmp_path / 'photos'}", f"out={tmp_path / 'shards'}", cwd=tmp_path
    )
    assert packed.returncode == 0, packed.stderr[-2000:]
    run_dir = tmp_path / "run"
    overrides = [
        "data=imagefolder",
        f"data.data_dir={tmp_path / 'photos'}",
        "data.batch_size=4",
        "data.num_workers=1",
        "model.img_size=16",
        "data.train_transform.random_erasing=0.25",
    ]
    r = run_cli(
        "benchmark",
        "benchmark.task=pipeline",
        "benchmark.pipeline.batches=2",
        "benchmark.pipeline.warmup_batches=1",
        "benchmark.pipeline.rounds=2",
        f"benchmark.pipeline.shards={tmp_path / 'shards'}",  # the same images packed: a streaming loader too
        "benchmark.pipeline.policies=[rand-m9-mstd0.5-inc1,3a]",  # a loader per augmentation policy
        "benchmark.train_overrides=[" + ",".join(f'"{o}"' for o in overrides) + "]",
        f"hydra.run.dir={run_dir}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((run_dir / "benchmark.json").read_text())
    assert report["loader"] == {
        "batch_size": 4,
        "num_workers": 1,
        "prefetch_factor": 2,
        "persistent_workers": True,
        "batch_dtype": "uint8",
        "batch_shape": [4, 3, 16, 16],
        "train_images": 16,
    }
    # (device_decode: data.decode=device, decoded and augmented in this process on the CPU)
    assert set(report["results"]) == {
        "vitlab", "float32_workers", "ceiling", "timm", "device_decode", "streaming", "vitlab[rand-m9-mstd0.5-inc1]",
        "vitlab[3a]",
    }  # fmt: skip
    for name, row in report["results"].items():
        assert len(row["images_per_s_rounds"]) == 2 and row["images_per_s"] > 0
        if name != "ceiling":
            assert report["ratios"][f"{name}/ceiling"] == pytest.approx(
                row["images_per_s"] / report["results"]["ceiling"]["images_per_s"]
            )


def test_end2end_divides_vitlab_trains_steady_state_by_the_bare_step(tmp_path: Path):
    run_dir = tmp_path / "run"
    r = run_cli(
        "benchmark", "benchmark.task=end2end", "benchmark.end2end.warmup_steps=2", "benchmark.end2end.steps=10",
        "benchmark.repeats=2", "benchmark.warmup=1",
        'benchmark.train_overrides=["data=fake","data.num_train=64","data.batch_size=8","data.num_workers=0",'
        '"model.img_size=16","model.patch_size=8","model.embed_dim=16","model.depth=1","model.num_heads=2",'
        '"logger=csv","progress_bar=none"]',
        f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((run_dir / "benchmark.json").read_text())
    assert report["batch_size"] == 8 and report["precision"] == "fp32" and report["compile"] is False
    assert report["model"]["embed_dim"] == 16 and report["train"]["steps"] == 10
    train, bare = report["train"]["images_per_s"], report["bare_step"]["images_per_s"]
    assert train == pytest.approx(10 * 8 / report["train"]["seconds"])  # 8 steps an epoch: the window spans two
    assert report["train"]["epoch_ends_left_out_s"] > 0  # the epoch end between them (validation, checkpoints)
    assert bare == pytest.approx(8 / (report["bare_step"]["median_ms"] / 1e3))
    assert report["ratios"]["train/bare_step"] == pytest.approx(train / bare)
    two = run_cli(
        "benchmark", "benchmark.task=end2end", 'benchmark.train_overrides=["trainer=ddp_cpu","trainer.devices=2"]',
        f"hydra.run.dir={tmp_path / 'r2'}",
    )  # fmt: skip
    assert two.returncode == 2 and "measures one device: set trainer.devices=1" in two.stderr


def test_end2end_window_leaves_out_validation_and_epoch_ends(monkeypatch):
    """Lightning validates after an epoch's last batch, before on_train_epoch_end: the window pauses at whichever
    comes first (a first validation under torch.compile compiles for seconds) and goes on with training, at the
    next epoch's start or, after a validation inside an epoch, at its next batch. An epoch's start to its first batch
    (the loader refilling) stays in, and is summed apart."""
    from types import SimpleNamespace

    from vitlab.benchmark import end2end

    clock = iter([0.0, 2.0, 11.0, 11.5, 12.0, 13.0, 14.0, 15.0, 20.0, 21.0]).__next__
    monkeypatch.setattr(end2end.time, "perf_counter", clock)
    monkeypatch.setattr(end2end, "sync", lambda device: None)
    w, module, trainer = end2end.Window(start=2, steps=3), SimpleNamespace(device="cpu"), SimpleNamespace()
    batch = (None, [0] * 4)

    def step(n):
        trainer.global_step, trainer.should_stop = n, False
        w.on_train_batch_end(trainer, module, None, batch, 0)

    step(2)  # t0 = 0
    step(3)
    w.on_validation_start(trainer, module)  # paused at 2 (the validation compiles)
    w.on_validation_end(trainer, module)
    w.on_train_epoch_end(trainer, module)  # already paused: no clock read
    w.on_train_epoch_start(trainer, module)  # 11: 9 s left out
    w.on_train_batch_start(trainer, module, batch, 0)  # 11.5: the epoch's first batch came after 0.5 s
    step(4)
    w.on_validation_start(trainer, module)  # 12: a validation inside the epoch
    w.on_train_batch_start(trainer, module, batch, 0)  # 13: 1 s left out
    w.on_train_epoch_start(trainer, module)  # 14, not paused: an epoch start, counted
    w.on_train_batch_start(trainer, module, batch, 0)  # 15: its first batch
    step(5)  # t1 = 20
    assert trainer.should_stop and w.images == 12
    assert w.paused == 10.0 and w.seconds == 10.0 and w.epoch_starts == 1.5


def test_timm_loader_gives_timms_uint8_batches_of_the_same_images(tmp_path: Path):
    from timm.data.loader import fast_collate

    from tests.helpers.images import image_tree
    from vitlab.benchmark.pipeline import timm_loader
    from vitlab.data.imagefolder import ImageFolderDataModule

    image_tree(tmp_path / "photos", per_class=4, size=(30, 40))
    settings = {"color_jitter": 0.4, "grayscale_prob": 0.2}
    dm = ImageFolderDataModule(
        data_dir=str(tmp_path / "photos"), num_classes=2, img_size=16, batch_size=4, num_workers=0, on_device=False,
        train_transform=settings,
    )  # fmt: skip
    dm.setup("fit")
    loader = timm_loader(dm)
    assert loader.collate_fn is fast_collate and loader.batch_size == 4 and len(loader) == len(dm.train_dataloader())
    x, y = next(iter(loader))
    assert x.dtype == torch.uint8 and x.shape == (4, 3, 16, 16) and y.dtype == torch.int64
    tf = repr(loader.dataset.transform)
    assert "bilinear bicubic" in tf and "ColorJitter" in tf and "RandomGrayscale" in tf
    shifted = ImageFolderDataModule(
        data_dir=str(tmp_path / "photos"), num_classes=2, img_size=16, batch_size=4, train_transform={"shift": 2},
    )  # fmt: skip
    shifted.setup("fit")
    assert timm_loader(shifted) is None  # timm has no shift: no row rather than another pipeline under its name
