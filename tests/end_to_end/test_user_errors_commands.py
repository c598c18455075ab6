"""Issue 34's catalog, the commands besides train, as a user types them: every command's keys typed and range-checked
before any work (predict, eval and its task groups, export, visualize, parity, pack), export's own refusal, pack on
a read-only or full disk and under Ctrl-C, and model overrides eval would have ignored. Each ends in its exit code
and one line naming the value and what is allowed, and leaves nothing behind: no run directory, no partial file,
no temporary folder."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers.commands import assert_refused, ctrl_c_as_in_a_terminal, run_cli, tmpfs
from tests.helpers.images import image_tree
from tests.helpers.runs import digits_checkpoint, earlier_run


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return digits_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def png(tmp_path_factory) -> Path:
    """An image predict can read: the refusals below are of other values (predict checks its images first)."""
    path = tmp_path_factory.mktemp("image") / "a.png"
    Image.new("L", (8, 8)).save(path)
    return path


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """An image folder of 2 classes, 1,000 images each in train/ and val/: packing it takes a few seconds."""
    return image_tree(tmp_path_factory.mktemp("photos") / "photos", per_class=1000, size=(64, 64))


# case -> (command, its arguments after ckpt_path=<a digits checkpoint>, the start of the one line after "error: ")
CASES = {
    # non-train commands' keys: typed and range-checked before a checkpoint is read
    "predict top_k not a number": ("predict", ["images=[a.png]", "top_k=abc"], "top_k 'abc' must be an integer >= 1"),
    "predict top_k beyond the classes": (
        "predict",
        ["images=[a.png]", "top_k=50"],
        "top_k 50 is more than the model's 10 classes: give top_k up to 10",
    ),
    "predict on no device": (
        "predict",
        ["images=[a.png]", "device=tpu"],
        "device 'tpu' is not one of cpu, cuda, cuda:",
    ),
    "eval knn.k zero": ("eval", ["task=knn", "knn.k=[0]"], "knn.k [0] must be a non-empty list of integers >= 1"),
    "eval knn.k negative": ("eval", ["task=knn", "knn.k=[-1]"], "knn.k [-1] must be a non-empty list of integers"),
    "eval knn.k not a list": ("eval", ["task=knn", "knn.k=abc"], "knn.k 'abc' must be a non-empty list of integers"),
    "eval knn.k beyond the bank": (
        "eval",
        ["task=knn", "knn.k=[10,5000]"],
        "knn.k [10, 5000] asks for more neighbours than the 1257 training images the k-NN votes among: give values "
        "up to 1257 (knn.k=[10])",
    ),
    "eval fewshot shots beyond a class": (
        "eval",
        ["task=fewshot", "fewshot.shots=[5,500]"],
        "fewshot.shots [5, 500] asks for more training images per class than class ",
    ),
    "eval linear lrs empty": ("eval", ["task=linear", "linear.lrs=[]"], "linear.lrs [] must be a non-empty list"),
    "eval fewshot shots zero": ("eval", ["task=fewshot", "fewshot.shots=[0]"], "fewshot.shots [0] must be a non-"),
    "eval task unknown": ("eval", ["task=knnn"], "task 'knnn' must be one of 'test', 'knn', 'linear', 'fewshot'"),
    "eval data.batch_size zero": ("eval", ["data.batch_size=0"], "data.batch_size 0 must be an integer >= 1 or null"),
    "export atol negative": ("export", ["atol=-1"], "atol -1 must be a number >= 0"),
    "visualize num_images zero": ("visualize", ["num_images=0"], "num_images 0 must be an integer >= 1"),
    "parity batch_size not a number": ("parity", ["batch_size=two"], "batch_size 'two' must be an integer >= 1"),
    "pack workers zero": ("pack", ["data=fake", "out=shards", "workers=0"], "workers 0 must be an integer >= 1 or"),
    "pack chunk_bytes not a size": (
        "pack",
        ["data=fake", "out=shards", "chunk_bytes=abc"],
        "chunk_bytes 'abc' must be a size such as 64MB (a number and one of b, kb, mb, gb, tb) or an integer >= 1",
    ),
    # overrides that would be silently ignored
    "eval model beside a checkpoint": (
        "eval",
        ["model=vit_ti16", "task=knn"],
        "model=vit_ti16: the model of ckpt_path '{ckpt}' is the one its checkpoint stores, and model overrides would "
        "be ignored; drop them",
    ),
    # a config group the command does not read, with or without + (issue 53), also in a -m search
    "eval +optim": (
        "eval",
        ["+optim=sgd"],
        "+optim=sgd: vitlab.eval does not read the optim group (the groups it "
        "reads: ['data', 'model', 'paths', 'trainer'])",
    ),  # fmt: skip
    "eval optim": ("eval", ["optim=sgd"], "optim=sgd: vitlab.eval does not read the optim group"),
    "eval -m +hparams_search": (
        "eval",
        ["-m", "+hparams_search=digits_optuna"],
        "+hparams_search=digits_optuna: vitlab.eval does not read the hparams_search group",
    ),
    "predict model": ("predict", ["images=[a.png]", "model=vit_s16"], "model=vit_s16: vitlab.predict does not read"),
    # export's own refusal
    "export over atol": ("export", ["atol=1e-9", "output=strict.onnx"], "the exported program differs from the model"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_value_of_any_command_is_one_line_and_leaves_nothing(ckpt, png, tmp_path, case):
    before = earlier_run(tmp_path)
    command, args, said = CASES[case]
    args = [a.replace("images=[a.png]", f"images=[{png}]") for a in args]
    given = [f"ckpt_path={ckpt}"] if command not in ("parity", "pack") else []
    r = run_cli(command, *given, *args, cwd=tmp_path)
    assert_refused(r, "error: " + said.format(ckpt=ckpt), before, tmp_path / "outputs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]  # no strict.onnx, no shards, no temporary


@pytest.mark.parametrize("fmt, name, kind", [("onnx", "model.onnx", "file"), ("timm", "timm", "folder")])
def test_export_onto_a_full_disk_says_what_to_do(ckpt, tmp_path, fmt, name, kind):
    with tmpfs(tmp_path / "disk", "size=200k") as disk:
        r = run_cli("export", f"ckpt_path={ckpt}", f"format={fmt}", f"output={disk / name}", cwd=tmp_path)
        assert_refused(
            r,
            f"error: cannot write {fmt} export {disk / name} (No space left on device); no {name} was "
            f"written, and no partial file is left; free space, or export elsewhere with output=<{kind}>",
            {},
            tmp_path / "outputs",
        )
        assert list(disk.iterdir()) == []


def test_a_push_without_network_is_one_line_that_names_the_kept_folder(ckpt, tmp_path):
    """issue 74, point 7, as typed: `export ... format=timm push_to_hub=me/x` with a token where nothing answers was
    httpx's 87-line traceback: exit 2, one line naming the folder, which is kept in its run directory (a result: the
    run directory stays with it). (tests/convert/test_publish.py: httpx's and requests' errors from the upload.)"""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{free.getsockname()[1]}"
    env = {"HF_TOKEN": "hf_stand_in_token", "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0"}
    r = run_cli("export", f"ckpt_path={ckpt}", "format=timm", "push_to_hub=me/x", cwd=tmp_path, env=env)
    assert_refused(r, f"error: push_to_hub=me/x failed: the Hub ({endpoint}) cannot be reached")
    (folder,) = tmp_path.glob("outputs/export/runs/*/timm")
    assert f"the folder is in {folder}: upload it once online with `hf upload me/x {folder}`" in r.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_pack_refuses_an_existing_out_before_reading_the_data(tmp_path):
    image_tree(tmp_path / "photos")
    (tmp_path / "photos" / "train" / "a" / "0.png").write_bytes(b"not an image")  # reading the data would say so
    (tmp_path / "shards").mkdir()
    r = run_cli("pack", "data.data_dir=photos", "out=shards", cwd=tmp_path)
    message = f"error: out '{tmp_path / 'shards'}' already exists; give a new folder, or overwrite=true to replace it"
    assert_refused(r, message, {}, tmp_path / "outputs")


def test_pack_names_the_class_folders_it_did_not_find(tmp_path):
    """A folder of loose images (no class folders), and a val/ whose classes are not train's: the folders are
    named, not a class count (issue 41)."""
    (tmp_path / "loose" / "train").mkdir(parents=True)
    (tmp_path / "loose" / "train" / "x.png").write_bytes(b"")
    r = run_cli("pack", "data.data_dir=loose", "out=shards", cwd=tmp_path)
    said = "error: loose/train holds no class folders (expected loose/train/<class>/<image>; images without classes"
    assert_refused(r, said, {}, tmp_path / "outputs")
    image_tree(tmp_path / "photos", classes=("ant", "bee"), splits=("train",))
    image_tree(tmp_path / "photos", classes=("ant", "cow"), splits=("val",))
    r = run_cli("pack", "data.data_dir=photos", "out=shards", cwd=tmp_path)
    said = "error: class folders of photos/val differ from those of photos/train (missing bee; not in train: cow)"
    assert_refused(r, said, {}, tmp_path / "outputs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loose", "photos"]  # no shards, no run directory


def test_pack_onto_a_read_only_file_system(photos, tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        r = run_cli("pack", f"data.data_dir={photos}", f"out={ro / 'shards'}", cwd=tmp_path)
        message = f"error: out '{ro / 'shards'}' cannot be written (Read-only file system); choose another out=<folder>"
        assert_refused(r, message, {}, tmp_path / "outputs")


def test_pack_onto_a_full_disk(photos, tmp_path):
    with tmpfs(tmp_path / "disk", "size=300k") as disk:
        r = run_cli("pack", f"data.data_dir={photos}", f"out={disk / 'shards'}", "workers=2", cwd=tmp_path)
        message = (
            f"error: cannot write the shards of {disk / 'shards'} (No space left on device); the partial shards were "
            "removed; free space, or pack elsewhere with out=<folder>"
        )
        assert_refused(r, message, {}, tmp_path / "outputs")
        assert list(disk.iterdir()) == []


def test_ctrl_c_mid_pack_is_one_line_and_exit_130(photos, tmp_path):
    """Ctrl-C in a terminal: SIGINT to the command's process group (its loader workers too), once it is packing."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    argv = [sys.executable, "-m", "vitlab.pack", f"data.data_dir={photos}", "out=shards", "workers=2"]
    p = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=ctrl_c_as_in_a_terminal)  # fmt: skip
    for line in p.stdout:
        if "packing train" in line:
            break
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert err.strip().splitlines() == [
        f"error: pack stopped by Ctrl-C (SIGINT): the partial shards were removed; nothing was written to "
        f"{tmp_path / 'shards'}"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no shards, no temporary folder, no run directory


# A file that is not a checkpoint at all (issue 41): empty, or text. torch's reader fails deep inside on both (an
# IndexError, a KeyError of the first byte); the README promises one line.
NOT_CHECKPOINTS = {"empty": b"", "text": b"hello, this is not a checkpoint\n"}


@pytest.mark.parametrize(
    "command, kind",
    [("eval", "empty"), ("eval", "text"), ("predict", "text"), ("export", "empty"), ("visualize", "text"),
     ("train", "empty"), ("train", "text")],
)  # fmt: skip
def test_a_file_that_is_not_a_checkpoint_is_one_line_and_leaves_nothing(png, tmp_path, command, kind):
    before = earlier_run(tmp_path)
    bad = tmp_path / f"{kind}.ckpt"
    bad.write_bytes(NOT_CHECKPOINTS[kind])
    key = "model.pretrained" if command == "train" else "ckpt_path"
    label = "weights file" if command == "train" else "ckpt_path"
    args = {"predict": [f"images=[{png}]"], "train": ["trainer.max_epochs=1"]}.get(command, [])
    r = run_cli(command, f"{key}={bad}", *args, cwd=tmp_path)
    said = "is empty (0 bytes): not a " if kind == "empty" else "is not a "
    assert_refused(r, f"error: {label} '{bad}' {said}", before, tmp_path / "outputs")
