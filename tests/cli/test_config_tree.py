"""The config tree (cli/config_tree.py): vitlab's conf/ found in one place, and a user's own tree beside it with
`--config-dir` (hydra_plugins/vitlab_user_configs.py), whose files compose over ours and take the place of ours of
the same name, said in one line."""

import pytest

from tests.helpers.commands import run_cli
from vitlab.cli.config_tree import config_dir, read_user_config_dir, shadowing_note, without_config_dir
from vitlab.utils.errors import MissingFileError

MY_MODEL = (
    "# my own: the digits ViT, narrower and shallower\ndefaults:\n  - vit_digits\n  - _self_\nembed_dim: 32\ndepth: 2\n"
)
MY_EXPERIMENT = """# @package _global_
defaults:
  - override /model: my_digits
tags: [mine]
trainer:
  max_epochs: 1
"""


@pytest.fixture
def user_tree(tmp_path):
    """A user's tree: an experiment and a model of their own, and a data file named as ours (digits)."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(MY_EXPERIMENT)
    (tmp_path / "model" / "my_digits.yaml").write_text(MY_MODEL)
    ours = (config_dir() / "data" / "digits.yaml").read_text()
    (tmp_path / "data" / "digits.yaml").write_text(ours.replace("batch_size: 64", "batch_size: 17"))
    assert "batch_size: 17" in (tmp_path / "data" / "digits.yaml").read_text()
    read_user_config_dir(["--config-dir", str(tmp_path)])
    yield tmp_path
    read_user_config_dir([])


def test_a_users_experiment_and_model_compose_over_ours(compose_cfg, user_tree):
    cfg = compose_cfg("train", ["experiment=mine"])
    assert (cfg.model.embed_dim, cfg.model.depth, cfg.model.img_size) == (32, 2, 8)  # theirs over our vit_digits
    assert (list(cfg.tags), cfg.trainer.max_epochs, cfg.optim.name) == (["mine"], 1, "adamw")
    assert compose_cfg("train", ["model=vit_s16"]).model.variant == "S/16"  # ours still there


def test_a_users_file_named_as_ours_takes_its_place_and_says_so(compose_cfg, user_tree):
    assert compose_cfg("train", []).data.batch_size == 17
    assert shadowing_note() == f"note: --config-dir {user_tree}: your data/digits.yaml takes the place of vitlab's"
    (user_tree / "model" / "vit_s16.yaml").write_text("defaults:\n  - _base\nimg_size: 8\n")
    assert shadowing_note() == (
        f"note: --config-dir {user_tree}: your data/digits.yaml, model/vit_s16.yaml take the place of vitlab's"
    )


def test_without_a_users_tree_ours_alone(compose_cfg):
    assert read_user_config_dir(["data.batch_size=3"]) is None and shadowing_note() is None
    assert compose_cfg("train", []).data.batch_size == 64


@pytest.mark.parametrize("form", [["--config-dir", "{}"], ["--config-dir={}"], ["-cd", "{}"]])
def test_the_forms_of_config_dir(tmp_path, form):
    argv = ["-m", *[a.format(tmp_path) for a in form], "seed=1"]
    try:
        assert read_user_config_dir(argv) == tmp_path.resolve()
        assert without_config_dir(argv) == ["-m", "seed=1"]
    finally:
        read_user_config_dir([])


def test_a_missing_config_dir_is_one_line(tmp_path):
    with pytest.raises(MissingFileError, match="--config-dir 'nowhere' is not a folder"):
        read_user_config_dir(["--config-dir", "nowhere"])
    r = run_cli("train", "--config-dir", "nowhere", "trainer.max_epochs=1", cwd=tmp_path)
    assert (r.returncode, r.stderr.strip().splitlines()) == (2, [
        "error: --config-dir 'nowhere' is not a folder; give the folder of your config files (experiment/, model/, "
        "data/, ... as in vitlab's conf/)"])  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_the_command_line_composes_a_users_tree(user_tree, tmp_path):
    """Through Hydra's own command line (--cfg job: the composed config, nothing run): the user's experiment, the
    data file that takes the place of ours, and the one line that says so."""
    read_user_config_dir([])  # (this process's; the command reads its own)
    r = run_cli("train", "--config-dir", str(user_tree), "experiment=mine", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"note: --config-dir {user_tree}: your data/digits.yaml takes the place of vitlab's"
    ]
    assert "embed_dim: 32" in r.stdout and "batch_size: 17" in r.stdout and "- mine" in r.stdout
