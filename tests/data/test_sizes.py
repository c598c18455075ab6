"""Training at several sizes (data/sizes.py, `data.train_img_sizes`): each batch's size and batch size as timm's
ScheduledBatchSampler draws them (held to timm's create_loader, which builds it the same way), the same on every
process at every step; images cropped at their batch's size in the workers, or resized on the device; validation at
the model's size; every bad key one line."""

import dataclasses

import pytest
import torch
from timm.data import ScheduledBatchSampler, create_loader

from tests.helpers.trainers import fake_trainer
from vitlab.data import FakeDataModule
from vitlab.data.seeded import TransformDataset
from vitlab.data.sizes import ScheduledBatches, SizeSchedule, check_model
from vitlab.data.transforms import train_transform
from vitlab.model.config import ViTConfig
from vitlab.training.batch_lr import global_batch
from vitlab.training.module import OBJECTIVES
from vitlab.utils.errors import UserError

# the kinds of schedule each objective trains on, as the fit reads them (training/run/build.py)
SCHEDULES = {name: kind.schedules for name, kind in OBJECTIVES.items()}


def _as_rank(dm, rank: int, world: int, epoch: int = 0, max_epochs: int = 3) -> None:
    """`dm` as process `rank` of `world` sees it under a Trainer, in `epoch` of `max_epochs`."""
    dm.trainer = fake_trainer(world, rank, epoch, max_epochs=max_epochs)


class _Images(torch.utils.data.Dataset):
    """`n` images for timm's create_loader (the 96 training images), which sets their transform."""

    def __init__(self, n: int):
        self.n, self.transform = n, None

    def __len__(self) -> int:
        return self.n


def _fake(**keys) -> FakeDataModule:
    keys.setdefault("train_transform", {"random_resized_crop": None, "hflip": 0.0})  # fake.yaml's: held on the device
    dm = FakeDataModule(img_size=16, num_train=96, num_val=8, num_test=8, num_workers=0, batch_size=16, **keys)
    dm.setup("fit")
    return dm


def _steps(dm, rank: int, world: int, epoch: int) -> list[torch.Tensor]:
    """The images (as the model takes them) of each batch process `rank` of `world` trains on in `epoch`."""
    _as_rank(dm, rank, world, epoch)
    steps = []
    for batch in dm.train_dataloader():
        x, y = dm.device_transform(batch, train=True)
        dm.trainer.next_batch()
        assert x.dtype == torch.float32 and x.shape[-2] == x.shape[-1] and len(x) == len(y)
        steps.append(x)
    return steps


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("schedule", ["constant", "progressive"])
def test_every_count_of_processes_trains_on_the_same_sizes_and_images_in_timms_order(on_device, schedule):
    """Sizes 8/12/16 with global batch sizes 16/8/4, weights 1:2:1: each step's global batch is the one timm's
    create_loader draws over the whole training set (the same seed, drop_last, trainer.max_epochs for progressive),
    and on 2 or 4 processes each trains its contiguous share of it: the same images, augmented alike (issue 78)."""
    keys = dict(
        train_img_sizes=[8, 12, 16], train_batch_sizes=[16, 8, 4], train_size_probs=[1.0, 2.0, 1.0],
        train_size_schedule=schedule, on_device=on_device,
        train_transform={"random_resized_crop": None, "hflip": 0.5, "shift": 2},  # drawn per image
    )  # fmt: skip
    dm, seen = _fake(**keys), []
    for epoch in range(3):
        one = _steps(dm, 0, 1, epoch)
        timms = create_loader(
            _Images(96), input_size=(3, 16, 16), batch_size=16, is_training=True, use_prefetcher=False,
            input_size_choices=[8, 12, 16], batch_size_choices=[16, 8, 4], batch_choice_weights=[1.0, 2.0, 1.0],
            batch_choice_seed=dm.shuffle_seed, batch_choice_schedule=schedule,
            batch_schedule_epochs=3 if schedule == "progressive" else None,
        ).batch_sampler  # fmt: skip
        timms.set_epoch(epoch)
        assert [(x.shape[-1], len(x)) for x in one] == [([8, 12, 16][batch[0][1]], len(batch)) for batch in timms]
        for world in (2, 4):
            shares = [_steps(dm, rank, world, epoch) for rank in range(world)]
            assert all(torch.equal(torch.cat(parts), x) for x, *parts in zip(one, *shares, strict=True))
        seen.append(sum(x.shape[-1] for x in one) / len(one))
    assert seen[0] < seen[2] if schedule == "progressive" else len(set(seen)) == 1  # from small to large; a fixed mix


