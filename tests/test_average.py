"""python -m vitlab.average (issue 67, points 1-2): a run's best checkpoints averaged as timm's avg_checkpoints.py
averages them, the result taken by vitlab.eval; uniform and greedy soups over a sweep's jobs; bad input refused in one
line with nothing written."""

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.commands import run_cli
from tests.helpers.references import reference
from vitlab.convert.weights import read_checkpoint

TOP3 = (
    "debug=limit",
    "progress_bar=none",
    "trainer.max_epochs=3",
    "callbacks.model_checkpoint.save_top_k=3",
    "test=false",
)


@pytest.fixture(scope="module")
def run(compose_cfg_module, tmp_path_factory):
    """A digits run that kept its 3 best checkpoints (one per epoch), trained in this process (seconds)."""
    from vitlab.train import train

    out = tmp_path_factory.mktemp("top3") / "run"
    train(compose_cfg_module("train", list(TOP3), output_dir=out))
    return out


def _weights(path) -> dict:
    return {k: v for k, v in read_checkpoint(path)["state_dict"].items() if k.startswith("model.")}


def test_top_k_average_equals_timms_avg_checkpoints_and_the_mean_of_the_files(run, tmp_path, compose_cfg):
    from vitlab.average import average
    from vitlab.eval import evaluate

    record = average(compose_cfg("average", [f"run_dir={run}", "top_k=3"], output_dir=tmp_path / "avg"))
    files = [c["checkpoint"] for c in record["checkpoints"]]
    assert sorted(p.split("/")[-1] for p in files) == ["epoch_000.ckpt", "epoch_001.ckpt", "epoch_002.ckpt"]
    scores = [c["score"] for c in record["checkpoints"]]
    assert scores == sorted(scores, reverse=True)  # best first, by the run's val/acc
    ours = read_checkpoint(tmp_path / "avg" / "averaged.ckpt")
    mean = {k: torch.stack([_weights(f)[k].double() for f in files]).mean(0) for k in _weights(files[0])}
    assert ours["state_dict"].keys() == mean.keys() and ours["averaged"]["checkpoints"] == files
    for k, v in mean.items():
        torch.testing.assert_close(ours["state_dict"][k].double(), v, atol=1e-6, rtol=0)
    # timm's script, vendored verbatim, on the same files: --no-sort (vitlab checkpoints carry no timm `metric`)
    timm_avg, out = reference("timm", "avg_checkpoints"), tmp_path / "timm.pth"
    argv = ["avg_checkpoints.py", "--input", str(run / "checkpoints"), "--filter", "epoch_*.ckpt", "--no-sort"]
    sys.argv, saved = [*argv, "--output", str(out)], sys.argv
    try:
        timm_avg.main()
    finally:
        sys.argv = saved
    theirs = torch.load(out, weights_only=True)
    assert all(torch.equal(ours["state_dict"][k], theirs[k]) for k in mean)
    averaged = tmp_path / "avg" / "averaged.ckpt"
    metrics = evaluate(compose_cfg("eval", [f"ckpt_path={averaged}", "progress_bar=none"]))
    assert 0 <= metrics["test/acc"] <= 1  # vitlab.eval takes it as any checkpoint


def test_train_with_an_average_as_ckpt_path_starts_from_its_weights(run, tmp_path, compose_cfg):
    """Nothing to resume (no optimizer, no loops): training starts anew from the average's weights."""
    from vitlab.cli.plans import train_plan
    from vitlab.convert.averaging import average_checkpoints
    from vitlab.training.run import build, resume

    averaged = tmp_path / "averaged.ckpt"
    torch.save(average_checkpoints([str(p) for p in sorted((run / "checkpoints").glob("epoch_*.ckpt"))]), averaged)
    cfg = compose_cfg("train", ["debug=limit", f"ckpt_path={averaged}"])
    plan = train_plan(cfg)
    module = build.build_module(plan, build.fit_datamodule(plan))
    assert resume.starting_point(plan, module) is None  # not a checkpoint Lightning resumes
    assert torch.equal(module.model.head.weight, read_checkpoint(averaged)["state_dict"]["model.head.weight"])


def _sweep(root, run, jobs: int):
    """A sweep directory whose jobs' tested checkpoints are the run's epochs: fine-tunes of one start."""
    for i in range(jobs):
        job = root / str(i)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"optim.lr={i}"]))
        (job / "config.yaml").write_text(yaml.safe_dump({"model": {"pretrained": "/weights/start.ckpt"}}))
        best = run / "checkpoints" / f"epoch_{i:03d}.ckpt"
        (job / "metrics.json").write_text(json.dumps({"tested_checkpoint": str(best)}))
    return root


