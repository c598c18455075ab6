"""The open GPU points, in priority order, each under its own time limit (experiments/gpu/README.md).

    bash experiments/gpu/run.sh                          # on a lent GPU: installs the carried wheels, then this
    python experiments/gpu/points.py OUT                 # the points, results in OUT/results.json
    python experiments/gpu/points.py OUT --dry-run       # the same commands at tiny sizes on the CPU (make test)

Each point is one or more of vitlab's own commands, as users type them, with the sizes of the point (the dry run
swaps in tiny ones: the same code path, imports, configs and every command's start). A point runs under its own time
limit: past it, its process group is stopped (SIGTERM, then SIGKILL 10 s later) and the next point starts; a point
that would start with less than its minimum left before the deadline is skipped and said so. After every point,
OUT/results.json holds everything measured so far (each command's benchmark.json, metrics.json or JSON lines, and
its log's last lines): one file, as the device brings back at most 8. `report.py` turns it into the studies' tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Command:
    """One command line: `args` as a user types them at GPU sizes; `dry` replaces (or adds) overrides by key."""

    module: str  # python -m <module>, or a script path relative to the repository
    args: dict[str, str]
    dry: dict[str, str | None | bool] = field(default_factory=dict)
    run_dir: bool = True  # a Hydra command: it gets hydra.run.dir

    def argv(self, dry: bool, run_dir: Path) -> list[str]:
        """Hydra overrides as key=value; options (`-k`, `--key`) as key, value; a value of None: the key alone, of
        False (in `dry`): the key dropped. `{run_dir}` in a value is this command's run directory, `{work}` the
        point's (shared by its commands: one writes a folder, the next reads it)."""
        values = {**self.args, **(self.dry if dry else {})}
        parts = []
        for key, value in values.items():
            if value is False:
                continue
            if value is not None:
                value = value.replace("{run_dir}", str(run_dir)).replace("{work}", str(run_dir.parent))
            if value is None:
                parts.append(key)
            elif key.startswith("-"):
                parts += [key, value]
            else:
                parts.append(f"{key}={value}")
        parts = [p for part in parts for p in (gpu_tests() if part == "{gpu_tests}" else [part])]
        head = [self.module] if self.module.endswith(".py") else ["-m", self.module]
        return [sys.executable, *head, *parts, *([f"hydra.run.dir={run_dir}"] if self.run_dir else [])]


def gpu_tests() -> list[str]:
    """The test files that hold GPU tests (marked `gpu`): collecting only those, the device needs only their imports."""
    return sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in f.read_text())


@dataclass
class Point:
    name: str
    study: str  # experiments/<study>/ holds its table
    question: str
    limit_s: int  # stopped past this
    min_s: int  # skipped when less than this is left
    commands: list[Command]


def overrides(**values: str) -> dict[str, str]:
    return {k.replace("__", "."): v for k, v in values.items()}


def train_list(*items: str) -> str:
    """benchmark.train_overrides' value: vitlab.train's overrides, as a Hydra list of quoted strings."""
    return "[" + ",".join(f'"{item}"' for item in items) + "]"


# The dry run proves, as cheaply as it can, that every command parses its arguments, starts, runs its code and writes
# its result: each command with its `dry` sizes (below: one block, 32 px, a few steps), and in DRY_ENV's environment,
# where torch.compile is a no-op (TORCH_COMPILE_DISABLE: the model it wraps runs eagerly). On the CPU, Inductor's
# compiles took most of a dry run and tell nothing of the GPU's (Triton's kernels, CUDA graphs); compiling on the CPU
# is tested in tests/training/test_compile.py. A new point needs nothing more: its compiled commands run eagerly here.
DRY_ENV = {"TORCH_COMPILE_DISABLE": "1"}
CSV = ("logger=csv", "progress_bar=none")
# The dry run's ViT: each point's model's code, one block of width 64 (4 heads), 4 patches.
TINY = ("model.depth=1", "model.img_size=32", "model.embed_dim=64", "model.num_heads=4")
TINY_BENCH = overrides(
    model__depth="1", model__img_size="32", model__embed_dim="64", model__num_heads="4", benchmark__batch_size="2",
    benchmark__repeats="2", benchmark__warmup="1", benchmark__peak_matmul_size="256",
)  # fmt: skip
SHORT_E2E = overrides(benchmark__end2end__warmup_steps="2", benchmark__end2end__steps="3", benchmark__repeats="2",
                      benchmark__warmup="1", benchmark__peak_matmul_size="256")  # fmt: skip


