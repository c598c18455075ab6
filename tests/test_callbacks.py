import errno

import pytest
import torch

from vitlab.callbacks import AtomicCheckpointIO
from vitlab.errors import UserError


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
        try:  # as torch.save reports it: its C++ writer's RuntimeError, the OSError as context
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from None

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(UserError) as e:
        io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 2}, path)
    assert str(e.value).startswith(f"cannot write checkpoint {path} (No space left on device); the previous last.ckpt")
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the temporary file is gone too


def test_a_bug_while_saving_is_not_called_a_full_disk(tmp_path, monkeypatch):
    def bug(obj, f, *args, **kwargs):
        raise RuntimeError("something else broke")

    monkeypatch.setattr(torch, "save", bug)
    with pytest.raises(RuntimeError, match="something else broke"):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, tmp_path / "last.ckpt")
