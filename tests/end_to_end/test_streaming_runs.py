"""data=streaming, the longer runs: a run on shards interrupted mid-epoch resumes exactly, with one process and two."""

import pytest

from tests.helpers import assert_same_run, interrupt, resume, run_cli

# 3 classes x 24 images of 12 px in train, val and test (the `shards` fixture, tests/conftest.py): 9 steps of 8 an
# epoch
RUN = [
    "data.batch_size=8",
    "data.num_workers=2",
    "model.img_size=8",
    "trainer.max_epochs=3",
    "trainer.deterministic=true",
    "progress_bar=none",
    "model.drop_path_rate=0.1",
    "data.train_transform.auto_augment=randaugment",
    "data.train_transform.random_erasing=0.5",
    "trainer.log_every_n_steps=5",
]
TWO = ["trainer=ddp_cpu", "trainer.devices=2"]


@pytest.mark.parametrize("processes", [1, 2])
def test_a_run_on_shards_interrupted_mid_epoch_resumes_exactly(shards, tmp_path, processes):
    args = ["data=streaming", f"data.data_dir={shards}", *RUN, *(TWO if processes == 2 else [])]
    full = tmp_path / "full"
    r = run_cli("train", *args, f"hydra.run.dir={full}")
    assert r.returncode == 0, r.stderr[-3000:]
    command = interrupt(args, tmp_path, "SIGTERM", 12)
    assert_same_run(full, resume(command, tmp_path))
