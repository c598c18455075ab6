"""data=wds and data=hf data.streaming=true, the longer runs: a streamed run interrupted mid-epoch resumes exactly,
in one process and in two (DDP on the CPU), NaFlex's too, on the `folder` fixture's images (tests/conftest.py)."""

import pytest

from tests.data.test_streaming import RUN, TWO  # 9 steps of 8 an epoch on the `folder` fixture's 72 training images
from tests.helpers.commands import run_cli
from tests.helpers.runs import assert_resumes_exactly


def _wds(shards):
    return ["data=wds", f'data.urls="{shards}/train-{{000000..000003}}.tar"',
            f'data.val_urls="{shards}/val-{{000000..000003}}.tar"', "data.shuffle_buffer=16"]  # fmt: skip


@pytest.mark.parametrize("processes", [1, 2])
def test_a_run_on_webdataset_shards_interrupted_mid_epoch_resumes_exactly(wds_shards, tmp_path, processes):
    args = [*_wds(wds_shards), *RUN, *(TWO if processes == 2 else [])]
    assert_resumes_exactly(args, tmp_path, "SIGTERM", 12)


def test_a_streamed_hugging_face_run_in_two_processes_interrupted_mid_epoch_resumes_exactly(records, tmp_path):
    args = ["data=hf", f"data.name={records / 'saved'}", "data.streaming=true", "data.shuffle_buffer=16", *RUN, *TWO]
    assert_resumes_exactly(args, tmp_path, "SIGTERM", 12)


def test_a_naflex_run_on_webdataset_shards_interrupted_mid_epoch_resumes_exactly(wds_shards, tmp_path):
    """Issue 65 point 2 on a streamed reader: NaFlex's whole batches of two lengths, erased (pixel noise) on the
    device, stopped in its second epoch and resumed: the same run (data/streamed.py, data/naflex.py's Erasing)."""
    args = [*_wds(wds_shards), "model=naflexvit_b16", "model.depth=1", "model.embed_dim=32", "model.num_heads=2",
            "data.naflex.seq_lens=[4,9]", "data.naflex.batch_divisor=2", "data.num_train=96", "data.batch_size=8",
            "data.num_workers=2", "trainer.max_epochs=2", "progress_bar=none",
            "data.train_transform.random_erasing=0.5", "data.train_transform.erasing_mode=pixel"]  # fmt: skip
    r = assert_resumes_exactly(args, tmp_path, "SIGTERM", 9)
    assert "NaFlex: sequence lengths [4, 9] patches, global batch sizes [18, 8]" in r.stderr + r.stdout


SHORT = ["model.img_size=8", "data.batch_size=8", "data.num_workers=2", "trainer.max_epochs=1", "progress_bar=none"]
SMALL_DINO = ["objective=dino", "objective.crops.local_size=4", "objective.crops.local_crops=2",
              "objective.crops.blur_kernel=3", "objective.out_dim=64", "objective.hidden_dim=32",
              "objective.bottleneck_dim=16"]  # fmt: skip
OBJECTIVES = {
    "dino": [*SMALL_DINO, "model.num_classes=0", "model.dynamic_img_size=true"],
    "mae": ["objective=mae", "model.num_classes=0"],
}


def _reader(name, records, shards):
    return {
        "hf": ["data=hf", f"data.name={records / 'saved'}"],
        "list": ["data=list", *(f"data.{s}_file={records / f'{s}.csv'}" for s in ("train", "val", "test"))],
        "wds": _wds(shards),
    }[name]


@pytest.mark.parametrize(("reader", "objective"), [("hf", "dino"), ("wds", "dino"), ("list", "mae"), ("wds", "mae")])
def test_each_reader_trains_each_objective(records, wds_shards, folder, tmp_path, reader, objective):
    """Issue 55 point 4: every objective on every reader (DINO's views cut in the workers from each whole image, MAE
    on the classifier's crops; classify is the equivalence and resume tests' own). The checkpoints reused for issue 64's
    points 10 and 11: frozen-feature evaluations of a streamed split, predict refusing an encoder."""
    r = run_cli("train", *_reader(reader, records, wds_shards), *OBJECTIVES[objective], *SHORT,
                f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert "was not logged" not in (tmp_path / "train.log").read_text()  # its result: val/loss_best, not val/acc_best
    if objective == "dino":
        assert "cut from each whole decoded image in the loader's workers" in (tmp_path / "train.log").read_text()
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    if reader == "wds":  # issue 64 point 10: a streamed split's size is counted, not a TypeError traceback
        task = ["task=knn", "knn.k=[5]"] if objective == "mae" else ["task=fewshot", "fewshot.shots=[1]"]
        r = run_cli("eval", f"ckpt_path={ckpt}", *task, f"hydra.run.dir={tmp_path / 'eval'}")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "train split: 72 samples (counted: its shards read once, nothing decoded)" in r.stdout
    if reader == "hf":  # issue 64 point 11: an encoder has no classes to predict (an IndexError before)
        r = run_cli("predict", f"ckpt_path={ckpt}", f"images=[{folder / 'test' / 'a' / '0.png'}]", cwd=tmp_path)
        said = f"error: checkpoint '{ckpt}' is objective={objective} pretraining (an encoder without a classifier)"
        assert r.returncode == 2 and r.stderr.startswith(said) and len(r.stderr.splitlines()) == 1, r.stderr


def test_a_sharded_run_on_a_saved_dataset_and_its_evaluation_on_it(records, tmp_path):
    """FSDP2 in two processes on data=hf, then `vitlab.eval` of its checkpoint on the same dataset's test split."""
    hf = _reader("hf", records, None)
    r = run_cli("train", *hf, *SHORT, "trainer=fsdp_cpu", "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = next((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    r = run_cli("eval", f"ckpt_path={ckpt}", *hf, f"hydra.run.dir={tmp_path / 'eval'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "test/acc" in (tmp_path / "eval" / "metrics.json").read_text()
