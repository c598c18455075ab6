"""Test-time augmentation (`python -m vitlab.eval ckpt_path=... tta=flip|flip_crops`): each test image seen in several
views, and the classifier's logits averaged over them, as timm's `--tta N` reduces them (train.py/validate.py:
`output.unfold(0, N, N).mean(dim=2)`, the logits of the N views of an image, not their probabilities). metrics.json
keeps the plain numbers and gives the augmented ones beside them (`test/acc_tta`, ...).

The views are made on the device from the test batch as evaluation prepares it (resized, cropped, normalised), so
every data module takes them:
- `flip`: the image and its horizontal mirror (2 views);
- `flip_crops`: five crops of the image's size from the image padded by `pad` pixels on each side (reflected: no
  black border), the centre (the image itself) and the four corners (shifted by `pad` both ways), each also mirrored
  (10 views). `pad` is img_size / 16 rounded, at least 1: 14 px at 224, 2 at 32, 1 for the 8 px digits.

timm's `test_time_pool` (validate.py --test-pool, timm.layers.apply_test_time_pool) does not apply to a ViT: it
average-pools a CNN's feature map (B, C, H, W) in windows of the training map's size (`pretrained_cfg['pool_size']`),
runs the classifier as a 1x1 convolution on each window and takes the mean and max of the results. A ViT's
forward_features gives tokens (B, N, D), its pretrained_cfg has no pool_size, and with dynamic_img_size it already
takes a larger image whole (its position embedding resampled to the grid), so there is nothing for the pool to do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("none", "flip", "flip_crops")


def crop_pad(size: int) -> int:
    """The shift of flip_crops' corner crops, in pixels: 1/16 of the image's side, at least 1."""
    return max(1, round(size / 16))


def views(x: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """The views of a batch (B, C, H, W) that `mode` averages over, each (B, C, H, W); the first is the batch."""
    if mode == "none":
        return [x]
    if mode == "flip":
        return [x, x.flip(-1)]
    if mode != "flip_crops":
        raise ValueError(f"tta {mode!r} is not one of {MODES}")
    H, W = x.shape[-2:]
    p = crop_pad(min(H, W))
    padded = F.pad(x, (p, p, p, p), mode="reflect")  # (B, C, H + 2p, W + 2p)
    corners = [(p, p), (0, 0), (0, 2 * p), (2 * p, 0), (2 * p, 2 * p)]  # centre, then top-left ... bottom-right
    crops = [padded[..., i : i + H, j : j + W] for i, j in corners]
    return [v for c in crops for v in (c, c.flip(-1))]


class TestTimeAugmentation(nn.Module):
    """A classifier whose logits are the mean of `model`'s logits over the views of `mode` (one forward pass of all
    the views together: V x the batch). Its `cfg` is the model's."""

    __test__ = False  # (not a pytest class)

    def __init__(self, model: nn.Module, mode: str):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"tta {mode!r} is not one of {MODES}")
        self.model, self.mode = model, mode

    @property
    def cfg(self) -> Any:
        return self.model.cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        all_views = views(x, self.mode)
        logits = self.model(torch.cat(all_views))  # (V * B, classes)
        return logits.unflatten(0, (len(all_views), x.shape[0])).mean(0)  # (B, classes)


def score_with_tta(trainer, module, datamodule, tta: str) -> dict[str, float]:
    """The checkpoint's test metrics (the validation split's, val/, where the data has no test split), and with `tta`
    the same again on the averaged logits, named `<metric>_tta`, with the views counted."""
    no_test = getattr(datamodule, "test_set", True) is None
    if no_test:
        print("the data has no test split: evaluating on its validation split (val/ metrics)", flush=True)
    run = trainer.validate if no_test else trainer.test
    (metrics,) = run(module, datamodule=datamodule)
    out = {k: float(v) for k, v in metrics.items()}
    if tta == "none":
        return out
    plain, n = module.model, len(views(torch.zeros(1, 1, *datamodule.img_hw), tta))
    # (Lightning's table of the same names follows: said, or the two tables look alike)
    print(f"with test-time augmentation, tta={tta}: the logits averaged over {n} views of each image (<metric>_tta)")
    module.model = TestTimeAugmentation(plain, tta)
    try:
        (augmented,) = run(module, datamodule=datamodule)
    finally:
        module.model = plain
    return out | {f"{k}_tta": float(v) for k, v in augmented.items()} | {"tta": tta, "tta_views": n}