def end2end(train: tuple[str, ...], dry_train: tuple[str, ...]) -> Command:
    return Command(
        "vitlab.benchmark",
        overrides(benchmark__task="end2end", benchmark__train_overrides=train_list(*train, *CSV)),
        {**SHORT_E2E, "benchmark.train_overrides": train_list(*dry_train, *CSV)},
    )


FAKE_B16 = ("model=vit_b16", "data=fake", "data.num_train=12800", "trainer=gpu", "data.batch_size=256")
FAKE_TINY = ("model=vit_b16", *TINY, "data=fake", "data.num_train=64", "trainer=cpu", "data.batch_size=8")
TINY_TRAIN = dict(item.split("=") for item in TINY)


def few_steps(steps: int, dry: dict[str, str], **values: str) -> Command:
    """vitlab.train for `steps` optimizer steps on fake data, not tested, logged to CSV (`values`: its own overrides,
    `dry`: the dry run's replacements, besides the tiny model)."""
    short = overrides(data="fake", trainer__max_steps=str(steps), trainer__max_epochs="-1", test="false",
                      logger="csv", progress_bar="none")  # fmt: skip
    return Command("vitlab.train", overrides(**values) | short, TINY_TRAIN | dry)


def jpeg_folder(dry_train: int, dry_val: int) -> Command:
    """experiments/gpu/jpeg_folder.py: 5,120 photo-sized JPEGs of 10 classes under {work}/jpegs (tiny in a dry run)."""
    return Command(
        "experiments/gpu/jpeg_folder.py",
        {"--out": "{work}/jpegs", "--train": "5120", "--val": "512", "--classes": "10", "--size": "500x375"},
        {"--train": str(dry_train), "--val": str(dry_val), "--classes": "2", "--size": "48x36"},
        run_dir=False,
    )


def timm_train(compiled: bool) -> Command:
    """timm's own train.py (reference/timm_train.py, verbatim) on {work}/jpegs as its users run it: its defaults but
    B/16, batch 256, bf16, 15 workers, 3 epochs; `compiled`: --torchcompile inductor."""
    compile_args = {"--torchcompile": "inductor"} if compiled else {}
    return Command(
        "experiments/gpu/reference/timm_train.py",
        {
            "--data-dir": "{work}/jpegs",
            "--device": "cuda",
            "--val-split": "val",
            "--model": "vit_base_patch16_224",
            "--num-classes": "10",
            "-b": "256",
            "--epochs": "3",
            "--warmup-epochs": "0",
            "--amp": None,
            "--amp-dtype": "bfloat16",
            "-j": "15",
            "--pin-mem": None,
            **compile_args,
            "--log-interval": "5",
            "--checkpoint-hist": "1",
            "--output": "{run_dir}",
        },
        {
            "--device": "cpu",
            "--model-kwargs": "depth=1",
            "-b": "8",
            "--epochs": "1",
            "-j": "1",
            "--amp": False,
            "--amp-dtype": False,
            "--pin-mem": False,
        }
        | ({"--torchcompile": False} if compiled else {}),
        run_dir=False,
    )  # fmt: skip


