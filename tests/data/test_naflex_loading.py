"""NaFlex loading (issue 65, point 2; data/naflex.py): images at their own aspect ratio within a patch budget, batches
of variable sequence length with timm's batch-size rule and loss scale, padded in the workers, the same lengths on
every process, resumed mid-epoch exactly; every bad key one line."""

import dataclasses
import random
import re

import pytest
import torch
from PIL import Image
from timm.data.naflex_dataset import calculate_naflex_batch_size
from timm.data.naflex_transforms import get_image_size_for_seq

from tests.helpers.trainers import fake_trainer
from vitlab.data import ImageFolderDataModule, StreamingDataModule
from vitlab.data.naflex import NaFlexSchedule, eval_transform, train_transform
from vitlab.data.sizes import check_model
from vitlab.model.config import ViTConfig
from vitlab.training.module import OBJECTIVES
from vitlab.utils.errors import UserError

# the kinds of schedule each objective trains on, as the fit reads them (training/run/build.py)
SCHEDULES = {name: kind.schedules for name, kind in OBJECTIVES.items()}

ASPECTS = [(96, 32), (48, 48), (32, 96)]  # (w, h): 3:1, 1:1, 1:3
SMALL = dict(num_classes=3, img_size=16, batch_size=8)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 12), ("val", 3)):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                w, h = ASPECTS[i % 3]
                arr = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
                Image.fromarray(arr).save(root / split / c / f"{i}.png")
    return root


def _as_rank(dm, rank: int, world: int, epoch: int = 0) -> None:
    dm.trainer = fake_trainer(world, rank, epoch, max_epochs=2)


def _dm(photos, train_transform=None, batch_size=4, **naflex):
    keys = dict(seq_lens=[4, 9], patch_size=8, batch_divisor=1) | naflex
    torch.manual_seed(0)  # the run's seed: the shuffling and the lengths' composition
    dm = ImageFolderDataModule(data_dir=str(photos), num_classes=2, img_size=32, batch_size=batch_size, num_workers=0,
                               naflex=keys, check_images=False, train_transform=train_transform)  # fmt: skip
    dm.setup("fit")
    return dm


def test_batch_sizes_follow_timms_rule_and_lengths_are_drawn_per_batch(photos):
    dm = _dm(photos, batch_divisor=2)
    # timm's create_naflex_loader: batch_size x max(seq_lens) tokens a batch, each length's batch by its rule
    assert dm.size_schedule.batch_sizes == tuple(calculate_naflex_batch_size(4 * 9, s, divisor=2) for s in (4, 9))
    _as_rank(dm, 0, 1)
    seen = set()
    for x, y in (dm.device_transform(b, train=True) for b in dm.train_dataloader()):
        L = x["patches"].shape[1]
        seen.add(L)
        assert len(y) == dict(zip((4, 9), dm.size_schedule.batch_sizes, strict=True))[L]
        assert x["patches"].dtype == torch.float32 and x["patches"].shape[-1] == 8 * 8 * 3
        assert x["patch_valid"].sum(1).le(L).all() and x["patch_valid"].any(1).all()
        torch.testing.assert_close(x["loss_scale"], torch.tensor(len(y) / 4))  # linear: over data.batch_size
    assert seen == {4, 9}


def test_training_crop_and_evaluation_keep_each_images_aspect_within_the_budget():
    img = Image.new("RGB", (300, 100))
    for seq_len in (9, 36):
        out = eval_transform(seq_len, (8, 8))(img)
        valid = out["patch_valid"]
        hw = out["patch_coord"][valid].amax(0) + 1
        assert valid.sum() <= seq_len and tuple(hw.tolist()) == tuple(
            s // 8 for s in get_image_size_for_seq((100, 300), 8, seq_len)[1]
        )  # timm's ResizeToSequence: the largest size of the image's aspect whose patches fit
        assert hw[1] >= 2 * hw[0]  # 3:1 stays wide
        crop = train_transform(seq_len, (8, 8), (1.0, 1.0), (1.0, 1.0), 0.0, "bicubic")(img)
        assert crop["patch_valid"].sum() <= seq_len and crop["patch_coord"][crop["patch_valid"]].amax(0)[1] >= 2


