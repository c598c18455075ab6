"""Resume from the newest checkpoint, stop on NaN, refuse unsafe or mismatched checkpoints and bad input in one line.
(Stopping on a signal and resuming exactly: test_signal_resume.py.)"""

import pickle

import pytest
import torch
from PIL import Image

from tests.helpers.commands import assert_refused, replaced, run_cli
from tests.helpers.configs import RESUMABLE, extra_callback
from tests.helpers.images import image_tree
from tests.helpers.runs import earlier_run, trained

# Command-line runs, for CI; the pieces have fast unit tests (test_callbacks, test_atomic).


RUN = [*RESUMABLE, "trainer.limit_test_batches=1.0"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The resumable digits run (tests/end_to_end/test_signal_resume.py interrupts and resumes it), trained once."""
    return trained(tmp_path_factory, "resumable", *RESUMABLE)


# The command that trained `uninterrupted`, less its epochs: a resume gives the epochs to reach.
RESUMING = [o for o in RESUMABLE if not o.startswith("trainer.max_epochs=")]


def test_ckpt_path_last_finds_the_newest_checkpoint(uninterrupted, tmp_path):
    # `last` looks among this task's runs under paths.log_dir; point log_dir at the uninterrupted run's parent.
    runs = tmp_path / "logs" / "train" / "runs"
    runs.mkdir(parents=True)
    (runs / "old").symlink_to(uninterrupted, target_is_directory=True)
    r = run_cli(
        "train",
        *RESUMING,
        "trainer.max_epochs=4",
        "ckpt_path=last",
        f"paths.log_dir={tmp_path / 'logs'}",
        f"hydra.run.dir={tmp_path / 'next'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert torch.load(tmp_path / "next" / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 3


# On the CPU the loss is read every step: the run stops before the update. On a GPU it is read at log steps
# (every 5 here): the bad step (12) is named, and it is read after the batch that makes global_step 15, the first
# multiple of 5 past it (the lease of 2026-11-27 measured it); the weights after the bad step are never saved.
GPU_RUN = [o for o in RUN if not o.startswith("trainer.accelerator")] + ["trainer=gpu"]
STOPPED = {"cpu": "stopped before the update", "gpu": "the weights from then on (step 15) were not saved"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_non_finite_loss_stops_naming_step_and_intact_checkpoint(tmp_path, device):
    run = tmp_path / "r"
    r = run_cli(
        "train",
        *(RUN if device == "cpu" else GPU_RUN),
        *extra_callback("nan", "NanAtStep", step=12),
        f"hydra.run.dir={run}",
    )
    last = run / "checkpoints" / "last.ckpt"
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: training loss became nan at step 12 (epoch 1); {STOPPED[device]}; the last good checkpoint is {last}"
    )
    ckpt = torch.load(last, weights_only=True, map_location="cpu")
    weights = {k: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    assert ckpt["global_step"] == 9 and len(weights) == 56 and all(torch.isfinite(v).all() for v in weights.values())
    assert not (run / "checkpoints" / "interrupted.ckpt").exists()
    assert not list((run / "checkpoints").glob(".*tmp*"))  # no temporary files left behind


def test_a_run_the_spike_guard_stops_before_any_checkpoint_keeps_its_directory_and_log(tmp_path):
    """Issue 53: training that failed on the recipe (here three steps in a row skipped as spikes, within the first
    epoch) is not bad input: its run directory stays, with the train.log whose warnings say why."""
    run = tmp_path / "r"
    guard = ["callbacks.health.spike_factor=1.01", "callbacks.health.spike_min_history=3"]
    r = run_cli("train", *guard, "callbacks.health.max_skips_in_a_row=2", "optim.lr=0.05", f"hydra.run.dir={run}")
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 3 optimizer steps in a row skipped as spikes") and last.endswith(
        f"no checkpoint was saved yet (the run directory {run} keeps its log)"
    )
    assert "skipped (2 so far)" in (run / "train.log").read_text() and (run / "config.yaml").is_file()


class _RunsCode:
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('x')",))


def test_crafted_pickle_checkpoint_is_refused(tmp_path):
    png = tmp_path / "x.png"  # an image predict reads (it checks its images first): the checkpoint is what is refused
    Image.new("L", (8, 8)).save(png)
    evil = tmp_path / "evil.ckpt"
    with open(evil, "wb") as f:
        pickle.dump({"state_dict": {}, "hyper_parameters": _RunsCode()}, f, protocol=2)
    for module, args in (
        ("train", [f"ckpt_path={evil}"]),
        ("eval", [f"ckpt_path={evil}"]),
        ("predict", [f"ckpt_path={evil}", f"images=[{png}]"]),
    ):
        r = run_cli(
            module,
            *args,
            "progress_bar=none" if module != "predict" else "top_k=1",
            f"hydra.run.dir={tmp_path / module}",
            cwd=tmp_path,
        )
        assert r.returncode == 2, (module, r.stderr[-2000:])
        assert "cannot be read safely" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    newer = tmp_path / "evil5.ckpt"  # any pickle protocol is a pickle, not "another kind of file"
    newer.write_bytes(pickle.dumps({"state_dict": {}, "hyper_parameters": _RunsCode()}, protocol=5))
    r = run_cli("train", f"ckpt_path={newer}", f"hydra.run.dir={tmp_path / 'train5'}", cwd=tmp_path)
    assert r.returncode == 2 and "cannot be read safely" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "PWNED").exists()


def test_a_finished_run_resumed_without_its_epochs_says_it_had_finished_and_what_trains_it_on(uninterrupted, tmp_path):
    """Issue 64: ckpt_path=<a finished 3-epoch run> without trainer.max_epochs trained on, silently, to the config's
    300: said in one line, nothing written, as when the epochs given are reached."""
    last = uninterrupted / "checkpoints" / "last.ckpt"
    r = run_cli("train", *RESUMING, f"ckpt_path={last}", f"hydra.run.dir={tmp_path / 'r'}")
    assert_refused(
        r,
        f"error: ckpt_path '{last}' is of a run that had finished (3 of 3 epochs), and trainer.max_epochs is not given "
        "(the config's 300 would train it on): train it on with trainer.max_epochs above 3 (the epochs to reach), or "
        f"test it: python -m vitlab.eval ckpt_path={last}",
        outputs=tmp_path / "r",
    )


def test_checkpoint_of_another_architecture_is_refused(uninterrupted, tmp_path):
    last = uninterrupted / "checkpoints" / "last.ckpt"
    r = run_cli("train", "model.depth=2", f"ckpt_path={last}", f"hydra.run.dir={tmp_path / 'r'}")
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: ckpt_path '{last}' was trained with a different model: depth=4 (this run: 2)"
    r = run_cli(
        "train",
        "data=fake",
        "data.num_classes=5",
        "data.channels=1",
        f"ckpt_path={last}",
        f"hydra.run.dir={tmp_path / 's'}",
    )
    assert r.returncode == 2 and "num_classes=10 (this run: 5)" in r.stderr


def test_a_new_learning_rate_on_a_resume_is_refused(uninterrupted, tmp_path):
    """Issue 41: optim.lr=0.5 on a resume was neither applied (the checkpoint's schedule went on) nor refused."""
    last = uninterrupted / "checkpoints" / "last.ckpt"
    r = run_cli("train", "data.batch_size=128", "optim.lr=0.5", f"ckpt_path={last}", f"hydra.run.dir={tmp_path / 'r'}")
    assert r.returncode == 2 and not (tmp_path / "r").exists()
    assert r.stderr.strip() == (
        f"error: ckpt_path '{last}' was trained with optim.lr=0.001 (this run: 0.5): a resume goes on with the "
        "checkpoint's optimizer state and learning-rate schedule, and the new value would not be applied; drop the "
        "override to resume, or train anew without ckpt_path"
    )


def test_missing_ckpt_path(tmp_path):
    r = run_cli("train", "ckpt_path=nowhere.ckpt", f"hydra.run.dir={tmp_path / 'r'}")
    assert (r.returncode, r.stderr.strip()) == (2, "error: ckpt_path 'nowhere.ckpt' does not exist")
    r = run_cli("eval", "ckpt_path=nowhere.ckpt", f"hydra.run.dir={tmp_path / 'e'}")
    assert (r.returncode, r.stderr.strip()) == (2, "error: ckpt_path 'nowhere.ckpt' does not exist")


def _image_tree(root, broken=False, empty_class=False):
    image_tree(root)
    if broken:
        (root / "train" / "a" / "broken.png").write_bytes((root / "train" / "a" / "0.png").read_bytes()[:30])
    if empty_class:
        (root / "train" / "c").mkdir()
    return root


def _bad_inputs(tmp):
    not_a_state_dict = tmp / "weights.pth"
    torch.save({"lr": 0.1}, not_a_state_dict)
    folder = ["data=imagefolder", "data.num_classes=2", "data.num_workers=0", "data.batch_size=4"]
    return {
        "unknown model key": (["model.depht=3"], "model.depht is not a key of model; its keys: ['act_layer',"),
        "unknown data": (["data=imagenet22k"], "Could not find 'data/imagenet22k' Available options in 'data':"),
        "bad geometry": (["model.img_size=30"], "img_size 30 is not divisible by patch_size 4"),
        "dropout above 1": (["model.drop_rate=1.5"], "drop_rate 1.5 must be in [0, 1)"),
        "negative dropout": (["model.attn_drop_rate=-0.1"], "attn_drop_rate -0.1 must be in [0, 1)"),
        "missing data dir": (
            [*folder, f"data.data_dir={tmp / 'nope'}"],
            f"data.data_dir '{tmp / 'nope'}' does not exist",
        ),
        "empty class": (
            [*replaced(folder, "data.num_classes=3"), f"data.data_dir={_image_tree(tmp / 'empty', empty_class=True)}"],
            "Found no valid file for the classes c",
        ),
        "corrupt image": (
            [*folder, f"data.data_dir={_image_tree(tmp / 'broken', broken=True)}"],
            f"image file '{tmp / 'broken' / 'train' / 'a' / 'broken.png'}' cannot be decoded",
        ),
        "class count": (
            [*replaced(folder, "data.num_classes=5"), f"data.data_dir={_image_tree(tmp / 'two')}"],
            "data.num_classes 5 does not match the 2 class folders",
        ),
        "missing ckpt": (["ckpt_path=nowhere.ckpt"], "ckpt_path 'nowhere.ckpt' does not exist"),
        "more devices than exist": (
            ["trainer=gpu", f"trainer.devices={torch.cuda.device_count() + 1}"],
            f"trainer.accelerator='gpu' trainer.devices={torch.cuda.device_count() + 1} cannot run here",
        ),
        "weights not a state dict": ([f"model.pretrained={not_a_state_dict}"], "does not hold a state dict"),
        # issue 41: values that reached Lightning (Hydra's multi-line error) or our sharding check (a TypeError)
        "every GPU on the CPU": (
            ["trainer.accelerator=cpu", "trainer.devices=-1"],
            "trainer.devices=-1 means every GPU",
        ),
        "every GPU under fsdp_cpu": (["trainer=fsdp_cpu", "trainer.devices=-1"], "trainer.devices=-1 means every GPU"),
        "zero devices": (["trainer.devices=0"], "trainer.devices=0 must be a number of devices >= 1, -1 (every GPU)"),
    }


BAD = [
    "unknown model key",
    "unknown data",
    "bad geometry",
    "dropout above 1",
    "negative dropout",
    "missing data dir",
    "empty class",
    "corrupt image",
    "class count",
    "missing ckpt",
    "more devices than exist",
    "weights not a state dict",
    "every GPU on the CPU",
    "every GPU under fsdp_cpu",
    "zero devices",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2_and_damages_nothing(tmp_path, case):
    before = earlier_run(tmp_path)
    args, message = _bad_inputs(tmp_path)[case]
    r = run_cli("train", *args, "progress_bar=none", "trainer.max_epochs=1", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr[-2000:]
    assert {p: p.read_bytes() for p in before} == before
    assert not list((tmp_path / "outputs").rglob("*.ckpt*"))[1:]  # only the earlier run's checkpoint
