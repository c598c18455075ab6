"""NaFlex loading (`data.naflex.seq_lens`), as timm's train.py `--naflex-loader`: each image kept at its own aspect
ratio within a patch budget, batches of variable sequence length, padded, with masks, in the loader's workers.

- Training: each batch draws one sequence length of `seq_lens`; its images go through timm's
  RandomResizedCropToSequence at that budget (a random crop whose aspect ratio is the image's times a factor in
  `ratio`, resized to the largest size whose patches fit the budget), then a flip; its batch size keeps the tokens
  of a batch constant, by timm's rule (`calculate_naflex_batch_size`: data.batch_size x max(seq_lens) tokens, floored
  to a multiple of `batch_divisor`). The batches are data/sizes.py's `ScheduledBatches` (timm's ScheduledBatchSampler,
  the seq_lens its choices): a composition drawn once for the whole training set, in a new order every epoch, each
  global batch shared out in contiguous shares, the same lengths and images at every step on any number of
  processes, resumed mid-epoch (on another count too) by its global position, as the other samplers. Streamed data
  (data=wds, hf streaming) has no indices: its readers yield the same schedule's whole batches (data/streamed.py).
- Evaluation: timm's ResizeToSequence at `max_seq_len` (default max(seq_lens)), data.batch_size a batch.
- A batch is a `NaFlexBatch` (data/naflex_batch.py): padded patches with their coordinates and masks, normalised on
  the device, a training batch's loss weighed by its size (timm's `--naflex-loss-scale`).

The batch answers what the rest of vitlab asks of it (its move to a device, its normalisation, its loss's weight, a
teacher's view of it), and the schedule what the loaders, the checks and evaluation's views ask of it (data/sizes.py's
SizeSchedule): no code outside NaFlex's files and model/ asks whether a batch or a run is NaFlex's
(tests/test_layout.py).

No Hydra, OmegaConf or Lightning here.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torchvision.transforms.v2 as T
from timm.data.naflex_dataset import calculate_naflex_batch_size
from timm.data.naflex_transforms import RandomResizedCropToSequence, ResizeToSequence

from vitlab.data import transforms
from vitlab.data.naflex_batch import Collate, Erasing, Normalise, Pad, Patches
from vitlab.data.sizes import SizeSchedule
from vitlab.model.config import as_hw
from vitlab.utils.errors import UserError

LOSS_SCALES = ("linear", "sqrt", "none")  # naflex_batch.loss_scale's rules
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
    batch_divisor: int = 8  # timm's rule rounds each length's batch down to a multiple of it

    key: ClassVar[str] = "data.naflex.seq_lens"
    kind: ClassVar[str] = "naflex"
    setting: ClassVar[str] = "data.naflex"
    not_on_device: ClassVar[str] = "NaFlex's variable-size patches are made per image"

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
        sides = tuple(math.ceil(math.sqrt(s)) * max(patch_hw) for s in seq_lens)
        return cls(sides, _batches(seq_lens, batch_size, divisor), None, "constant", 0.65, 0.1, seq_lens, max_seq_len,
                   patch_hw, loss_scale, ratio, batch_size, divisor)  # fmt: skip

    def rebatched(self, batch_size: int) -> NaFlexSchedule:
        return dataclasses.replace(self, batch_sizes=_batches(self.seq_lens, batch_size, self.batch_divisor),
                                   reference_batch=batch_size)  # fmt: skip

    def sizes_said(self, sizes) -> str:
        return f"NaFlex's global batch sizes {list(sizes)} (one per data.naflex.seq_lens {list(self.seq_lens)})"

    # ---- what sizes.py asks of a schedule --------------------------------------------------------------
    def batches(self, sampler, batch_size: int, world: int, epochs, seed: int, rank: int = 0):
        if any(b % world for b in self.batch_sizes):
            raise UserError(
                f"NaFlex's global batch sizes {list(self.batch_sizes)} (one per data.naflex.seq_lens) must each be "
                f"divisible by the {world} processes: set data.naflex.batch_divisor to a multiple of {world}"
            )
        return super().batches(sampler, batch_size, world, epochs, seed, rank)

    def describe(self, batches, world: int) -> str:
        return (
            f"NaFlex: sequence lengths {list(self.seq_lens)} patches, global batch sizes {list(batches.batch_sizes)} "
            f"(tokens per batch "
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

    def batch_hw(self, batch: Sequence[Any]) -> None:
        """None: a batch of patches has no one size to resize to (each image is at its own, within its length)."""
        return None

    def training_view(self, img: torch.Tensor) -> dict[str, Any]:
        """The training crop (timm's RandomResizedCropToSequence) at one of `seq_lens` drawn from Python's generator,
        its box recorded (its get_params), resized to the size that length allows the crop's aspect, as
        evaluation/views.py draws the views: {image (C, h, w) in [0, 1], box [x0, y0, x1, y1], size [h, w]}."""
        seq_len = random.choice(self.seq_lens)
        crop, flip = train_transform(seq_len, self.patch_hw, *self.view_args).transforms[1:3]
        ph, pw = self.patch_hw
        (top, left, h, w), size, mode = crop.get_params(img, crop.scale, crop.ratio, crop.attempts, ph, pw, seq_len,
                                                        interpolation=crop.interpolation)  # fmt: skip
        x = flip(T.functional.resized_crop(img, top, left, h, w, list(size), interpolation=mode, antialias=True))
        return {"image": x.float() / 255, "box": [left, top, left + w, top + h], "size": list(x.shape[-2:])}

    def check_model(self, model: Any, objective: str, trained_by: list[str]) -> None:
        if not getattr(model, "naflex", False):
            raise UserError(
                "data.naflex.seq_lens feeds NaFlex batches (patches, coordinates, masks): the model needs "
                "model.naflex=true (a naflexvit, e.g. model=naflexvit_b16)"
            )
        self.check_objective(objective, trained_by)  # MAE's masks and DINO's crops are square images' own
        if tuple(model.patch_hw) != self.patch_hw:
            raise UserError(f"data.naflex.patch_size {list(self.patch_hw)} is not model.patch_size {model.patch_size}")


def _batches(seq_lens: Sequence[int], batch_size: int, divisor: int) -> tuple[int, ...]:
    """timm's create_naflex_loader: data.batch_size x max(seq_lens) tokens a batch, each length's batch by its rule."""
    tokens = batch_size * max(seq_lens)  # timm's max_tokens_per_batch
    return tuple(calculate_naflex_batch_size(tokens, s, divisor=divisor) for s in seq_lens)


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


def setup(dm: Any, naflex: dict | None) -> None:
    """An ImageDataModule's NaFlex loading (data.naflex), where seq_lens is set: the schedule of its training batches,
    its evaluation transform, its batches' normalisation (`to_input`); its splits are read by the loaders (not held on
    the device)."""
    schedule = NaFlexSchedule.from_config(naflex, dm.batch_size)
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
    erasing = Erasing(t.random_erasing, t.erasing_mode, t.erasing_count) if t.random_erasing else None
    dm.to_input = Normalise(dm.mean, dm.std, erasing)
    view = (tuple(t.random_resized_crop or (1.0, 1.0)), schedule.ratio, t.hflip, t.interpolation)
    dm.size_schedule, dm.resides = dataclasses.replace(schedule, view_args=view), False
    dm.eval_tf = eval_transform(schedule.max_seq_len, schedule.patch_hw, interpolation)


def check_square_reader(model: Any, refusal: str) -> None:
    """`refusal` (a one-line UserError) for a model (a ViTConfig) that takes NaFlex's patches, by what reads square
    images' patch grids or blocks' tokens (evaluation's layers, the segmentation probe)."""
    if model.naflex:
        raise UserError(refusal)


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


def training_schedule(data: Mapping[str, Any]) -> SizeSchedule | None:
    """The schedule of training sizes a data module of the settings `data` (its views beside them) trains at, for the
    checks made as a run is planned: NaFlex's sequence lengths where data.naflex gives them, else the sizes of
    data.train_img_sizes (data/sizes.py); None at one size. (Its batches are at one image where data.batch_size is
    still `auto`.)"""
    batch = data.get("batch_size")
    schedule = NaFlexSchedule.from_config(data.get("naflex"), batch if isinstance(batch, int) else 1)
    return schedule if schedule is not None else SizeSchedule.from_data(data)


def data_views(data: Mapping[str, Any], objective: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """The data module's arguments a run of `model` (a ViTConfig) adds to its data settings `data`: NaFlex's patches
    at the model's patch size where the data asks for NaFlex batches (data.naflex.seq_lens), objective.mixup refused
    there; none otherwise."""
    if (data.get("naflex") or {}).get("seq_lens") is None:
        return {}
    check_mixup(objective.get("mixup"))
    return {"naflex": for_model(data["naflex"], model)}
