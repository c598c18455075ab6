"""python -m vitlab.benchmark as typed, the longer runs: the benchmarks' fit checks the W&B login as train does."""

import os
from pathlib import Path

import pytest

from tests.benchmark.test_benchmark import TINY
from tests.helpers.commands import run_cli


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("benchmark.precision=fp16", "benchmark.precision 'fp16' is not one of ['fp32', 'bf16']"),
        ("benchmark.contenders=[vitlab,jax]", "benchmark.contenders ['vitlab', 'jax'] must be distinct values"),
        ("benchmark.repeats=0", "benchmark.repeats 0 must be an integer >= 1"),
        ("benchmark.device=tpu", "benchmark.device 'tpu' is not one of auto, cpu, cuda"),
    ],
)
def test_bad_settings_fail_in_one_line(override, message, tmp_path: Path):
    r = run_cli("benchmark", *TINY, override, f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("task", ["overhead", "end2end"])
def test_the_benchmarks_fit_checks_the_wandb_login_as_train_does(task, tmp_path: Path):
    """run.build_fit is the one assembly of a fit: a benchmark of the training loop with logger=wandb and no login
    stops in one line before anything runs (it used to build the logger unchecked, and W&B then prompts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"HOME": str(tmp_path)}
    r = run_cli(
        "benchmark", f"benchmark.task={task}", 'benchmark.train_overrides=["logger=wandb"]', cwd=tmp_path, env=env,
        replace_env=True,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "error: logger=wandb needs a W&B login: run `wandb login`, set WANDB_API_KEY, or log offline with "
        "logger.wandb.offline=true (or WANDB_MODE=offline; `wandb sync` uploads later)"
    ]


def test_the_strategies_task_measures_ddp_against_fsdp_as_users_run_them(tmp_path: Path):
    """Each preset trained by vitlab.train on two CPU processes; the state each process holds is counted from its
    tensors: FSDP's is half of DDP's (up to the tokens, whole on rank 0)."""
    import json

    steps = ["benchmark.strategies.warmup_steps=2", "benchmark.strategies.steps=3"]
    r = run_cli("benchmark", "benchmark.task=strategies", *steps, f"hydra.run.dir={tmp_path / 'b'}")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "b" / "benchmark.json").read_text())
    ddp, fsdp = (report["results"][name] for name in ("ddp_cpu", "fsdp_cpu"))
    assert [len(x["ranks"]) for x in (ddp, fsdp)] == [2, 2] and all(x["step_ms"] > 0 for x in (ddp, fsdp))
    assert 0.45 < fsdp["state_mb_per_process"] / ddp["state_mb_per_process"] < 0.55
    assert fsdp["estimate_mb_per_process"] < ddp["estimate_mb_per_process"]
    assert "fsdp_cpu" in r.stdout and "state MB/process" in r.stdout
