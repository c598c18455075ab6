"""The sweep summary (cli/sweep.py SweepSummary): its rows and table from the jobs' directories."""

import json

from omegaconf import OmegaConf

from vitlab.cli.sweep import SweepSummary


def _job(sweep, n, overrides, metrics):
    job = sweep / str(n)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
    (job / "metrics.json").write_text(json.dumps(metrics))


def test_a_sweep_of_several_labels_an_image_shows_map_in_place_of_accuracy_best_first(tmp_path, capsys):
    """Its jobs log val/map_best and test/map, no accuracy: the summary's accuracy columns (empty before) are theirs,
    and the table is ordered by val/map_best (the optimised metric, as its jobs return it); a sweep that logs
    accuracy keeps its columns."""
    for n, (best, test) in enumerate([(0.41, 0.38), (0.57, 0.52)]):
        _job(tmp_path, n, [f"objective.loss={['bce', 'asl'][n]}"],
             {"val/map_best": best, "test/map": test, "test/loss": 0.4, "wall_time_s": 9.0})  # fmt: skip
    hydra = OmegaConf.create({"sweep": {"dir": str(tmp_path)}, "sweeper": {}})
    rows = SweepSummary().show(hydra, "val/acc_best")
    assert [(r["val/map_best"], r["test/map"]) for r in rows] == [(0.41, 0.38), (0.57, 0.52)]
    assert json.loads((tmp_path / "summary.json").read_text()) == rows and "val/acc_best" not in rows[0]
    shown = capsys.readouterr().out
    assert "best val/map_best first" in " ".join(shown.split()) and shown.index("0.57") < shown.index("0.41")
    other = tmp_path / "accuracy"
    _job(other, 0, ["optim.lr=0.1"], {"val/acc_best": 0.9, "test/acc": 0.8, "test/loss": 0.3, "wall_time_s": 9.0})
    (row,) = SweepSummary().show(OmegaConf.create({"sweep": {"dir": str(other)}, "sweeper": {}}), "val/acc_best")
    assert (row["val/acc_best"], row["test/acc"]) == (0.9, 0.8) and "val/map_best" not in row
