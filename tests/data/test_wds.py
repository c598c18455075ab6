"""data=wds (data/wds.py) over tars written by `python -m vitlab.pack format=wds` from the `folder` fixture, and the
streamed splits it reads them through (data/streamed.py): evaluation yields the folder's images and labels in its
order; training streams are fixed by the seed, shared out without overlap in equal steps, and resume mid-epoch exactly
(two loader workers); corrupt samples are skipped and counted, or stop the run; bad input is one line."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from vitlab.data import ImageFolderDataModule, WDSDataModule
from vitlab.data.wds import INFO
from vitlab.utils.errors import MissingFileError, UserError

PLAIN = {"random_resized_crop": None, "hflip": 0.0}  # training images as they are (12 px): a sample is its pixels


def urls(shards, split):
    return str(shards / f"{split}-{{000000..000003}}.tar")


def module(shards, rank=0, world=1, epoch=0, **settings) -> WDSDataModule:
    settings = {"val_urls": urls(shards, "val"), "num_workers": 2, "shuffle_buffer": 16} | settings
    dm = WDSDataModule(urls=urls(shards, "train"), num_classes=3, img_size=12, batch_size=8, **settings)
    epochs = SimpleNamespace(current=SimpleNamespace(processed=epoch))
    dm.trainer = SimpleNamespace(
        world_size=world,
        global_rank=rank,
        num_devices=world,
        max_epochs=2,
        fit_loop=SimpleNamespace(epoch_progress=epochs),
    )
    dm.trainer.strategy = SimpleNamespace(root_device=SimpleNamespace(type="cpu"))
    dm.setup("fit")
    return dm


def samples(batches):
    return [
        (bytes(x.flatten().numpy()), int(y)) for images, labels in batches for x, y in zip(images, labels, strict=True)
    ]


def test_pack_writes_every_split_and_evaluation_reads_the_folder_s_images_in_order(folder, wds_shards):
    info = json.loads((wds_shards / INFO).read_text())
    assert info["class_names"] == ["a", "b", "c"] and info["splits"] == {"train": 72, "val": 72, "test": 72}
    assert info["urls"]["train"] == "train-{000000..000003}.tar"
    ref = ImageFolderDataModule(data_dir=str(folder), num_classes=3, img_size=8)
    dm = WDSDataModule(urls=urls(wds_shards, "train"), val_urls=urls(wds_shards, "val"),
                       test_urls=urls(wds_shards, "test"), num_classes=3, img_size=8, batch_size=8)  # fmt: skip
    ref.setup("fit"), dm.setup("fit")
    assert dm.num_train == 72 and dm.class_names == ["a", "b", "c"]
    for split in ("train", "val", "test"):
        theirs = ref.eval_view(split)
        ours = list(dm.eval_view(split).place(0, 0, 1, 8))
        assert len(ours) == len(theirs) == 72
        assert all(torch.equal(x, theirs[i][0]) and y == theirs[i][1] for i, (x, y) in enumerate(ours))
    loader = dm.val_dataloader()
    assert samples(loader) == samples([(x.unsqueeze(0), torch.tensor([y])) for x, y in dm.eval_view("val")])


def test_training_streams_are_fixed_by_the_seed_and_shared_out_without_overlap_in_equal_steps(wds_shards):
    torch.manual_seed(0)
    shares = [samples(module(wds_shards, rank, 2, train_transform=PLAIN).train_dataloader()) for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == 36  # 9 batches of 4 (the global batch of 8 over 2) each
    # Each of the 4 readers (2 processes x 2 workers) reads a shard no other reads (a reader whose shard is shorter than
    # its share goes round it again: an epoch is data.num_train samples, as timm's)
    assert not set(shares[0]) & set(shares[1])
    torch.manual_seed(0)
    assert samples(module(wds_shards, 0, 2, train_transform=PLAIN).train_dataloader()) == shares[0]
    torch.manual_seed(0)
    other_epoch = samples(module(wds_shards, 0, 2, epoch=1, train_transform=PLAIN).train_dataloader())
    assert other_epoch != shares[0]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_training_stream_resumed_mid_epoch_continues_exactly(wds_shards, workers):
    torch.manual_seed(0)
    full = list(module(wds_shards, num_workers=workers, num_train=120).train_dataloader())  # more than a pass
    assert len(full) == 15
    torch.manual_seed(0)
    loader = module(wds_shards, num_workers=workers, num_train=120).train_dataloader()
    it = iter(loader)
    for _ in range(6):
        next(it)
    state = loader.state_dict()
    del it
    torch.manual_seed(0)
    resumed = module(wds_shards, num_workers=workers, num_train=120).train_dataloader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 9 and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, full[6:], strict=True)
    )


def test_a_corrupt_sample_is_skipped_and_counted_or_stops_the_run(folder, tmp_path, caplog):
    from webdataset import TarWriter

    good = sorted((folder / "train" / "a").glob("*.png"))[:3]
    with TarWriter(str(tmp_path / "s-0.tar")) as tar:
        for i, f in enumerate(good):
            data = f.read_bytes() if i != 1 else f.read_bytes()[:40]  # the second cut short
            tar.write({"__key__": f"{i:04d}", "png": data, "cls": b"0"})
    args = {"urls": str(tmp_path / "s-0.tar"), "num_classes": 1, "num_train": 2, "img_size": 8, "batch_size": 1}
    dm = WDSDataModule(**args, val_urls=str(tmp_path / "s-0.tar"), num_workers=0)
    dm.setup("fit")
    assert (
        len(list(dm.eval_view("val").place(0, 0, 1, 1))) == 2
        and "0001, which cannot be decoded (1 skipped in this reader)" in caplog.text
    )
    dm = WDSDataModule(**args, val_urls=str(tmp_path / "s-0.tar"), num_workers=0, corrupt="error")
    dm.setup("fit")
    with pytest.raises(UserError, match=r"s-0.tar 0001' cannot be decoded .* \(data.corrupt=skip leaves such"):
        list(dm.eval_view("val").place(0, 0, 1, 1))


def test_bad_input_is_one_line(wds_shards, tmp_path):
    args = {"num_classes": 3, "img_size": 8}
    with pytest.raises(UserError, match=r"data.urls \[\] names no shards"):
        WDSDataModule(urls=[], **args)
    with pytest.raises(
        MissingFileError, match=r"data.val_urls: shard '.*/val-000008.tar' does not exist \(and 1 more\)$"
    ):
        WDSDataModule(urls=urls(wds_shards, "train"), val_urls=str(wds_shards / "val-{000008..000009}.tar"), **args)
    (tmp_path / "t.tar").write_bytes((wds_shards / "train-000000.tar").read_bytes())
    with pytest.raises(UserError, match="data.num_train is needed"):
        WDSDataModule(urls=str(tmp_path / "t.tar"), **args)
    with pytest.raises(UserError, match="data.corrupt 'maybe' must be skip or error"):
        WDSDataModule(urls=urls(wds_shards, "train"), corrupt="maybe", **args)
    dm = WDSDataModule(urls=str(tmp_path / "t.tar"), num_train=8, label_key="label", **args)
    dm.setup("fit")
    with pytest.raises(
        UserError, match=r"has no integer 'label' member \(None\); name the label's with data.label_key"
    ):
        next(iter(dm.eval_view("val").place(0, 0, 1, 1)))


def test_a_tar_cut_short_is_said_once_and_counted_at_the_end(wds_shards, tmp_path, caplog):
    """Issue 64 point 16: a reader goes round its shards many times an epoch; a cut tar was 144 warnings in one epoch.
    One line for the shard, and the count when the data module is torn down (the end of fit or test)."""
    import logging

    for name in ("train-000000.tar", "train-000001.tar"):
        data = (wds_shards / name).read_bytes()
        (tmp_path / name).write_bytes(data if name.endswith("0.tar") else data[: len(data) // 2])
    dm = WDSDataModule(urls=str(tmp_path / "train-{000000..000001}.tar"), val_urls=urls(wds_shards, "val"),
                       num_classes=3, num_train=96, img_size=8, batch_size=8, num_workers=0)  # fmt: skip
    dm.setup("fit")
    with caplog.at_level(logging.WARNING, logger="vitlab.data.wds"):
        list(dm.train_set.place(0, 0, 1, 8))  # 96 samples of the 30 readable: three passes and more
        dm.teardown("fit")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith(f"shard {tmp_path / 'train-000001.tar'} cannot be read whole")
    assert re.fullmatch(rf"\d+ read\(s\) of 1 shard\(s\) failed and were skipped: {tmp_path}/train-000001.tar "
                        r"\(data.urls, in this process's loaders, data.corrupt=skip\)", lines[1]), lines[1]  # fmt: skip
    assert int(lines[1].split()[0]) >= 3


def test_a_held_out_slice_that_holds_nothing_is_refused_and_a_streamed_split_is_counted(wds_shards):
    """Issue 64 points 9 and 10: one shard of 20 samples with validation held out of it drew none (it validated on
    nothing, a "best" checkpoint chosen): refused in one line; a frozen-feature evaluation of a streamed split counts
    it (its size is no description's)."""
    one = WDSDataModule(urls=str(wds_shards / "train-000000.tar"), num_classes=3, img_size=8, batch_size=8,
                        num_workers=0)  # fmt: skip
    one.setup("fit")
    said = (r"^the validation slice held out of the training data is empty: data.val_fraction 0.1 of its 20 samples "
            r"\(drawn with data.split_seed 0\) picked none; give validation data of its own \(data.val_urls for "
            r"data=wds\) or a larger data.val_fraction$")  # fmt: skip
    with pytest.raises(UserError, match=said):
        list(one.val_set.place(0, 0, 1, 8))
    dm = WDSDataModule(urls=urls(wds_shards, "train"), num_classes=3, img_size=8, batch_size=8, num_workers=0)
    dm.setup("fit")
    train, val = dm.eval_view("train"), dm.eval_view("val")
    assert len(train) + len(val) == 72 and len(val) == len(list(val.place(0, 0, 1, 8))) > 0
    assert len(train) == len(list(train.place(0, 0, 1, 8)))


NAFLEX = {"naflex": {"seq_lens": [4, 9], "patch_size": 4, "batch_divisor": 2}}  # 12 px images: 3x3 patches at most


def lengths(loader):
    return [(x["patches"].shape[1], len(y)) for x, y in loader]


def test_naflex_streams_whole_batches_of_each_length_the_same_in_every_process_and_resumes_exactly(wds_shards):
    """Issue 65 point 2 on data=wds: variable sequence lengths a batch with timm's batch sizes (tokens a batch kept),
    padded with masks and their loss scale in the workers; every process the same lengths and batch count; a
    training stream resumed mid-epoch (two workers) yields exactly the batches an uninterrupted one does."""
    torch.manual_seed(0)
    dm = module(wds_shards, 0, 2, num_train=120, **NAFLEX)  # (two loader workers)
    per_process = {s: b // 2 for s, b in zip((4, 9), dm.size_schedule.batch_sizes, strict=True)}  # of the global
    batches = list(dm.train_dataloader())
    schedule = [(dm.size_schedule.seq_lens[pairs[0][1]], len(pairs)) for pairs in dm.train_set.schedule]
    assert lengths(batches) == schedule and len(dm.train_dataloader()) == len(schedule)  # in order, workers in turn
    assert {s for s, _ in schedule} == {4, 9} and all(b == per_process[s] for s, b in schedule)
    assert sum(b for _, b in schedule) <= 60  # (this process's share of the epoch's 120 samples)
    other = lengths(module(wds_shards, 1, 2, num_train=120, num_workers=0, **NAFLEX).train_dataloader())
    assert other == schedule  # the other process: the same lengths and batch count
    x, y = batches[0]
    assert x["patches"].dtype == torch.uint8 and x["patch_valid"].any(1).all() and x["patch_valid"].shape == x[
        "patch_coord"].shape[:2]  # fmt: skip
    torch.testing.assert_close(x["loss_scale"], torch.tensor(len(y) / (8 / 2)))  # linear: over data.batch_size's share

    def loader():
        torch.manual_seed(0)
        return module(wds_shards, num_train=120, epoch=1, **NAFLEX).train_dataloader()

    full = list(loader())
    interrupted = loader()
    it = iter(interrupted)
    for _ in range(3):
        next(it)
    state = interrupted.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(full) - 3 and all(
        torch.equal(a[0][k], b[0][k]) and torch.equal(a[1], b[1])
        for a, b in zip(rest, full[3:], strict=True)
        for k in a[0]
    )


def test_the_streamed_length_schedule_follows_the_epoch(wds_shards):
    """Issue 74, point 15: each epoch the loader workers' batches (two workers, each its copy of the schedule) are the
    lengths and batch sizes of the main process's schedule at that epoch, drawn there from a copy set to it; the
    schedules of epochs 0 and 1 differ (a worker whose schedule stayed at epoch 0 gives epoch 0's lengths again)."""
    import copy

    per_epoch = []
    for epoch in (0, 1):
        torch.manual_seed(0)
        dm = module(wds_shards, 0, 2, epoch=epoch, num_train=120, **NAFLEX)
        streamed = lengths(dm.train_dataloader())
        main = copy.deepcopy(dm.train_set.schedule)  # (the main process's, drawn apart from the workers' copies)
        main.set_epoch(epoch)
        expected = [(dm.size_schedule.seq_lens[pairs[0][1]], len(pairs)) for pairs in main]
        assert streamed == expected, epoch
        per_epoch.append(expected)
    assert per_epoch[0] != per_epoch[1]


def test_several_training_sizes_stream_too(wds_shards):
    """data.train_img_sizes on data=wds (it was left unread: every batch came at data.img_size): whole batches of each
    size, the same schedule as NaFlex's lengths."""
    torch.manual_seed(0)
    dm = module(wds_shards, 0, 2, num_workers=0, train_img_sizes=[8, 12], train_batch_sizes=[8, 4])
    seen = {tuple(x.shape[1:]): len(y) for x, y in dm.train_dataloader()}
    assert seen == {(3, 8, 8): 4, (3, 12, 12): 2}  # (per process: the global batch sizes over 2)