@pytest.mark.parametrize("sampler", [dict(repeated_aug=3), dict(sampler="class_balanced")], ids=["repeats", "balanced"])
def test_a_schedule_cuts_repeated_augmentations_and_class_balanced_draws_as_the_uniform_order(sampler):
    """DeiT's copies and the class-balanced draws are whole-set sequences too: the schedule cuts each into global
    batches, so 2 or 4 processes' shares make the one process's batches (each sampler dealing its share first and the
    schedule cutting that again gave each process half the batches)."""
    dm = _fake(train_img_sizes=[8, 16], train_transform={"random_resized_crop": None, "hflip": 0.5}, **sampler)
    one = _steps(dm, 0, 1, 1)
    for world in (2, 4):
        shares = [_steps(dm, rank, world, 1) for rank in range(world)]
        assert all(torch.equal(torch.cat(parts), x) for x, *parts in zip(one, *shares, strict=True))


def test_each_image_is_the_training_transform_at_its_batchs_size():
    """The loader path: an image of a size-8 batch is what the one-size pipeline of an 8-px model makes of it (the
    same random crop and flip: the same seed)."""
    dm = _fake(train_img_sizes=[8, 16], on_device=False, train_transform={"hflip": 0.5})  # crops and flips
    one = TransformDataset(dm.train_set.base, train_transform(8, dm.mean, hflip=0.5), dm.train_set.indices)
    _as_rank(dm, 0, 1)
    loader = dm.train_dataloader()
    pairs = next(pairs for pairs in loader.sampler if pairs[0][1] == 0)  # a batch at 8 px
    x, y = loader.dataset[pairs]
    assert x.dtype == torch.uint8 and x.shape == (16, 3, 8, 8)
    for (key, _), image, label in zip(pairs, x, y, strict=True):
        expected, expected_label = one[key]
        assert torch.equal(image, expected) and label == expected_label


def test_held_on_the_device_a_batch_comes_with_its_size_and_is_resized_there():
    dm = _fake(train_img_sizes=[8, 16], on_device=True)
    _as_rank(dm, 0, 1)
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, ScheduledBatches) and loader.batch_size is None
    batch = next(iter(loader))
    images, labels, size = batch
    assert images.shape[-2:] == (16, 16)  # stored at the model's size
    x, y = dm.device_transform(batch, train=True)
    expected = dm.to_input(images, False, None, size)  # nothing random here: no shift, flip or erasing
    assert x.shape[-2:] == size and torch.equal(x, expected) and torch.equal(y, labels)


def test_validation_and_testing_stay_at_the_models_size():
    dm = _fake(train_img_sizes=[8, 12], on_device=False)
    _as_rank(dm, 0, 1)
    for loader in (dm.val_dataloader(), dm.test_dataloader()):
        x, _ = dm.device_transform(next(iter(loader)), train=False)
        assert x.shape[-2:] == (16, 16)


def test_a_schedule_of_batch_sizes_scales_the_learning_rate_by_its_average_as_timm():
    data = dict(batch_size=64, train_img_sizes=[128, 224], train_batch_sizes=[256, 64], train_size_probs=[1.0, 3.0])
    timms = ScheduledBatchSampler(range(320), batch_sizes=[256, 64], choice_weights=[1.0, 3.0])
    batch, how = global_batch(data, {"devices": 1, "num_nodes": 1})
    assert timms.average_batch_size == 112.0 and batch == 112 and "112.00" in how