@pytest.mark.parametrize("method", ["greedy_soup", "uniform_soup"])
def test_a_soup_is_the_mean_of_its_ingredients_and_greedy_never_scores_below_its_best(
    run, tmp_path, compose_cfg, method
):
    from vitlab.average import average

    sweep = _sweep(tmp_path / "sweep", run, 3)
    average(compose_cfg("average", [f"method={method}", f"sweep_dir={sweep}"], output_dir=tmp_path / "soup"))
    record = json.loads((tmp_path / "soup" / "soup.json").read_text())
    vals = [i["val/acc"] for i in record["ingredients"]]
    assert vals == sorted(vals, reverse=True) and len(vals) == 3  # sorted by held-out accuracy, best first
    soup = record["soup"]
    assert "test/acc" in soup and "val/acc" in soup
    if method == "greedy_soup":
        assert soup["val/acc"] >= vals[0]  # never below its best ingredient
        running = vals[0]
        for step in record["greedy_steps"]:  # Algorithm 1: added iff the soup does not drop on validation
            assert step["added"] == (step["soup_val/acc"] >= running)
            running = step["soup_val/acc"] if step["added"] else running
        assert soup["jobs"] == [record["ingredients"][0]["job"]] + [
            s["job"] for s in record["greedy_steps"] if s["added"]
        ]
    else:
        assert sorted(soup["jobs"]) == ["0", "1", "2"] and record["greedy_steps"] == []
    files = [i["checkpoint"] for i in record["ingredients"] if i["job"] in soup["jobs"]]
    made = read_checkpoint(tmp_path / "soup" / "soup.ckpt")
    assert made["averaged"]["method"] == method and made["averaged"]["jobs"] == soup["jobs"]
    for k, _v in _weights(files[0]).items():
        want = torch.stack([_weights(f)[k].double() for f in files]).mean(0)
        torch.testing.assert_close(made["state_dict"][k].double(), want, atol=1e-6, rtol=0)


def test_bad_input_is_one_line_and_nothing_is_written(run, tmp_path, compose_cfg):
    from vitlab.average import average
    from vitlab.utils.errors import UserError

    out = tmp_path / "out"
    r = run_cli("average", f"run_dir={run}", "top_k=4", f"hydra.run.dir={out}", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: top_k 4 is more than the 3 best checkpoints run_dir '{run}' kept (by val/acc): give top_k <= 3, or "
        "train with callbacks.model_checkpoint.save_top_k=4 (or more) to keep more"
    )
    assert not out.exists()
    other = read_checkpoint(run / "checkpoints" / "epoch_000.ckpt")
    other["state_dict"]["model.head.weight"] = torch.zeros(3, 64)
    torch.save(other, tmp_path / "other.ckpt")
    one = _sweep(tmp_path / "one", run, 1)
    two_starts = _sweep(tmp_path / "two", run, 2)
    (two_starts / "1" / "config.yaml").write_text(yaml.safe_dump({"model": {"pretrained": "/weights/other.ckpt"}}))
    cases = {
        f"sweep_dir={two_starts}": r"soup ingredients are fine-tunes of one pretrained start \(model.pretrained\): "
        "job 0 started from /weights/start.ckpt, job 1 from /weights/other.ckpt; soup the jobs of one start",
        f"ckpt_paths=[{run}/checkpoints/epoch_000.ckpt,{tmp_path}/other.ckpt]": "are not of one architecture: "
        r"model.head.weight is \(10, 64\) in one and \(3, 64\) in the other; average checkpoints of one model",
        f"sweep_dir={one}": f"a soup needs at least two ingredients, and sweep_dir '{one}' has 1 finished job with a "
        r"tested checkpoint; average more fine-tunes \(a -m sweep of them\)",
    }
    for arg, line in cases.items():
        method = ["method=greedy_soup"] if arg.startswith("sweep_dir") else []
        with pytest.raises(UserError, match=line):
            average(compose_cfg("average", [*method, arg], output_dir=out))
        assert not list(out.iterdir())  # (the command line then removes the run directory, as above)


def test_what_to_average_is_checked_before_any_file_is_read(compose_cfg):
    from vitlab.average import check_average
    from vitlab.utils.errors import UserError

    with pytest.raises(UserError, match="an average of 1 checkpoint is that checkpoint"):
        check_average(compose_cfg("average", ["ckpt_paths=[a.ckpt]"]))
    with pytest.raises(UserError, match="run_dir=r needs top_k=<N>"):
        check_average(compose_cfg("average", ["run_dir=r"]))
    with pytest.raises(UserError, match="method=uniform_soup soups a sweep's jobs: give sweep_dir"):
        check_average(compose_cfg("average", ["method=uniform_soup", "run_dir=r"]))
    with pytest.raises(UserError, match="give one of them"):
        check_average(compose_cfg("average", ["run_dir=r", "ckpt_paths=[a,b]", "top_k=2"]))


@pytest.mark.parametrize("how", ["run_dir", "greedy_soup"])
def test_each_checkpoint_is_read_once(run, tmp_path, compose_cfg, monkeypatch, how):
    """Issue 73: a file is read once per command and what it holds handed on — the checkpoints ranked by their score
    are averaged from that read; a soup's ingredients are scored, checked and averaged from theirs."""
    from collections import Counter

    from vitlab.average import average
    from vitlab.convert import weights

    reads, read = Counter(), weights._load_weights_only  # the one reader of every file vitlab opens
    monkeypatch.setattr(weights, "_load_weights_only", lambda path: reads.update([Path(path).name]) or read(path))
    args = (
        [f"run_dir={run}", "top_k=3"]
        if how == "run_dir"
        else [f"method={how}", f"sweep_dir={_sweep(tmp_path / 's', run, 3)}"]
    )
    average(compose_cfg("average", args, output_dir=tmp_path / "out"))
    assert set(reads) >= {"epoch_000.ckpt", "epoch_001.ckpt", "epoch_002.ckpt"}
    assert max(reads.values()) == 1, reads