def test_every_count_of_processes_gets_the_same_lengths_and_images_and_resumes_at_the_global_position(photos):
    """Issue 78: each epoch's schedule of lengths is drawn over the whole training set and each global batch shared
    out, so 1 or 2 processes train the same images at the same lengths, step by step (each process its contiguous
    share); a loader started at a global position (a resume on another count) goes on with the same batches, and one
    resumed from its own state too."""
    with pytest.raises(UserError, match="batch_divisor to a multiple of 2"):
        _as_rank(dm := _dm(photos), 0, 2)
        dm.train_dataloader()
    dm = _dm(photos, dict(random_erasing=0.5, erasing_mode="pixel"), batch_divisor=2)  # erased on the device

    def patches(rank: int, world: int, epoch: int, start: tuple[int, int] | None = None) -> list[torch.Tensor]:
        """The patches the model takes at each step (`start`: a loader started at that global position)."""
        _as_rank(dm, rank, world, epoch)
        dm.resume_at, steps = start, []
        dm.trainer.fit_loop.epoch_loop.batch_progress.current.ready = start[1] if start else 0
        for batch in dm.train_dataloader():
            steps.append(dm.device_transform(batch, train=True)[0]["patches"])
            dm.trainer.next_batch()
        return steps

    epochs = []
    for epoch in (0, 1):
        one, shares = patches(0, 1, epoch), [patches(rank, 2, epoch) for rank in (0, 1)]
        assert len(one) > 2 and all(torch.equal(torch.cat(parts), x) for x, *parts in zip(one, *shares, strict=True))
        epochs.append(one)
    assert not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(*epochs, strict=True))  # a new order
    for world in (1, 2):  # started at the third global batch of epoch 1, as a resume on another count starts
        rest = [patches(rank, world, 1, start=(1, 2)) for rank in range(world)]
        assert all(torch.equal(torch.cat(parts), x) for x, *parts in zip(epochs[1][2:], *rest, strict=True))
    dm.resume_at = None
    loader = dm.train_dataloader()  # (the patches as the workers make them)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    rest = [b[0]["patches"] for b in it]
    again = dm.train_dataloader()
    again.load_state_dict(state)
    resumed = [b[0]["patches"] for b in again]
    assert len(resumed) == len(rest) and all(torch.equal(a, b) for a, b in zip(rest, resumed, strict=True))


