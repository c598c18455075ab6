"""NaFlex loading (`data.naflex.seq_lens`), as timm's train.py `--naflex-loader`: each image kept at its own aspect
ratio within a patch budget, batches of variable sequence length, padded, with masks, in the loader's workers.

- Training: each batch draws one sequence length of `seq_lens`; its images go through timm's
  RandomResizedCropToSequence at that budget (a random crop whose aspect ratio is the image's times a factor in
  `ratio`, resized to the largest size whose patches fit the budget), then a flip; its batch size keeps the tokens
  of a batch constant, by timm's rule (`calculate_naflex_batch_size`: data.batch_size x max(seq_lens) tokens, floored
  to a multiple of `batch_divisor`). The batches are data/sizes.py's `ScheduledBatches` (timm's ScheduledBatchSampler,
  the seq_lens its choices): a composition drawn once, in a new order every epoch, every process the same length at
  the same step, resumed mid-epoch by its position and shared out under DDP as the other samplers. Streamed data
  (data=wds, hf streaming) has no indices: its readers yield the same schedule's whole batches (data/streamed.py).
- Evaluation: timm's ResizeToSequence at `max_seq_len` (default max(seq_lens)), data.batch_size a batch.
- A batch is {patches (B, L, P*P*C) uint8, patch_coord (B, L, 2), patch_valid (B, L)}, labels: normalised on the
  device (`normalise`); the loss of a training batch is scaled by its batch size over data.batch_size (timm's
  `--naflex-loss-scale`: linear, sqrt or none), carried as the batch's `loss_scale`.

No Hydra, OmegaConf or Lightning here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torchvision.transforms.v2 as T
from timm.data.naflex_dataset import calculate_naflex_batch_size
from timm.data.naflex_random_erasing import PatchRandomErasing
from timm.data.naflex_transforms import RandomResizedCropToSequence, ResizeToSequence
from torch.utils.data._utils.collate import default_collate

from vitlab.data import transforms
from vitlab.data.seeded import seeded
from vitlab.data.sizes import SizeSchedule
from vitlab.model.config import as_hw
from vitlab.utils.errors import UserError

LOSS_SCALES = ("linear", "sqrt", "none")
KEYS = ("seq_lens", "max_seq_len", "patch_size", "batch_divisor", "loss_scale", "ratio")


@dataclass(frozen=True)
class NaFlexSchedule(SizeSchedule):
    """A SizeSchedule whose choices are sequence lengths: `img_sizes` holds the side (px) of the square with as
    many patches as each, for the memory estimate; the loaders read `seq_lens`."""

    seq_lens: tuple[int, ...] = ()
    max_seq_len: int = 0
    patch_hw: tuple[int, int] = (16, 16)
    loss_scale: str = "linear"
    ratio: tuple[float, float] = (0.75, 4 / 3)
    reference_batch: int = 1  # data.batch_size: the batch at max(seq_lens), what the loss scale divides by

    @classmethod
    def from_config(cls, naflex: dict | None, batch_size: int) -> NaFlexSchedule | None:
        """data.naflex as a schedule (None where seq_lens is null), each bad value refused in one line."""
        naflex = dict(naflex or {})
        unknown = sorted(set(naflex) - set(KEYS))
        if unknown:
            raise UserError(f"data.naflex has no key(s) {unknown}; it takes {list(KEYS)}")
        seq_lens = naflex.get("seq_lens")
        if seq_lens is None:
            if naflex.get("max_seq_len") is not None:
                raise UserError("data.naflex.max_seq_len needs data.naflex.seq_lens (the training budgets)")
            return None
        if naflex.get("patch_size") is None:
            raise UserError("data.naflex.patch_size is null: give it, or a model.patch_size (the model's patches)")
        patch_hw = as_hw(naflex["patch_size"], "data.naflex.patch_size")
        if not isinstance(seq_lens, Sequence) or not seq_lens:
            raise UserError(f"data.naflex.seq_lens {seq_lens!r} must be a non-empty list of patch counts")
        for s in seq_lens:
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise UserError(f"data.naflex.seq_lens {list(seq_lens)}: {s!r} is not a positive number of patches")
        max_seq_len = naflex.get("max_seq_len") or max(seq_lens)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise UserError(f"data.naflex.max_seq_len {max_seq_len!r} must be a positive number of patches")
        loss_scale = naflex.get("loss_scale", "linear")
        if loss_scale not in LOSS_SCALES:
            raise UserError(f"data.naflex.loss_scale {loss_scale!r} is not one of {list(LOSS_SCALES)}")
        divisor = naflex.get("batch_divisor", 8)
        if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
            raise UserError(f"data.naflex.batch_divisor {divisor!r} must be an integer >= 1")
        ratio = tuple(naflex.get("ratio") or (0.75, 4 / 3))
        seq_lens = tuple(sorted(set(seq_lens)))
        tokens = batch_size * max(seq_lens)  # timm's max_tokens_per_batch
        batches = tuple(calculate_naflex_batch_size(tokens, s, divisor=divisor) for s in seq_lens)
        sides = tuple(math.ceil(math.sqrt(s)) * max(patch_hw) for s in seq_lens)
        return cls(sides, batches, None, "constant", 0.65, 0.1, seq_lens, max_seq_len, patch_hw, loss_scale, ratio,
                   batch_size)  # fmt: skip

    # ---- what sizes.py asks of a schedule --------------------------------------------------------------
    def batches(self, sampler, batch_size: int, world: int, epochs, seed: int):
        if any(b % world for b in self.batch_sizes):
            raise UserError(
                f"NaFlex's global batch sizes {list(self.batch_sizes)} (one per data.naflex.seq_lens) must each be "
                f"divisible by the {world} processes: set data.naflex.batch_divisor to a multiple of {world}"
            )
        return super().batches(sampler, batch_size, world, epochs, seed)

    def describe(self, batches, world: int) -> str:
        per_len = [b * world for b in batches.batch_sizes]
        return (
            f"NaFlex: sequence lengths {list(self.seq_lens)} patches, global batch sizes {per_len} (tokens per batch "
            f"{self.reference_batch * max(self.seq_lens)}), evaluation at {self.max_seq_len}: {len(batches)} batches "
            f"an epoch"
        )

    view_args: tuple = ((0.08, 1.0), (0.75, 4 / 3), 0.5, "bicubic")  # the crop's scale, ratio, flip, interpolation

    def loading(self, dm: Any) -> tuple[list, list]:
        """The per-choice training transforms and collates of a data module (ImageDataModule)."""
        t = dm.train_settings  # its policy sized (timm's translations) by the square of as many patches as each length
        made = [
            train_transform(n, self.patch_hw, *self.view_args, policy=transforms.policy_ops(t, (s, s), dm.mean))
            for n, s in zip(self.seq_lens, self.img_sizes, strict=True)
        ]  # fmt: skip
        world = dm.trainer.world_size if dm.trainer is not None else 1
        return made, [Collate(self, world)] * len(self.seq_lens)

    def check_model(self, model: Any, objective: str) -> None:
        if not getattr(model, "naflex", False):
            raise UserError(
                "data.naflex.seq_lens feeds NaFlex batches (patches, coordinates, masks): the model needs "
                "model.naflex=true (a naflexvit, e.g. model=naflexvit_b16)"
            )
        if objective not in ("classify", "distill"):  # MAE's masks and DINO's crops are square images' own
            raise UserError(f"data.naflex trains objective=classify or distill, not objective={objective}")
        if tuple(model.patch_hw) != self.patch_hw:
            raise UserError(f"data.naflex.patch_size {list(self.patch_hw)} is not model.patch_size {model.patch_size}")


# ---- per image, in the workers -------------------------------------------------------------------------


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


def train_transform(
    seq_len, patch_hw, scale, ratio, hflip: float, interpolation: str, policy: Sequence = ()
) -> T.Compose:
    """timm's NaFlex training crop at `seq_len` patches, then a flip and `policy` (data.train_transform's auto_augment,
    colour jitter, grayscale, blur: transforms.policy_ops) on the image at its own size, as uint8 patches."""
    crop = RandomResizedCropToSequence(patch_hw, seq_len, scale=scale, ratio=ratio, interpolation=interpolation)
    ops = [T.ToImage(), crop, T.RandomHorizontalFlip(hflip), *policy, Patches(patch_hw), Pad(seq_len)]
    return T.Compose(ops)


def eval_transform(seq_len: int, patch_hw, interpolation: str = "bicubic") -> T.Compose:
    """timm's NaFlex evaluation: the whole image resized, aspect kept, to the most patches within `seq_len`."""
    resize = ResizeToSequence(patch_hw, seq_len, interpolation=interpolation)
    return T.Compose([T.ToImage(), resize, Patches(patch_hw), Pad(seq_len)])