def float8_sweep() -> Command:
    """vitlab.train -m: ViT-L/16 and ViT-H/14, each at bf16-mixed and float8, compiled, one epoch of 200 steps of batch
    64 on fake data (seed 42: the same weights and images at both precisions), no checkpoints: each job's metrics.json
    has train/loss, the mean of the 200 steps' losses, and the FLOP/s of the last 50 steps. One process for the four
    (the dry run: the two networks tiny, uncompiled, in fp32, 2 steps: float8 is refused on a CPU)."""
    short = overrides(data="fake", trainer__max_steps="200", trainer__max_epochs="-1", test="false", logger="csv",
                      progress_bar="none", data__num_train=str(200 * 64), data__batch_size="64",
                      trainer__limit_val_batches="1", trainer__num_sanity_val_steps="0")  # fmt: skip
    sweep = {"-m": None, "model": "vit_l16,vit_h14", "trainer": "gpu", "trainer.precision": "bf16-mixed,float8",
             "compile": "true"}  # fmt: skip
    unsaved = {"~callbacks.model_checkpoint": None, "~callbacks.last_checkpoint": None, "hydra.sweep.dir": "{run_dir}"}
    dry = {"trainer": "cpu", "trainer.precision": "32-true", "compile": False, "trainer.max_steps": "2",
           "data.num_train": "16", "data.batch_size": "8", "model.depth": "1", "model.img_size": "112"}  # fmt: skip
    return Command("vitlab.train", sweep | short | unsaved, dry, run_dir=False)


def strategy_bench(train: tuple[str, ...], dry_train: tuple[str, ...]) -> Command:
    """vitlab.benchmark task=strategies on one process (DDP's preset): vitlab.train's step time, images/s and peak
    memory with `train`'s overrides (bf16-mixed, fake data, 5 + 20 steps)."""
    return Command(
        "vitlab.benchmark",
        overrides(benchmark__task="strategies", benchmark__strategies__names="[ddp]",
                  benchmark__strategies__devices="1",
                  benchmark__train_overrides=train_list(*train, "data=fake", "trainer.precision=bf16-mixed", *CSV)),
        {"benchmark.strategies.names": "[ddp_cpu]", "benchmark.strategies.warmup_steps": "1",
         "benchmark.strategies.steps": "2",
         "benchmark.train_overrides": train_list(*dry_train, *TINY, "data=fake", "data.num_train=32",
                                                 "data.batch_size=8", *CSV)},
    )  # fmt: skip


def one_step_checkpoint(model: str) -> Command:
    """One step of `model` on fake data: a checkpoint ({work}/0/checkpoints/last.ckpt) that the point's other
    commands start from or distil from (the device reaches no weights online), its normalisation named (a teacher's
    is read from it)."""
    return few_steps(1, {"trainer": "cpu", "data.num_train": "16", "data.batch_size": "8"}, model=model,
                     trainer="gpu", data__batch_size="64", data__num_train="640", data__mean="[0.5,0.5,0.5]",
                     data__std="[0.5,0.5,0.5]")  # fmt: skip


BASE_CKPT = "{work}/0/checkpoints/last.ckpt"