BAD = [
    (dict(train_img_sizes=[]), "data.train_img_sizes [] must be a non-empty list of sizes in px >= 1"),
    (dict(train_img_sizes=[8, 0]), "data.train_img_sizes [8, 0] must be a non-empty list"),
    (dict(train_batch_sizes=[8]), "data.train_batch_sizes [8] needs data.train_img_sizes"),
    (dict(train_img_sizes=[8, 16], train_batch_sizes=[8]), "needs one value per size of data.train_img_sizes"),
    (dict(train_img_sizes=[8, 16], train_size_probs=[0.0, 0.0]), "must be weights >= 0 with a positive sum"),
    (dict(train_img_sizes=[8, 16], train_size_schedule="linear"), "'linear' is not one of ['constant', 'progr"),
    (dict(train_img_sizes=[8], train_size_schedule="progressive"), "progressive moves between sizes: [8] has one"),
    (dict(train_img_sizes=[8, 16], train_size_random_mix=1.5), "data.train_size_random_mix 1.5 must be in [0, 1]"),
    (dict(train_img_sizes=[8, 16], train_size_schedule_spread=-1.0), "spread -1.0 must be >= 0"),
]


@pytest.mark.parametrize("keys, message", BAD)
def test_bad_keys_are_one_line(keys, message):
    with pytest.raises(UserError) as e:
        _fake(**keys)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_data_batch_size_does_not_limit_a_schedule_with_its_own_batch_sizes():
    dm = _fake(train_img_sizes=[8, 16], train_batch_sizes=[16, 8])
    dm.batch_size = 128  # more than the 96 training images: the schedule's sizes are what is loaded
    _as_rank(dm, 0, 1)
    assert {len(batch[0]) for batch in dm.train_dataloader()} == {16, 8}


def test_what_a_loader_cannot_do_is_one_line():
    dm = _fake(train_img_sizes=[8, 16], train_batch_sizes=[16, 6])
    _as_rank(dm, 0, 4)
    with pytest.raises(UserError, match=r"data.train_batch_sizes \[16, 6\] are global and must each be divisible"):
        dm.train_dataloader()
    dm = _fake(train_img_sizes=[8, 16], train_size_schedule="progressive")
    _as_rank(dm, 0, 1, max_epochs=-1)
    with pytest.raises(UserError, match="over trainer.max_epochs, which is -1: set it"):
        dm.train_dataloader()
    dm = _fake(train_img_sizes=[8, 16], train_batch_sizes=[128, 128])
    _as_rank(dm, 0, 1)
    with pytest.raises(UserError, match=r"^data.train_batch_sizes \[128, 128\] leave no full batch in the \d+ "):
        dm.train_dataloader()


def test_the_model_must_resample_its_position_embeddings_and_tile_every_size():
    schedule = SizeSchedule.from_keys([8, 12, 16], None, None, "constant", 0.65, 0.1)
    fixed = ViTConfig(img_size=16, patch_size=4, embed_dim=8, depth=1, num_heads=1)
    with pytest.raises(UserError, match=r"\[8, 12, 16\] need position embeddings at each size: set model.dynamic_img"):
        check_model(schedule, fixed, "classify", SCHEDULES)
    dynamic = ViTConfig(img_size=16, patch_size=8, embed_dim=8, depth=1, num_heads=1, dynamic_img_size=True)
    with pytest.raises(UserError, match=r"\[12\] are not multiples of model.patch_size \[8, 8\]"):
        check_model(schedule, dynamic, "classify", SCHEDULES)
    with pytest.raises(UserError, match="trains objective=classify, not objective=mae"):
        check_model(schedule, dynamic, "mae", SCHEDULES)
    check_model(schedule, dataclasses.replace(dynamic, patch_size=4), "classify", SCHEDULES)
    check_model(None, fixed, "mae", SCHEDULES)