class Pad:
    """(patches, coordinates) -> {patches, patch_coord, patch_valid} padded to `seq_len` patches (timm's
    NaFlexCollator, per image in the workers: the loader's default collate stacks them)."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def __call__(self, item: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        (p, c), L = item, self.seq_len
        n = min(len(p), L)
        patches = p.new_zeros(L, p.shape[1])
        coord, valid = c.new_zeros(L, 2), torch.zeros(L, dtype=torch.bool)
        patches[:n], coord[:n], valid[:n] = p[:n], c[:n], True
        return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


class Collate:
    """A training batch of padded images stacked, with its loss scale (`loss_scale`) beside the patches."""

    def __init__(self, schedule: NaFlexSchedule, world: int):
        self.schedule, self.world = schedule, world

    def __call__(self, items):
        x, y = default_collate(items)
        return [x | {"loss_scale": torch.tensor(loss_scale(len(y), self.schedule, self.world))}, y]


def loss_scale(batch: int, schedule: NaFlexSchedule, world: int = 1) -> float:
    """timm's train.py: a batch's loss times its size over data.batch_size's share (linear), its square root, or 1."""
    if schedule.loss_scale == "none":
        return 1.0
    ratio = batch / max(1, schedule.reference_batch // world)
    return ratio**0.5 if schedule.loss_scale == "sqrt" else ratio


def normalise(
    batch: dict,
    mean: Sequence[float],
    std: Sequence[float],
    erasing: Erasing | None = None,
    generator: torch.Generator | None = None,
) -> dict:
    """uint8 patches (B, L, P*P*C) on the device -> float32 normalised per channel (C varies fastest), then erased
    (training's `erasing`, where data.train_transform.random_erasing is set, its draws seeded from `generator`)."""
    x = batch["patches"]
    C = len(mean)
    m = torch.tensor(mean, device=x.device, dtype=torch.float32)
    s = torch.tensor(std, device=x.device, dtype=torch.float32)
    x = (x.to(torch.float32).div_(255).unflatten(-1, (-1, C)) - m) / s
    if erasing is not None:
        x = erasing(x, batch["patch_coord"], batch["patch_valid"], generator)
    return batch | {"patches": x.flatten(-2)}


class Erasing:
    """data.train_transform.random_erasing on NaFlex's normalised patches (B, L, P*P, C) as timm's NaFlex loader erases
    them (its PatchRandomErasing, region mode): with probability `p` an image gets 1 to `count` rectangles of whole
    patches of its own grid (area 2-33%, aspect 0.3-3.3), filled by `mode` (const zeros, rand a normal colour, pixel
    normal noise). timm's code draws from Python's and torch's global generators: here they are seeded, for the call,
    with a number drawn from `generator` (the data module's own, checkpointed, one stream per process, as the square
    images' erasing draws) and put back after, so a run resumed mid-epoch erases as the uninterrupted one did."""

    def __init__(self, p: float, mode: str, count: int):
        self.args = dict(erase_prob=p, mode=mode, max_count=count)
        self._by_device: dict[torch.device, PatchRandomErasing] = {}

    def __call__(
        self, patches: torch.Tensor, coord: torch.Tensor, valid: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        if patches.device not in self._by_device:
            self._by_device[patches.device] = PatchRandomErasing(**self.args, device=patches.device)
        erase = self._by_device[patches.device]
        if generator is None:
            return erase(patches, coord, valid)
        seed = int(torch.randint(2**62, (1,), generator=generator))
        cuda = [patches.device] if patches.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):  # (CPU's and this GPU's put back after)
            if cuda:  # rand and pixel modes draw their values on the device
                torch.cuda.default_generators[patches.device.index or 0].manual_seed(seed)
            return seeded(seed, lambda x: erase(x, coord, valid), patches)


def setup(dm: Any, naflex: dict | None) -> None:
    """An ImageDataModule's NaFlex loading (data.naflex), where seq_lens is set: the schedule of its training batches,
    its evaluation transform; its splits are read by the loaders (not held on the device)."""
    schedule = NaFlexSchedule.from_config(naflex, dm.batch_size)
    dm.naflex_erasing = None
    if schedule is None:
        return
    if dm.size_schedule is not None or dm.views is not None:
        raise UserError("data.naflex.seq_lens sets the training sizes: drop data.train_img_sizes / objective=dino")
    interpolation = dm.eval_settings.get("interpolation") or "bicubic"
    t = dm.train_settings
    for key, value, off in (("shift", t.shift, 0), ("simple_crop", t.simple_crop, False)):
        if value != off:
            value, off = (str(v).lower() if isinstance(v, bool) else v for v in (value, off))
            raise UserError(f"data.train_transform.{key} {value} crops square images; NaFlex crops each image with "
                            f"random_resized_crop at its own aspect: set data.train_transform.{key}={off}")  # fmt: skip
    if t.random_erasing:
        dm.naflex_erasing = Erasing(t.random_erasing, t.erasing_mode, t.erasing_count)
    view = (tuple(t.random_resized_crop or (1.0, 1.0)), schedule.ratio, t.hflip, t.interpolation)
    dm.size_schedule, dm.resides = dataclasses.replace(schedule, view_args=view), False
    dm.eval_tf = eval_transform(schedule.max_seq_len, schedule.patch_hw, interpolation)


def to_device(x, device):
    """A model input (images, or a NaFlex batch's dict) on `device`."""
    return {k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device)


def check_mixup(mixup: Any) -> None:
    """objective.mixup refused beside data.naflex, before any work: timm's Mixup mixes a batch of square images, and a
    NaFlex batch is padded patches of images of different shapes."""
    mixup = dict(mixup or {})
    on = {k: mixup.get(k) for k in ("mixup_alpha", "cutmix_alpha", "cutmix_minmax") if mixup.get(k)}
    if on:
        raise UserError(
            f"objective.mixup {on} mixes square images; data.naflex.seq_lens trains without MixUp/CutMix: set "
            "objective.mixup.mixup_alpha=0 objective.mixup.cutmix_alpha=0 objective.mixup.cutmix_minmax=null"
        )


def for_model(naflex: Any, model: Any) -> dict:
    """data.naflex for a run of `model` (a ViTConfig), before any work: refused for a model without NaFlex, its patch
    size the model's where the data config leaves it null."""
    if not model.naflex:
        raise UserError(
            "data.naflex.seq_lens feeds NaFlex batches (patches, coordinates, masks): the model needs "
            "model.naflex=true (a naflexvit, e.g. model=naflexvit_b16)"
        )
    plain = {k: list(v) if isinstance(v, Sequence) and not isinstance(v, str) else v for k, v in naflex.items()}
    return plain | {"patch_size": plain.get("patch_size") or list(model.patch_hw)}


def data_views(data: Mapping[str, Any], objective: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """The data module's arguments a run of `model` (a ViTConfig) adds to its data settings `data`: NaFlex's patches
    at the model's patch size where the data asks for NaFlex batches (data.naflex.seq_lens), objective.mixup refused
    there; none otherwise."""
    if (data.get("naflex") or {}).get("seq_lens") is None:
        return {}
    check_mixup(objective.get("mixup"))
    return {"naflex": for_model(data["naflex"], model)}