# In priority order: the two costs this project removes on a GPU (FSDP on one device, the digits' launch-bound step),
# the suite's GPU tests, then the compiled step and end to end, then the rest (issue 57's list).
POINTS = [
    Point(
        "fsdp_one_gpu",
        "sharding",
        "trainer=fsdp on one GPU against trainer=ddp (B/16, batch 64)",
        150,
        70,
        [
            Command(
                "vitlab.benchmark",
                overrides(
                    benchmark__task="strategies",
                    benchmark__strategies__names="[ddp,fsdp]",
                    benchmark__strategies__devices="1",
                    benchmark__train_overrides=train_list(
                        "model=vit_b16", "data=fake", "data.num_train=6400", "data.batch_size=64", *CSV
                    ),
                ),
                {
                    "benchmark.strategies.names": "[ddp_cpu,fsdp_cpu]",
                    "benchmark.strategies.warmup_steps": "2",
                    "benchmark.strategies.steps": "3",
                    "benchmark.train_overrides": train_list(
                        "model=vit_b16", *TINY, "data=fake", "data.num_train=64", "data.batch_size=8", *CSV
                    ),
                },
            )
        ],
    ),
    Point(
        "digits_cudagraphs",
        "throughput",
        "the digits default on the GPU eager and with compile=reduce-overhead",
        150,
        60,
        [
            end2end(("trainer=gpu",), ("trainer=cpu",)),
            end2end(("trainer=gpu", "compile=reduce-overhead"), ("trainer=cpu", "compile=reduce-overhead")),
        ],
    ),
    Point(
        "pytest_gpu",
        "gpu",
        "the suite's GPU tests (pytest -m gpu)",
        240,
        40,
        [
            Command(
                "pytest",  # -v: each test's outcome as it ends (a point stopped at its limit still says which failed)
                {"-m": "gpu", "-v": None, "--tb": "short", "-p": "no:cacheprovider", "{gpu_tests}": None},
                run_dir=False,
            )
        ],
    ),
    Point(
        "b16_compiled",
        "throughput",
        "vitlab's compiled B/16 step against timm's compiled (bf16, batch 256)",
        240,
        120,
        [
            Command(
                "vitlab.benchmark",
                overrides(
                    model="vit_b16",
                    benchmark__batch_size="256",
                    benchmark__precision="bf16",
                    benchmark__compile="true",
                    benchmark__modes="[train]",
                ),
                TINY_BENCH,
            )
        ],
    ),
    Point(
        "b16_dinov3_compiled",
        "rope",
        "vitlab's compiled DINOv3 B/16 step (RoPE, storage tokens) against timm's compiled (bf16, batch 256)",
        240,
        120,
        [
            Command(
                "vitlab.benchmark",
                overrides(
                    model="vit_b16_dinov3",
                    benchmark__batch_size="256",
                    benchmark__precision="bf16",
                    benchmark__compile="true",
                    benchmark__modes="[train]",
                ),
                TINY_BENCH | {"benchmark.contenders": "[vitlab]"},  # (the dry run compiles ours alone: half the time)
            )
        ],
    ),
    Point(
        "b16_end2end_compiled",
        "throughput",
        "vitlab.train end to end, compiled, against its compiled bare step",
        200,
        100,
        [end2end((*FAKE_B16, "compile=true"), (*FAKE_TINY, "compile=true"))],
    ),
    Point(
        "mfu_b16",
        "throughput",
        "what closes compiled B/16 from 44% toward 55% MFU: cuDNN attention, AdamW unfused (the fused kernel's worth), "
        "CUDA graphs for the forward and backward, each against the compiled step in the same rounds (bf16, batch 256)",
        300,
        150,
        [  # (the dry run leaves vitlab_cudagraphs out: compiling on the CPU is digits_cudagraphs' dry run's already)
            Command(
                "vitlab.benchmark",
                overrides(
                    model="vit_b16",
                    benchmark__batch_size="256",
                    benchmark__precision="bf16",
                    benchmark__compile="true",
                    benchmark__modes="[train]",
                    benchmark__contenders="[vitlab,vitlab_cudnn,vitlab_unfused,vitlab_cudagraphs]",
                ),
                TINY_BENCH
                | {"benchmark.compile": "false", "benchmark.contenders": "[vitlab,vitlab_cudnn,vitlab_unfused]"},
            )
        ],
    ),
    Point(
        "float8",
        "precision",
        "trainer.precision=float8 against bf16-mixed, compiled: ViT-L/16 and ViT-H/14 (batch 64), step time, FLOP/s "
        "and the mean loss of 200 steps",
        600,
        150,
        [
            float8_sweep(),
        ],
    ),
    Point(
        "timm_train",
        "throughput",
        "timm's train.py against vitlab.train on one folder of JPEGs (B/16, batch 256, bf16, eager, 15 workers)",
        300,
        150,
        [
            jpeg_folder(dry_train=32, dry_val=8),
            timm_train(compiled=False),
            end2end(
                (
                    "model=vit_b16",
                    "data=imagefolder",
                    "data.data_dir={work}/jpegs",
                    "data.on_device=false",
                    "data.batch_size=256",
                    "data.num_workers=15",
                    "data.train_transform.color_jitter=0.4",
                    "trainer=gpu",
                ),
                (
                    "model=vit_b16",
                    *TINY,
                    "data=imagefolder",
                    "data.data_dir={work}/jpegs",
                    "data.on_device=false",
                    "data.batch_size=8",
                    "data.num_workers=1",
                    "data.train_transform.color_jitter=0.4",
                    "trainer=cpu",
                ),
            ),  # timm's defaults: RandomResizedCrop 0.08-1, flip, colour jitter 0.4; 3 epochs of 20 steps
        ],
    ),
    Point(
        "selective_compiled",
        "checkpointing",
        "ViT-L/16 selective checkpointing under compile=regional against none and every block (bf16, batch 64)",
        200,
        100,
        [
            Command(
                "vitlab.benchmark",
                overrides(
                    model="vit_l16",
                    benchmark__batch_size="64",
                    benchmark__precision="bf16",
                    benchmark__compile="regional",
                    benchmark__modes="[train]",
                    benchmark__contenders="[vitlab,vitlab_selective,vitlab_ckpt]",
                    benchmark__repeats="6",
                ),
                TINY_BENCH,
            )
        ],
    ),
    Point(
        "vit_g_offload",
        "sharding",
        "ViT-gigantic/14 on one GPU under trainer=fsdp with cpu_offload",
        180,
        90,
        [
            few_steps(
                4,
                {"model": "vit_b16", "trainer": "fsdp_cpu", "trainer.strategy.cpu_offload": "false"},
                model="vit_gigantic14",
                trainer="fsdp",
                trainer__devices="1",
                trainer__strategy__cpu_offload="true",
                data__num_train="64",
                data__batch_size="8",
            )  # fmt: skip
        ],  # (cpu_offload is refused on a CPU: nothing to move)
    ),
    Point(
        "regional_depth24",
        "regional_compile",
        "compile time, whole against regional, of a B/16-wide ViT at depth 24",
        240,
        120,
        [
            Command(
                "experiments/regional_compile/measure.py",
                {
                    "--device": "cuda",
                    "--dim": "768",
                    "--heads": "12",
                    "--img": "224",
                    "--patch": "16",
                    "--depths": "24",
                    "--out": "{run_dir}/results_cuda.json",
                },
                {"--device": "cpu", "--dim": "64", "--heads": "4", "--img": "32", "--patch": "8", "--depths": "1"},
                run_dir=False,
            )
        ],
    ),
    Point(
        "auto_batch_sizes",
        "sharding",
        "data.batch_size=auto and data.train_img_sizes on a GPU (B/16)",
        150,
        60,
        [
            few_steps(  # (in the dry run, auto's batch is the 64 images: the CPU's memory holds all 2,048)
                6,
                {"trainer": "cpu", "data.num_train": "64"},
                model="vit_b16",
                data__num_train="2048",
                trainer="gpu",
                data__batch_size="auto",
            ),
            few_steps(
                6,
                {"trainer": "cpu", "data.batch_size": "8", "data.train_img_sizes": "[16,32]"},
                model="vit_b16",
                data__num_train="2048",
                trainer="gpu",
                data__batch_size="256",
                data__train_img_sizes="[160,224]",
                model__dynamic_img_size="true",
            ),  # fmt: skip
        ],
    ),
    Point(
        "naflex_tokens",
        "naflex",
        "padded NaFlex tokens/s against the square run at equal tokens (naflexvit B/16, 256 patches, batch 256)",
        150,
        60,
        [
            Command(
                "experiments/naflex/study.py",  # NaFlex's padded dict, squares as the dict (masked), squares as images
                {
                    "--tokens": None,
                    "--device": "cuda",
                    "--model": "naflexvit_base_patch16_gap",
                    "--seq": "256",
                    "--batch": "256",
                    "--steps": "10",
                    "--rounds": "3",
                },
                {
                    "--device": "cpu",
                    "--seq": "16",
                    "--batch": "2",
                    "--steps": "1",
                    "--rounds": "1",
                    "--model-kwargs": "depth=1,embed_dim=32,num_heads=2",
                },
                run_dir=False,
            )  # fmt: skip
        ],
    ),
    Point(
        "peft_l16",
        "peft",
        "ViT-L/16 LoRA r=16 on qkv against the full fine-tune of the same start: step time, images/s, peak memory "
        "(bf16-mixed, batch 64)",
        300,
        120,
        [
            one_step_checkpoint("vit_l16"),
            *(
                strategy_bench(
                    ("model=vit_l16", f"model.pretrained={BASE_CKPT}", *extra, "data.batch_size=64"),
                    ("model=vit_l16", f"model.pretrained={BASE_CKPT}", *extra),
                )
                for extra in (("peft=lora", "peft.rank=16"), ())
            ),
        ],
    ),
    Point(
        "distill_l16_s16",
        "feature_distillation",
        "a ViT-S/16 student token-distilled from a ViT-L/16 teacher without labels, against the student alone: "
        "images/s, peak memory (bf16-mixed, batch 64)",
        300,
        120,
        [
            one_step_checkpoint("vit_l16"),
            *(
                strategy_bench(("model=vit_s16", *extra, "data.batch_size=64"), ("model=vit_s16", *extra))
                for extra in (
                    (
                        "objective=distill",
                        "objective.kind=tokens",
                        f"objective.teacher={BASE_CKPT}",
                        "data.labels=false",
                    ),
                    (),
                )
            ),  # fmt: skip
        ],
    ),
    Point(
        "jpeg_device",
        "throughput",
        "JPEGs decoded on the GPU (data.decode=device) against the worker path and timm's train.py, compiled B/16, "
        "batch 256, bf16, 15 workers (goal: >= 0.9 of the compiled bare step)",
        420,
        200,
        [
            jpeg_folder(dry_train=16, dry_val=4),
            timm_train(compiled=True),
            *(
                end2end(
                    (
                        "model=vit_b16",
                        "data=imagefolder",
                        "data.data_dir={work}/jpegs",
                        f"data.decode={decode}",
                        "data.on_device=false",
                        "data.batch_size=256",
                        "data.num_workers=15",
                        "data.train_transform.color_jitter=0.4",
                        "trainer=gpu",
                        "compile=true",
                    ),
                    (
                        "model=vit_b16",
                        *TINY,
                        "data=imagefolder",
                        "data.data_dir={work}/jpegs",
                        f"data.decode={decode}",
                        "data.on_device=false",
                        "data.batch_size=8",
                        "data.num_workers=1",
                        "trainer=cpu",
                    ),
                )  # fmt: skip
                for decode in ("workers", "device")
            ),  # timm's defaults: RandomResizedCrop 0.08-1, flip, colour jitter 0.4; 40 steps, 20 an epoch
        ],
    ),
]


