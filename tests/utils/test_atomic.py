"""vitlab.utils.atomic: what a killed or failed write leaves behind."""

import os
import subprocess
import sys

from vitlab.training.checkpoint_io import AtomicCheckpointIO
from vitlab.utils.atomic import remove_stale_temporaries


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
