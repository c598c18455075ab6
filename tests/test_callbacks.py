import pytest
import torch

from vitlab.callbacks import AtomicCheckpointIO


def test_atomic_checkpoint_round_trip_and_overwrite(tmp_path):
    io, path = AtomicCheckpointIO(), tmp_path / "sub" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, path)
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 2}, path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["epoch"] == 2 and torch.equal(ckpt["state_dict"]["w"], torch.zeros(2))
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, path)
    good = path.read_bytes()

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 2}, path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the temporary file is gone too
