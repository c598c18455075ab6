"""`python -m vitlab.train data=imagefolder data.data_dir=<JPEGs> data.decode=device` on the CPU: it trains, says its
path at start-up, and a run stopped mid-epoch resumes bit for bit (the loader workers' draws are the sampler's, the
device's random erasing draws from the checkpointed generator)."""

import pytest

from tests.data.test_decoding import jpeg_tree
from tests.helpers.commands import run_cli
from tests.helpers.runs import assert_same_run, interrupt, resume

# 10 training JPEGs (grayscale, CMYK, EXIF-rotated and PNG files among them): 5 steps of 2, one epoch
ARGS = ["data=imagefolder", "data.decode=device", "data.batch_size=2", "data.num_workers=1", "model.img_size=16",
        "model.depth=1", "data.train_transform.color_jitter=0.4", "data.train_transform.grayscale_prob=0.3",
        "data.train_transform.gaussian_blur_prob=0.3", "data.train_transform.random_erasing=0.5",
        "trainer.max_epochs=1", "trainer.deterministic=true", "trainer.accelerator=cpu", "progress_bar=none",
        "test=false"]  # fmt: skip


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    return jpeg_tree(tmp_path_factory.mktemp("jpegs"))


def test_a_jpeg_folder_trains_decoded_on_the_device_and_resumes_exactly(jpegs, tmp_path):
    args = [*ARGS, f"data.data_dir={jpegs}"]
    full = tmp_path / "full"
    r = run_cli("train", *args, f"hydra.run.dir={full}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data.decode=device: the loader's workers read each image's bytes and draw its crop; cpu decodes" in (
        full / "train.log").read_text()  # fmt: skip
    (tmp_path / "again").mkdir()
    command = interrupt(args, tmp_path / "again", "SIGTERM", 2)  # stopped after step 3 of 5, mid-epoch
    assert_same_run(full, resume(command, tmp_path / "again"))
