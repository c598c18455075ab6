"""data=streaming, the longer runs: a run on shards interrupted mid-epoch resumes exactly, with one process and two."""

import pytest

from tests.data.test_streaming import RUN, TWO  # 9 steps of 8 an epoch on the `shards` fixture (tests/conftest.py)
from tests.helpers.commands import run_cli
from tests.helpers.runs import assert_same_run, interrupt, resume


@pytest.mark.parametrize("processes", [1, 2])
def test_a_run_on_shards_interrupted_mid_epoch_resumes_exactly(shards, shards_run, tmp_path, processes):
    args = ["data=streaming", f"data.data_dir={shards}", *RUN, *(TWO if processes == 2 else [])]
    full = shards_run
    if processes == 2:
        full = tmp_path / "full"
        r = run_cli("train", *args, f"hydra.run.dir={full}")
        assert r.returncode == 0, r.stderr[-3000:]
    command = interrupt(args, tmp_path, "SIGTERM", 12)
    assert_same_run(full, resume(command, tmp_path))
