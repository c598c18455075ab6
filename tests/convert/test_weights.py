"""Loading errors name the real source of the weights (a vitlab checkpoint, timm's weights of a name, a weights file)
and the fix: for patch filters of another size, the patch size to type or model.resample_patch=true, which resamples
them as timm's resample_patch_embed (FlexiViT)."""

import re

import pytest
import torch
from timm.layers import resample_patch_embed

import vitlab.convert.source as source
from tests.helpers.configs import tiny
from vitlab.convert.source import load_timm_weights
from vitlab.model import ViT
from vitlab.utils.errors import UserError


def _vitlab_checkpoint(path, model: ViT) -> str:
    """What vitlab.train writes, as far as the loader reads it: Lightning's state_dict with `model.` keys."""
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "epoch": 3}, path)
    return str(path)


def test_patch_size_mismatch_names_the_checkpoint_and_the_fixes(tmp_path):
    source = _vitlab_checkpoint(tmp_path / "best.ckpt", ViT(tiny(patch_size=4)))
    with pytest.raises(UserError) as e:
        load_timm_weights(ViT(tiny(patch_size=8)), source)
    message = str(e.value)
    assert message.startswith(f"vitlab checkpoint {source!r} state dict does not fit this ViT config: ")
    assert "patch_embed.proj.weight (32, 3, 4, 4) != (32, 3, 8, 8)" in message
    assert message.endswith(
        "The weights' patches are 4x4, this model's 8x8: set model.patch_size=4, or model.resample_patch=true to "
        "resample the patch filters (FlexiViT; timm's resample_patch_embed)"
    )
    assert "\n" not in message


def test_resample_patch_resamples_the_filters_as_timm_and_the_grid(tmp_path):
    torch.manual_seed(0)
    theirs = ViT(tiny(patch_size=4))
    model = ViT(tiny(patch_size=8))
    load_timm_weights(model, _vitlab_checkpoint(tmp_path / "best.ckpt", theirs), resample_patch=True)
    expected = resample_patch_embed(theirs.patch_embed.proj.weight.detach(), [8, 8])
    torch.testing.assert_close(model.patch_embed.proj.weight, expected, rtol=0, atol=0)
    assert model.pos_embed.shape == (1, 1 + 16, 32)  # 8x8 grid resampled to 4x4
    torch.testing.assert_close(model.blocks[1].mlp.fc2.weight, theirs.blocks[1].mlp.fc2.weight)


def test_timm_weights_are_named_as_timms(monkeypatch):
    monkeypatch.setattr(source, "timm_pretrained_state_dict", lambda name: ViT(tiny(patch_size=4)).state_dict())
    preprocessing = {"mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 0.9, "crop_mode": "center"}
    monkeypatch.setattr(
        source, "timm_pretrained_cfg", lambda name: {"tag": name, "interpolation": "bicubic"} | preprocessing
    )
    with pytest.raises(UserError, match=r"^timm's weights of vit_tiny_patch4\.x state dict does not fit .* set model"):
        load_timm_weights(ViT(tiny(patch_size=8)), "vit_tiny_patch4.x")


def test_a_plain_weights_file_is_named_as_one(tmp_path):
    path = str(tmp_path / "w.pth")
    torch.save(ViT(tiny(depth=1)).state_dict(), path)
    with pytest.raises(UserError, match=rf"^weights file {re.escape(repr(path))} state dict lacks keys .*blocks\.1"):
        load_timm_weights(ViT(tiny()), path)
