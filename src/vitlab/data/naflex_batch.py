"""NaFlex's batches (data/naflex.py's loading): each image's patches cut and padded in the loader's workers (`Patches`,
`Pad`), stacked with a training batch's loss scale (`Collate`: timm's `--naflex-loss-scale`, linear, sqrt or none, a
batch's size over data.batch_size's share), and on the device a `NaFlexBatch` that normalises and erases itself
(`Normalise`, `Erasing`: timm's PatchRandomErasing), moves itself, gives its loss's weight and readies itself for a
teacher.

No Hydra, OmegaConf or Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from timm.data.naflex_random_erasing import PatchRandomErasing
from torch.utils.data._utils.collate import default_collate

from vitlab.data.seeded import Rows, reseeding, rows_of
from vitlab.utils.errors import UserError


class Patches:
    """A uint8 image (C, H, W) -> (patches (h*w, ph*pw*C) uint8 in (ph, pw, C) order, coordinates (h*w, 2) (y, x))."""

    def __init__(self, patch_hw: tuple[int, int]):
        self.patch_hw = patch_hw

    def __call__(self, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (ph, pw), (C, H, W) = self.patch_hw, img.shape
        h, w = H // ph, W // pw
        img = img[:, : h * ph, : w * pw]
        patches = img.reshape(C, h, ph, w, pw).permute(1, 3, 2, 4, 0).reshape(h * w, ph * pw * C)
        y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        return patches.contiguous(), torch.stack([y.flatten(), x.flatten()], dim=1)


class NaFlexBatch(dict):
    """NaFlex's padded patches: {patches (B, L, P*P*C), patch_coord (B, L, 2) (y, x), patch_valid (B, L)} and, for a
    training batch, its `loss_scale` (`Pad` makes one image's, unbatched, which the loader's collate stacks). A dict,
    as the model takes it (model/naflex.py) and as the loaders' collate and pin_memory and Lightning's move to the
    device copy it, keeping its type; what vitlab asks of a batch besides, it answers itself."""

    def to(self, device: torch.device | str) -> NaFlexBatch:
        """On `device` (vitlab.predict: as a tensor of images moves)."""
        return NaFlexBatch({k: v.to(device) for k, v in self.items()})

    @property
    def loss_scale(self) -> torch.Tensor | None:
        """The weight of a training batch's loss (`Collate`); None for an evaluation batch."""
        return self.get("loss_scale")

    def normalised(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        erasing: Erasing | None = None,
        generator: torch.Generator | Rows | None = None,
    ) -> NaFlexBatch:
        """uint8 patches (B, L, P*P*C) on the device -> float32 normalised per channel (C varies fastest), then erased
        (training's `erasing`, where data.train_transform.random_erasing is set, its draws seeded from `generator`)."""
        x = self["patches"]
        C = len(mean)
        m = torch.tensor(mean, device=x.device, dtype=torch.float32)
        s = torch.tensor(std, device=x.device, dtype=torch.float32)
        x = (x.to(torch.float32).div_(255).unflatten(-1, (-1, C)) - m) / s
        if erasing is not None:
            x = erasing(x, self["patch_coord"], self["patch_valid"], generator)
        return NaFlexBatch(self, patches=x.flatten(-2))

    def teacher_logits(self, kd: Any, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """timm's DistillationTeacher `kd` (objective=distill's teacher) on this normalised batch: the patches re-
        normalised per channel from the student's `mean` and `std` to the teacher's; a teacher that takes NaFlex's
        patches only (a naflexvit: ours, or timm's NaFlexVit)."""
        model = kd.model
        if not (getattr(getattr(model, "cfg", None), "naflex", False) or type(model).__name__ == "NaFlexVit"):
            raise UserError("data.naflex batches need a teacher that takes them: a naflexvit (checkpoint or timm)")
        p = self["patches"].unflatten(-1, (-1, kd.mean_kd.shape[1])) * std.flatten() + mean.flatten()
        p = (p - kd.mean_kd.flatten()) / kd.std_kd.flatten()
        return model({k: v for k, v in self.items() if k != "loss_scale"} | {"patches": p.flatten(-2)}).float()


class Pad:
    """(patches, coordinates) -> a NaFlexBatch {patches, patch_coord, patch_valid} padded to `seq_len` patches (timm's
    NaFlexCollator, per image in the workers: the loader's default collate stacks them)."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def __call__(self, item: tuple[torch.Tensor, torch.Tensor]) -> NaFlexBatch:
        (p, c), L = item, self.seq_len
        n = min(len(p), L)
        patches = p.new_zeros(L, p.shape[1])
        coord, valid = c.new_zeros(L, 2), torch.zeros(L, dtype=torch.bool)
        patches[:n], coord[:n], valid[:n] = p[:n], c[:n], True
        return NaFlexBatch(patches=patches, patch_coord=coord, patch_valid=valid)


class Collate:
    """A training batch of padded images stacked, with its loss scale (`loss_scale`) beside the patches (`schedule`: a
    NaFlexSchedule, data/naflex.py, which imports this file)."""

    def __init__(self, schedule: Any, world: int):
        self.schedule, self.world = schedule, world

    def __call__(self, items):
        x, y = default_collate(items)
        return [NaFlexBatch(x, loss_scale=torch.tensor(loss_scale(len(y), self.schedule, self.world))), y]


def loss_scale(batch: int, schedule: Any, world: int = 1) -> float:
    """timm's train.py: a batch's loss times its size over data.batch_size (linear), its square root, or 1; `batch`:
    a process's share of a global batch shared by `world` (its global batch over the global data.batch_size: the same
    scale on any count)."""
    if schedule.loss_scale == "none":
        return 1.0
    ratio = batch * world / schedule.reference_batch
    return ratio**0.5 if schedule.loss_scale == "sqrt" else ratio


class Normalise:
    """An ImageDataModule's `to_input` for NaFlex batches, as transforms.DeviceTransform is for images: normalised, and
    erased in training (`erasing`: data.train_transform.random_erasing's, None where it is off)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], erasing: Erasing | None):
        self.mean, self.std, self.erasing = mean, std, erasing

    def __call__(self, x: NaFlexBatch, train: bool, generator: torch.Generator | None = None, size=None) -> NaFlexBatch:
        return x.normalised(self.mean, self.std, self.erasing if train else None, generator)


class Erasing:
    """data.train_transform.random_erasing on NaFlex's normalised patches (B, L, P*P, C) as timm's NaFlex loader erases
    them (its PatchRandomErasing, region mode): with probability `p` an image gets 1 to `count` rectangles of whole
    patches of its own grid (area 2-33%, aspect 0.3-3.3), filled by `mode` (const zeros, rand a normal colour, pixel
    normal noise). timm's code draws from Python's and torch's global generators: here they are seeded, for each
    image, with a number of its own drawn from `generator` and put back after, so a run resumed mid-epoch erases as
    the uninterrupted one did: in a fit with a global order, the Rows of the image's global batch (data/seeded.py: the
    same number for an image in the same row whatever the count of processes, issue 78), else the data module's own
    generator (checkpointed, one stream per process)."""

    def __init__(self, p: float, mode: str, count: int):
        self.args = dict(erase_prob=p, mode=mode, max_count=count)
        self._by_device: dict[torch.device, PatchRandomErasing] = {}

    def __call__(
        self,
        patches: torch.Tensor,
        coord: torch.Tensor,
        valid: torch.Tensor,
        generator: torch.Generator | Rows | None = None,
    ) -> torch.Tensor:
        if patches.device not in self._by_device:
            self._by_device[patches.device] = PatchRandomErasing(**self.args, device=patches.device)
        erase = self._by_device[patches.device]
        if generator is None:
            return erase(patches, coord, valid)
        g, start, total = rows_of(generator, len(patches))
        seeds = torch.randint(2**62, (total,), generator=g)[start : start + len(patches)].tolist()
        cuda = [patches.device] if patches.device.type == "cuda" else []
        # (the generators put back once for the batch: this GPU's by fork_rng, the host's by reseeding)
        with torch.random.fork_rng(devices=cuda, device_type="cuda"), reseeding() as reseed:
            for i, seed in enumerate(seeds):  # (timm erases an image at a time too; in place)
                reseed(seed)
                if cuda:  # rand and pixel modes draw their values on the device
                    torch.cuda.default_generators[patches.device.index or 0].manual_seed(seed)
                erase(patches[i : i + 1], coord[i : i + 1], valid[i : i + 1])
        return patches