def test_the_loss_scale_is_the_global_batch_over_data_batch_size_on_any_count():
    """Issue 78: a batch's loss scale (timm's --naflex-loss-scale) is its global batch over data.batch_size, whatever
    share of it a process holds (data.batch_size 3 on 2 processes: a share of 3 of a global 6 was scaled by
    3 / (3 // 2) = 3, where one process scaled the 6 by 2)."""
    from vitlab.data.naflex_batch import loss_scale

    schedule = NaFlexSchedule.from_config(dict(seq_lens=[4, 9], patch_size=8, batch_divisor=2), 3)
    for rule, expected in (("linear", 2.0), ("sqrt", 2.0**0.5), ("none", 1.0)):
        ruled = dataclasses.replace(schedule, loss_scale=rule)
        assert [loss_scale(6 // world, ruled, world) for world in (1, 2, 3)] == [expected] * 3


def _train_batches(dm):
    _as_rank(dm, 0, 1)
    return [dm.device_transform(b, train=True)[0] for b in dm.train_dataloader()]


def test_training_augmentation_of_data_train_transform_runs_on_each_image(photos):
    """auto_augment, colour jitter and grayscale per image before the patches; random erasing on the device as timm's
    NaFlex loader erases (PatchRandomErasing: whole patches, zeros in const mode); the square crops refused."""
    gray = dict(grayscale_prob=1.0, color_jitter=0.4, auto_augment="rand-m9-mstd0.5-inc1")
    _as_rank(dm := _dm(photos, gray, seq_lens=[36, 64]), 0, 1)
    for x, _ in dm.train_dataloader():  # uint8, as the workers make them
        rgb = x["patches"].unflatten(-1, (-1, 3))[x["patch_valid"]]
        assert torch.equal(rgb[..., 0], rgb[..., 1]) and torch.equal(rgb[..., 1], rgb[..., 2])  # grayed, every image

    def zeroed(transform):  # valid patches that are all zeros once normalised (ImageNet's mean: none without erasing)
        random.seed(0)
        dm = _dm(photos, transform, seq_lens=[36, 64])
        return sum(int((x["patches"] == 0).all(-1)[x["patch_valid"]].sum()) for x in _train_batches(dm))

    assert zeroed(None) == 0 and zeroed(dict(random_erasing=1.0)) > 0
    simple = dict(simple_crop=True, random_resized_crop=None)
    for bad, message in ((dict(shift=2), "data.train_transform.shift 2 crops square images"),
                         (simple, "simple_crop true .* set data.train_transform.simple_crop=false")):  # fmt: skip
        with pytest.raises(UserError, match=message):
            _dm(photos, bad)


def test_random_erasing_draws_from_the_data_modules_generator_and_a_resumed_run_erases_alike(photos):
    """timm's PatchRandomErasing draws from the global generators, which a resumed run puts back only after its first
    batch is made (training/devices/rank_state.py): seeded from the data module's own (checkpointed) generator instead
    where there is no global order (in a fit with one: its global batch's Rows, tested above), the global ones left as
    they were; pixel mode's noise too."""
    erasing = dict(random_erasing=1.0, erasing_mode="pixel")
    dm = _dm(photos, erasing, seq_lens=[36, 64])
    _as_rank(dm, 0, 1)
    batches = list(dm.train_dataloader())[:3]  # uint8, as the workers make them
    dm.trainer = None  # erased without a fit's global order

    def erased(dm, batches):
        return [dm.device_transform(b, train=True)[0]["patches"] for b in batches]

    erased(dm, batches[:1])
    state = dm.state_dict()  # what a checkpoint after the first step keeps
    before = random.getstate(), torch.get_rng_state()
    rest = erased(dm, batches[1:])
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])  # left as they were
    resumed = _dm(photos, erasing, seq_lens=[36, 64])
    resumed.load_state_dict(state)
    random.seed(1), torch.manual_seed(1)  # the global generators elsewhere
    again = erased(resumed, batches[1:])
    assert all(torch.equal(a, b) for a, b in zip(rest, again, strict=True))
    plain = _dm(photos, None, seq_lens=[36, 64])
    assert not any(torch.equal(a, b) for a, b in zip(rest, erased(plain, batches[1:]), strict=True))


def test_a_default_batch_too_large_for_the_folder_names_data_batch_size_and_the_largest_that_fits(photos):
    """Issue 74, point 9: NaFlex's batch sizes come from data.batch_size (the user may have set neither); on a small
    folder the refusal names data.batch_size and the largest that gives a full batch, which does, one more not."""
    dm = _dm(photos, batch_size=64, seq_lens=[16, 36, 64], batch_divisor=8)
    _as_rank(dm, 0, 1)
    with pytest.raises(UserError) as refused:
        dm.train_dataloader()
    message = str(refused.value)
    said = (
        r"^data.batch_size 64 makes NaFlex's global batch sizes \[256, 112, 64\] \(one per data.naflex.seq_lens "
        r"\[16, 36, 64\]\), and no full batch fits the 24 training images: set data.batch_size=(\d+) or less$"
    )
    assert (found := re.match(said, message)), message
    largest = int(found[1])
    dm = _dm(photos, batch_size=largest, seq_lens=[16, 36, 64], batch_divisor=8)
    _as_rank(dm, 0, 1)
    assert len(dm.train_dataloader()) >= 1
    dm = _dm(photos, batch_size=largest + 1, seq_lens=[16, 36, 64], batch_divisor=8)
    _as_rank(dm, 0, 1)
    with pytest.raises(UserError, match=f"data.batch_size {largest + 1} makes"):
        dm.train_dataloader()