# timm's train.py, an epoch's last line: "Train: 2 [  19/20 (100%)]  Loss: ... Time: 0.1s, 2.5/s  (avg s, avg/s) ..."
TIMM_TRAIN_LINE = re.compile(
    r"Train: (?P<epoch>\d+) \[\s*(?P<step>\d+)/(?P<steps>\d+) \(100%\)\].*?"
    r"Time: (?P<last_s>[\d.]+)s,\s*[\d.]+/s\s+\((?P<avg_s>[\d.]+)s,\s*(?P<avg_rate>[\d.]+)/s\)"
)


def result_of(run_dir: Path, log: str) -> object:
    """What a command measured: its benchmark.json or metrics.json, else the JSON lines it printed."""
    for name in ("benchmark.json", "metrics.json", "results_cuda.json", "results_cpu.json"):
        if (run_dir / name).is_file():
            return json.loads((run_dir / name).read_text())
    numbered = [d for d in run_dir.iterdir() if d.name.isdigit()] if run_dir.is_dir() else []
    jobs = sorted(numbered, key=lambda d: int(d.name))
    if jobs:  # a -m sweep, ended or stopped at its limit: each job's overrides and metrics.json (where it finished)
        return {"sweep": [{"overrides": sweep_overrides(d), **json_file(d / "metrics.json")} for d in jobs]}
    timm = [m.groupdict() for m in TIMM_TRAIN_LINE.finditer(log)]
    if timm:  # timm's train.py: the last epoch's last line holds that epoch's average step (its first batch's wait
        last = timm[-1]  # for the loader included) and the last step's time (the steady state)
        return {
            "timm_train": {
                "epoch": int(last["epoch"]),
                "steps": int(last["steps"]),
                "step_s": float(last["avg_s"]),
                "images_per_s": float(last["avg_rate"]),
                "last_step_s": float(last["last_s"]),
            }
        }
    rows = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows or None


