"""data=wds and data=hf data.streaming=true, the longer runs: a streamed run interrupted mid-epoch resumes exactly,
in one process and in two (DDP on the CPU), on the `folder` fixture's images (tests/conftest.py)."""

import pytest

from tests.data.test_streaming import RUN, TWO  # 9 steps of 8 an epoch on the `folder` fixture's 72 training images
from tests.helpers import assert_same_run, interrupt, resume, run_cli


def _wds(shards):
    return ["data=wds", f'data.urls="{shards}/train-{{000000..000003}}.tar"',
            f'data.val_urls="{shards}/val-{{000000..000003}}.tar"', "data.shuffle_buffer=16"]  # fmt: skip


@pytest.mark.parametrize("processes", [1, 2])
def test_a_run_on_webdataset_shards_interrupted_mid_epoch_resumes_exactly(wds_shards, tmp_path, processes):
    args = [*_wds(wds_shards), *RUN, *(TWO if processes == 2 else [])]
    full = tmp_path / "full"
    r = run_cli("train", *args, f"hydra.run.dir={full}")
    assert r.returncode == 0, r.stderr[-3000:]
    command = interrupt(args, tmp_path, "SIGTERM", 12)
    assert_same_run(full, resume(command, tmp_path))


def test_a_streamed_hugging_face_run_in_two_processes_interrupted_mid_epoch_resumes_exactly(records, tmp_path):
    args = ["data=hf", f"data.name={records / 'saved'}", "data.streaming=true", "data.shuffle_buffer=16", *RUN, *TWO]
    full = tmp_path / "full"
    r = run_cli("train", *args, f"hydra.run.dir={full}")
    assert r.returncode == 0, r.stderr[-3000:]
    command = interrupt(args, tmp_path, "SIGTERM", 12)
    assert_same_run(full, resume(command, tmp_path))