def test_naflex_keys_on_data_without_naflex_name_the_data_that_has_it():
    """Issue 74, point 9: data.naflex.seq_lens on data=digits (or CIFAR) is one line naming the data NaFlex reads,
    not Hydra's `+data.naflex...`, which only leads to the data module refusing it."""
    from vitlab.cli.override_errors import compose, explain
    from vitlab.utils.errors import config_errors

    for data in ("digits", "cifar10"):
        overrides = [f"data={data}", "data.naflex.seq_lens=[64]"]
        with pytest.raises(config_errors()) as e:
            compose("train", overrides)
        assert explain(e.value, "train", overrides) == (
            f"data.naflex.seq_lens: data={data} has no data.naflex; it is a key of data=hf, data=imagefolder, "
            "data=list, data=streaming or data=wds (the data formats that read it)"
        )


def test_validation_pads_every_image_to_max_seq_len(photos):
    dm = _dm(photos, max_seq_len=12)
    x, y = dm.device_transform(next(iter(dm.val_dataloader())), train=False)
    assert x["patches"].shape[:2] == (4, 12) and "loss_scale" not in x


@pytest.mark.parametrize(
    ("naflex", "message"),
    [
        (dict(seq_lens=[0, 16]), "0 is not a positive number of patches"),
        (dict(seq_lens=[]), "non-empty list"),
        (dict(seq_lens=[16], max_seq_len=-1), "max_seq_len -1"),
        (dict(seq_lens=[16], loss_scale="cube"), "loss_scale 'cube'"),
        (dict(seq_len=[16]), "no key"),
        (dict(max_seq_len=16), "needs data.naflex.seq_lens"),
    ],
)
def test_bad_keys_are_one_line(naflex, message):
    with pytest.raises(UserError, match=message):
        NaFlexSchedule.from_config(naflex | {"patch_size": 16}, 8)


def test_a_model_without_naflex_is_refused_before_any_work():
    schedule = NaFlexSchedule.from_config(dict(seq_lens=[16], patch_size=16), 8)
    with pytest.raises(UserError, match="model.naflex=true"):
        check_model(schedule, ViTConfig(img_size=32, depth=1, embed_dim=32, num_heads=2), "classify", SCHEDULES)
    naflex = ViTConfig(img_size=32, depth=1, embed_dim=32, num_heads=2, naflex=True, class_token=False,
                       global_pool="avg")  # fmt: skip
    with pytest.raises(UserError, match="objective=classify or distill, not objective=mae"):
        check_model(schedule, naflex, "mae", SCHEDULES)
    check_model(schedule, naflex, "classify", SCHEDULES)


def test_shards_of_data_streaming_train_in_naflex_batches_shared_out_and_resumed_exactly(shards):
    """data=streaming (LitData shards read by index): NaFlex's lengths the same in every process, the shares
    disjoint, and a loader resumed mid-epoch gives the batches an uninterrupted one does (data=wds: tests/data/
    test_wds.py)."""
    naflex = dict(seq_lens=[4, 9], patch_size=4, batch_divisor=2)

    def loader(rank: int, world: int):
        torch.manual_seed(0)
        dm = StreamingDataModule(data_dir=str(shards), naflex=naflex, num_workers=0, **SMALL)
        dm.setup("fit")
        _as_rank(dm, rank, world, epoch=1)
        return dm.train_dataloader()

    shares = [loader(rank, 2) for rank in (0, 1)]
    batches = [[[i for (_, i), _ in pairs] for pairs in share.sampler] for share in shares]  # ((seed, index), length)
    assert [len(b) for b in batches[0]] == [len(b) for b in batches[1]] and len(batches[0]) > 2
    assert not {i for b in batches[0] for i in b} & {i for b in batches[1] for i in b}
    assert [x["patches"].shape[1] for x, _ in shares[0]] == [x["patches"].shape[1] for x, _ in shares[1]]
    full = [x["patches"] for x, _ in loader(0, 1)]
    interrupted = loader(0, 1)
    it = iter(interrupted)
    next(it), next(it)
    resumed = loader(0, 1)
    resumed.load_state_dict(interrupted.state_dict())
    rest = [x["patches"] for x, _ in resumed]
    assert len(rest) == len(full) - 2 and all(torch.equal(a, b) for a, b in zip(rest, full[2:], strict=True))
