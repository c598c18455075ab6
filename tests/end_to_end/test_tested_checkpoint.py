"""A run's numbers are its checkpoint's: the test metrics `python -m vitlab.train` prints and writes are those of the
weights in the checkpoint it names, and `vitlab.eval` of that file gives them again, with an EMA (whose average the
checkpoints keep when the monitor is `val/acc_ema`, its raw weights when it is `val/acc`) in one process, under DDP
and under FSDP2; `val/acc_best`, handed to sweepers, follows the weights the monitor keeps."""

import csv
import json

import pytest

from tests.helpers.commands import run_cli

# Two short epochs and the whole test split (the eval command tests all of it).
SHORT = ["debug=limit", "progress_bar=none", "trainer.limit_test_batches=1.0", "callbacks=ema"]
RUNS = {
    "ema": [],
    "ema_raw_kept": ["callbacks.model_checkpoint.monitor=val/acc"],
    "ema_ddp": ["trainer=ddp_cpu", "trainer.devices=2"],
    "ema_fsdp": ["trainer=fsdp_cpu"],
}


def _val_column(run_dir, name):
    rows = csv.DictReader((run_dir / "csv" / "metrics.csv").open())
    return [float(r[name]) for r in rows if r.get(name)]


@pytest.mark.parametrize("name", list(RUNS))
def test_eval_of_the_tested_checkpoint_gives_the_runs_test_metrics(tmp_path, name):
    run_dir = tmp_path / "run"
    r = run_cli("train", *SHORT, *RUNS[name], f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    trained = json.loads((run_dir / "metrics.json").read_text())
    assert trained["tested_checkpoint"] == trained["best_checkpoint"]
    r = run_cli(
        "eval", f"ckpt_path={trained['tested_checkpoint']}", "progress_bar=none", f"hydra.run.dir={tmp_path / 'e'}"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    evaluated = json.loads((tmp_path / "e" / "metrics.json").read_text())
    for key in ("test/acc", "test/acc_top5", "test/loss"):
        assert trained[key] == pytest.approx(evaluated[key], abs=1e-6), key
    kept = "val/acc" if name == "ema_raw_kept" else "val/acc_ema"
    other = "val/acc_ema" if kept == "val/acc" else "val/acc"
    assert trained["val/acc_best"] == pytest.approx(max(_val_column(run_dir, kept)), abs=1e-6)
    # Two epochs of 3 steps from scratch: the average (decay 0.999) is far behind the raw weights, so the two
    # columns differ and the assertion above tells them apart.
    assert max(_val_column(run_dir, other)) != pytest.approx(max(_val_column(run_dir, kept)), abs=1e-3)
