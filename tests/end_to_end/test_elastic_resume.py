"""Issue 78: a run stopped on some number of processes goes on, exactly, on another. The data order is global
(data/seeded.py's GlobalOrder), each image's on-device augmentation and each sample's stochastic depth and dropout
are its global batch's rows (Rows, model.draws.drawn_by_rows), and the checkpoint holds the global position
(training/devices/rank_state.py): resumed on 2 or 3 processes, or on 1, the run is the uninterrupted one up to the
order of reductions. Tiny runs: 4 gloo processes on a 2-core machine, one block of width 32."""

from pathlib import Path

import pytest

from tests.helpers.commands import assert_refused, run_cli
from tests.helpers.configs import RESUMABLE, extra_callback
from tests.helpers.runs import assert_close_run, assert_goes_on_on_one, interrupt, resume, trained

# 1,257 training digits in global batches of 96 (divisible by 1, 2, 3 and 4): 13 steps an epoch, 3 epochs; stochastic
# depth and every dropout (each sample's own draws: model/draws.py), EMA and the default shift on the device (every
# image's own).
ELASTIC = [
    *[o for o in RESUMABLE if not o.startswith(("data.batch_size", "trainer.max_epochs", "model.drop_path_rate"))],
    "data.batch_size=96",
    "trainer.max_epochs=3",
    "model.depth=1",
    "model.embed_dim=32",
    "model.num_heads=2",
    "model.drop_path_rate=0.5",
    "model.drop_path_uniform=true",  # (one block: linear in depth would give it 0)
    *[f"model.{rate}=0.1" for rate in ("drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate")],
    "trainer=ddp_cpu",
]


def _on(count: int) -> list[str]:
    return [*ELASTIC, f"trainer.devices={count}"]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return trained(tmp_path_factory, "elastic-four", *_on(4))


@pytest.fixture(scope="module")
def stopped_four(tmp_path_factory):
    """The four processes' run stopped by SIGTERM sent after step 4 of 39 (the processes agree on a later step), and the
    command it printed."""
    folder = tmp_path_factory.mktemp("stopped-four")
    return interrupt(_on(4), folder, "SIGTERM", 4), folder


@pytest.mark.parametrize("count", [2, 3])
def test_four_processes_stopped_mid_epoch_go_on_on_two_or_three_as_the_uninterrupted_four(
    four, stopped_four, tmp_path, count
):
    command, _ = stopped_four
    assert " trainer.devices=4 " in command
    resumed = resume(command.replace(" trainer.devices=4 ", f" trainer.devices={count} "), tmp_path)
    assert f"written by 4 processes, resumed on {count}: exact" in (resumed / "train.log").read_text()
    assert_close_run(four, resumed)


def test_a_resume_on_a_count_that_does_not_divide_the_global_batch_is_one_line_naming_the_counts_that_do(
    stopped_four, tmp_path
):
    """Said once, before any process starts (each of the 5 said it, their lines interleaved), the checkpoint kept;
    and so is a new run's."""
    command, _ = stopped_four
    saved = command.split()[-1]
    checkpoint = Path(saved.removeprefix("ckpt_path="))
    said = (
        "error: data.batch_size 96 is global and must be divisible by the 5 processes (trainer.devices x "
        "trainer.num_nodes); counts that divide it: 1, 2, 3, 4, 6, 8, 12, 16"
    )
    assert_refused(run_cli("train", *_on(5), saved, cwd=tmp_path), said, {checkpoint: checkpoint.read_bytes()})
    assert_refused(run_cli("train", *_on(5), cwd=tmp_path), said, outputs=tmp_path / "outputs")


MAE = ["experiment=mae_pretrain_digits", "trainer.max_epochs=1", "trainer.deterministic=true", "progress_bar=none",
       "trainer=ddp_cpu", "trainer.devices=2"]  # fmt: skip


def test_mae_stopped_on_two_processes_goes_on_on_one_as_the_uninterrupted_two(tmp_path_factory, tmp_path):
    """objective=mae: each image's mask is its row's of the global batch (model/draws.py random_order), not drawn
    from its process's generator: resumed on one process, the run is the two processes' (10 steps, stopped after 4)."""
    assert_goes_on_on_one(tmp_path_factory, tmp_path, "mae-two", MAE)


def _naflex(folder) -> list[str]:
    """NaFlex on the `folder` fixture's 72 training images of 12 px: lengths of 4 and 9 patches of 4 px, global
    batches of 8 and 4 (timm's rule at 36 tokens), 12 an epoch; erased on the device, stochastic depth and dropout."""
    return [
        "model=naflexvit_b16", "model.patch_size=4", "model.depth=1", "model.embed_dim=32", "model.num_heads=2",
        "data=imagefolder", f"data.data_dir={folder}", "data.naflex.seq_lens=[4,9]", "data.naflex.batch_divisor=2",
        "data.batch_size=4", "data.train_transform.random_erasing=0.5", "model.drop_path_rate=0.5",
        "model.drop_path_uniform=true", "model.drop_rate=0.1", "trainer.max_epochs=2", "trainer.deterministic=true",
        "progress_bar=none", "trainer=ddp_cpu", "trainer.devices=2",
    ]  # fmt: skip


def test_naflex_stopped_on_two_processes_goes_on_on_one_as_the_uninterrupted_two(folder, tmp_path_factory, tmp_path):
    """NaFlex's sequence lengths are one schedule for the whole training set, each global batch shared out
    (data/sizes.py's ScheduledBatches), its erasing drawn by the image's row of the global batch: stopped mid-epoch
    (the processes agree on step 16 of 24) and resumed on one process, the run is the two processes'."""
    two = assert_goes_on_on_one(tmp_path_factory, tmp_path, "naflex-two", _naflex(folder), step=3)
    assert "global batch sizes [8, 4]" in (two / "train.log").read_text()


def test_a_compiled_deit_style_run_stopped_on_two_processes_goes_on_on_one_as_the_uninterrupted_two(
    tmp_path_factory, tmp_path
):
    """compile=regional and DeiT's repeated augmentation (data.repeated_aug=3), on fake data (1,024 images of 16 px):
    the compiled blocks' stochastic depth and dropout draw by each sample's row of the global batch as the eager ones
    do (the step's seed an input of the graph), not from the process's generator, and timm's sequence of copies is cut
    into global batches (data/seeded.py's RepeatOrder), each process its contiguous share: resumed on one process, the
    run is the two processes' (Dynamo's graphs run by its eager backend: tests/helpers/callbacks)."""
    args = [*_on(2), "data=fake", "model.img_size=16", "data.repeated_aug=3", "compile=regional",
            *extra_callback("eager", "EagerCompile")]  # fmt: skip
    assert_goes_on_on_one(tmp_path_factory, tmp_path, "compiled-repeats-two", args)