def sweep_overrides(job_dir: Path) -> list[str]:
    """A -m sweep job's overrides, from Hydra's record of them (.hydra/overrides.yaml: a list of strings)."""
    path = job_dir / ".hydra" / "overrides.yaml"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [line[2:].strip().strip("'\"") for line in lines if line.startswith("- ")]


def json_file(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def run(argv: list[str], limit: float, log_path: Path, env: dict | None = None) -> tuple[int | str, float]:
    """argv in its own process group (with `env`, or this process's environment), stopped past `limit` seconds;
    (exit status or 'timeout', seconds)."""
    start = time.monotonic()
    with log_path.open("w") as log:
        p = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait(timeout=limit), time.monotonic() - start
        except subprocess.TimeoutExpired:
            _stop(p)
            return "timeout", time.monotonic() - start
        except BaseException:  # this script stopped (Ctrl-C, SIGTERM): its command too, in its own process group
            _stop(p)
            raise


def _stop(p: subprocess.Popen) -> None:
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
           "cpus": os.cpu_count()}  # fmt: skip
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: every command's start, quickly")
    p.add_argument("--deadline", type=float, default=560, help="seconds for all points together")
    p.add_argument("--only", default="", help="comma-separated point names, run in that order (all by default)")
    a = p.parse_args()
    by_name = {q.name: q for q in POINTS}  # --only a,b: those, in that order (a lease's left minutes, spent first)
    chosen = [by_name[n] for n in a.only.split(",") if n in by_name] if a.only else POINTS
    unknown = set(filter(None, a.only.split(","))) - {q.name for q in POINTS}
    if unknown:
        sys.exit(f"--only {sorted(unknown)}: not points; they are {[q.name for q in POINTS]}")
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vitlab-gpu-"))  # run directories (checkpoints stay here, not in OUT)
    # The run directories go when the points end, or are stopped (SIGTERM as Ctrl-C): a stopped dry run left 859 MB.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        _run_points(a, chosen, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_points(a: argparse.Namespace, chosen: list, work: Path) -> None:
    """Every chosen point's commands, their results into a.out/results.json as each point ends."""
    began = time.monotonic()
    report = {"dry_run": a.dry_run, "environment": environment(), "deadline_s": a.deadline, "points": []}
    for point in chosen:
        left = max(0.0, a.deadline - (time.monotonic() - began))
        entry = {"name": point.name, "study": point.study, "question": point.question, "commands": []}
        report["points"].append(entry)
        if left < point.min_s:
            entry["status"] = f"skipped: {left:.0f} s left, it needs {point.min_s}"
            print(f"[{point.name}] {entry['status']}", flush=True)
            continue
        limit = min(point.limit_s, left)
        t0 = time.monotonic()
        status = "ok"
        for i, command in enumerate(point.commands):
            run_dir = work / point.name / str(i)
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            argv = command.argv(a.dry_run, run_dir)
            if not command.run_dir:
                run_dir.mkdir(parents=True, exist_ok=True)
            log_path = work / point.name / f"{i}.log"
            remaining = limit - (time.monotonic() - t0)
            env = {**os.environ, **DRY_ENV} if a.dry_run else None
            rc, seconds = run(argv, remaining, log_path, env) if remaining > 1 else ("timeout", 0.0)
            log = log_path.read_text(errors="replace") if log_path.exists() else ""
            entry["commands"].append({
                "argv": [Path(argv[0]).name, *argv[1:]], "rc": rc, "seconds": round(seconds, 1),
                "result": result_of(run_dir, log), "log_tail": log.splitlines()[-60:],
            })  # fmt: skip
            if rc != 0:
                status = "timeout" if rc == "timeout" else f"failed (exit {rc})"
                break
        entry["status"], entry["seconds"] = status, round(time.monotonic() - t0, 1)
        print(f"[{point.name}] {status} in {entry['seconds']} s", flush=True)
        (a.out / "results.json").write_text(json.dumps(report, indent=1))
    (a.out / "results.json").write_text(json.dumps(report, indent=1))
    failed = [e["name"] for e in report["points"] if e.get("status") not in ("ok",) and "skipped" not in e["status"]]
    print(f"results: {a.out / 'results.json'}; not ok: {failed or 'none'}", flush=True)
    sys.exit(1 if failed and a.dry_run else 0)


if __name__ == "__main__":
    main()
