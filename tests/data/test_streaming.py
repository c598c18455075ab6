"""data=streaming over shards written by `python -m vitlab.pack` (data/pack.py, data/streaming.py): the same images
and labels as the folder they came from, the same training and evaluation, exact resume in 1 and 2 processes, a
DDP share-out that covers the split with equal steps, one-line refusals, and an object store (a local S3 server)."""

import json
import logging
import socket
from types import SimpleNamespace

import pytest

from tests.helpers.commands import run_cli
from tests.helpers.configs import SHARDS_RUN
from tests.helpers.images import image_tree
from tests.helpers.runs import assert_same_run
from vitlab.data.streaming import INFO, StreamingDataModule

RUN = SHARDS_RUN  # 3 classes x 24 images of 12 px in train, val and test: 9 steps of 8 an epoch
TWO = ["trainer=ddp_cpu", "trainer.devices=2"]


def _module(shards, rank=0, world=1, **settings) -> StreamingDataModule:
    dm = StreamingDataModule(data_dir=str(shards), num_classes=3, img_size=8, batch_size=8, **settings)
    epochs = SimpleNamespace(current=SimpleNamespace(processed=0))
    dm.trainer = SimpleNamespace(
        world_size=world, global_rank=rank, num_devices=world, fit_loop=SimpleNamespace(epoch_progress=epochs)
    )
    dm.trainer.strategy = SimpleNamespace(root_device=SimpleNamespace(type="cpu"))
    dm.setup("fit")
    return dm


def test_pack_keeps_every_split_s_files_labels_and_order(folder, shards):
    info = json.loads((shards / INFO).read_text())
    assert info["class_names"] == ["a", "b", "c"] and info["splits"] == {"train": 72, "val": 72, "test": 72}
    dm = _module(shards)
    for split, dataset in (("train", dm.train_set), ("val", dm.val_set), ("test", dm.test_set)):
        files = sorted((folder / split).glob("*/*.png"))  # ImageFolder's order: class folders, then names
        items = [dataset.base.shards[i] for i in range(len(files))]
        assert [bytes(item["image"]) for item in items] == [f.read_bytes() for f in files]  # the bytes as they were
        assert [item["label"] for item in items] == [["a", "b", "c"].index(f.parent.name) for f in files]
        assert [item["name"] for item in items] == [str(f.relative_to(folder)) for f in files]
    assert dm.class_names == ["a", "b", "c"]


def test_under_two_processes_the_shares_cover_the_split_with_equal_steps(shards):
    loaders = [_module(shards, rank=r, world=2, num_workers=0).train_dataloader() for r in (0, 1)]
    shares = [[i for _, i in loader.sampler] for loader in loaders]  # (seed, index) pairs
    assert sorted(shares[0] + shares[1]) == list(range(72))  # disjoint, every image of the split
    assert len(loaders[0]) == len(loaders[1]) == 36 // 4  # the same steps for each (4 an image batch of 8 / 2)


def test_training_on_the_shards_equals_training_on_the_folder_and_eval_too(folder, shards, shards_run, tmp_path):
    runs = {"folder": tmp_path / "folder", "shards": shards_run}
    r = run_cli("train", "data=imagefolder", f"data.data_dir={folder}", *RUN, f"hydra.run.dir={runs['folder']}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(runs["folder"], runs["shards"])
    evaluated = []
    # the same batches of 8 (the group's default is 256): a mean loss summed in other batches differs in its last bits
    for data in ([], ["data=streaming", f"data.data_dir={shards}", "data.batch_size=8"]):
        out = tmp_path / f"eval{len(evaluated)}"
        ckpt = runs["folder"] / "checkpoints" / "last.ckpt"
        r = run_cli("eval", f"ckpt_path={ckpt}", *data, "progress_bar=none", f"hydra.run.dir={out}")
        assert r.returncode == 0, r.stderr[-3000:]
        evaluated.append(json.loads((out / "metrics.json").read_text()))
    assert evaluated[0] == evaluated[1]


def test_pack_refuses_a_corrupt_image_in_one_line_and_leaves_nothing(folder, tmp_path):
    broken = image_tree(tmp_path / "broken", per_class=2)
    (broken / "train" / "b" / "bad.png").write_bytes((broken / "train" / "a" / "0.png").read_bytes()[:40])
    r = run_cli("pack", "data=imagefolder", f"data.data_dir={broken}", f"out={tmp_path / 'out'}", cwd=tmp_path)
    assert r.returncode == 2
    (line,) = [line for line in r.stderr.splitlines() if line.strip()]
    assert line.startswith(f"error: image file '{broken / 'train' / 'b' / 'bad.png'}' cannot be decoded"), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]  # no shards, no temporary folder, no run directory


def test_pack_replaces_an_existing_output_only_when_asked(shards, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("earlier")
    args = ["data=fake", "data.num_train=16", "data.num_val=8", "data.num_test=8", f"out={out}"]
    r = run_cli("pack", *args, cwd=tmp_path)
    assert (r.returncode, r.stderr.strip()) == (
        2,
        f"error: out '{out}' already exists; give a new folder, or overwrite=true to replace it",
    )
    assert (out / "keep").read_text() == "earlier"
    r = run_cli("pack", *args, "overwrite=true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((out / INFO).read_text())["splits"] == {"train": 16, "val": 8, "test": 8}  # PNGs of tensors
    assert not (out / "keep").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out", "outputs"]


def test_images_held_in_memory_pack_as_pngs(tmp_path):
    """Digits, uint8 arrays in memory as CIFAR's: each image a PNG in the shards, one channel."""
    r = run_cli("pack", "data=digits", f"out={tmp_path / 'out'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((tmp_path / "out" / INFO).read_text())
    assert info["channels"] == 1 and info["splits"] == {"train": 1257, "val": 270, "test": 270}


def test_a_folder_without_shards_is_one_line(folder, tmp_path):
    r = run_cli("train", "data=streaming", f"data.data_dir={folder}", cwd=tmp_path)
    assert (r.returncode, r.stderr.strip()) == (
        2,
        f"error: data.data_dir '{folder}' holds no shards written by python -m vitlab.pack",
    )


@pytest.fixture
def s3(shards):
    """A local S3 (moto's server) holding the shards under s3://data/shards; the AWS_* variables that reach it."""
    server_module = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
    except Exception as e:
        pytest.skip(f"a local S3 server could not start: {e}")
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], **{
        "aws_access_key_id": "test", "aws_secret_access_key": "test", "region_name": "us-east-1"})  # fmt: skip
    client.create_bucket(Bucket="data")
    for path in shards.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), "data", f"shards/{path.relative_to(shards)}")
    yield env
    server.stop()


def test_training_from_an_object_store_equals_training_from_the_folder(shards_run, s3, tmp_path):
    local, remote = shards_run, tmp_path / "remote"
    cache = tmp_path / "cache"
    args = ["data=streaming", "data.data_dir=s3://data/shards", f"data.cache_dir={cache}", *RUN]
    r = run_cli("train", *args, f"hydra.run.dir={remote}", env=s3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(local, remote)
    assert any(cache.rglob("index.json"))  # read through LitData's cache
    r = run_cli("train", "data=streaming", "data.data_dir=s3://data/elsewhere", cwd=tmp_path, env=s3)
    assert r.returncode == 2 and r.stderr.startswith("error: cannot read s3://data/elsewhere/vitlab-shards.json")
