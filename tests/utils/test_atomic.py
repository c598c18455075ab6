"""vitlab.utils.atomic: what a killed or failed write leaves behind."""

import os
import subprocess
import sys

from vitlab.training.checkpoint_io import AtomicCheckpointIO
from vitlab.utils.atomic import atomic_link, remove_stale_temporaries


def test_temporaries_of_killed_saves_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".last.ckpt.tmp-{int(dead.stdout)}"  # that process has exited
    live = tmp_path / f".best.ckpt.tmp-{os.getpid()}"
    for p in (stale, live):
        p.write_bytes(b"x" * 100)
    assert remove_stale_temporaries(tmp_path) == [stale]
    assert not stale.exists() and live.exists()
    AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, tmp_path / "last.ckpt")  # a save cleans up too
    stale.write_bytes(b"x")
    AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, tmp_path / "last.ckpt")
    assert not stale.exists()


def test_a_directory_of_shards_is_linked_file_by_file_and_placed_whole(tmp_path):
    """trainer=fsdp's checkpoint of shards carried into a resumed run's directory: the same bytes (hard links), in a
    directory renamed into place, replacing one that was there."""
    shards = tmp_path / "epoch_001.ckpt"
    (shards / "sub").mkdir(parents=True)
    (shards / ".metadata").write_bytes(b"meta")
    (shards / "sub" / "__0_0.distcp").write_bytes(b"shard")
    target = tmp_path / "new" / "epoch_001.ckpt"
    target.mkdir(parents=True)
    (target / "stale").write_text("an earlier copy")
    atomic_link(shards, target)
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == [".metadata", "sub", "sub/__0_0.distcp"]
    assert os.path.samefile(target / "sub" / "__0_0.distcp", shards / "sub" / "__0_0.distcp")
    assert sorted(p.name for p in target.parent.iterdir()) == ["epoch_001.ckpt"]  # no temporary, no old copy
