"""Issue 74's tracebacks where a user needs one line (points 5, 6, 8, 11), each through the command as typed: one line,
nothing left behind, and where the refusal needs no data, before torch, Lightning and timm are imported."""

import pytest

from tests.helpers.commands import refused_without_torch

GROUP = "objective.mixup is a group of keys ['mixup_alpha', 'cutmix_alpha', 'cutmix_minmax', 'prob', 'switch_prob', "


@pytest.mark.parametrize(
    "args, said",
    [
        (["objective.mixup=0.8"], f"objective.mixup=0.8: {GROUP}"),  # was TypeError: 'float' object is not iterable
        (["experiment=naflex_photos", "data.data_dir=.", "objective.mixup=0.8"], f"objective.mixup=0.8: {GROUP}"),
        (["-m", "objective.mixup=0.8,0.5"], f"objective.mixup=0.8: {GROUP}"),  # a sweep: its first job's values
        (["objective.mixup=[1,2]"], f"objective.mixup=[1,2]: {GROUP}"),
        (["optim.lr={a:1}"], "optim.lr={a:1}: optim.lr takes a single value (its default: 0.001), not a group of keys"),
    ],
)
def test_a_group_given_a_value_or_a_value_given_a_group_is_one_line(tmp_path, args, said):
    """Point 5: a scalar for a group key (and a group for a scalar key), with NaFlex and without: one line naming the
    key and its form, before the run directory is made."""
    refused_without_torch(tmp_path, ["train", *args], f"error: {said}")


@pytest.mark.parametrize(
    "text, said",
    [
        (
            "trainer:\n  max_epochs: [1, 2\n",
            "line 4, column 1: expected ',' or ']', but got '<stream end>' (while "
            "parsing a flow sequence begun at line 3, column 15)",
        ),  # fmt: skip
        ("trainer:\n\tmax_epochs: 1\n", "line 3, column 1: a tab, which YAML does not take"),
    ],
)
def test_a_yaml_error_in_a_users_config_dir_names_the_file_line_and_column(tmp_path, text, said):
    """Point 6: an unclosed [ or a tab in a file of --config-dir was PyYAML's 110-line traceback."""
    (tmp_path / "mine" / "experiment").mkdir(parents=True)
    (tmp_path / "mine" / "experiment" / "bad.yaml").write_text("# @package _global_\n" + text)
    file = tmp_path / "mine" / "experiment" / "bad.yaml"
    refused_without_torch(tmp_path, ["train", "--config-dir", "mine", "experiment=bad"], f"error: {file}, {said}")


def test_a_logger_whose_package_is_not_installed_is_one_line(tmp_path):
    """Point 8: logger=mlflow (docs/training/your-configs.md's file) without mlflow was Hydra's 5-line report of
    Lightning's ModuleNotFoundError, after the run directory was made."""
    import importlib.util

    if importlib.util.find_spec("mlflow") is not None:
        pytest.skip("mlflow is installed here")
    (tmp_path / "mine" / "logger").mkdir(parents=True)
    (tmp_path / "mine" / "logger" / "mlflow.yaml").write_text(
        "mlflow:\n  _target_: lightning.pytorch.loggers.MLFlowLogger\n  experiment_name: vitlab\n"
    )
    said = (
        "error: logger.mlflow: lightning.pytorch.loggers.MLFlowLogger needs the mlflow package, which is not installed"
    )
    refused_without_torch(tmp_path, ["train", "--config-dir", "mine", "logger=mlflow"], said)


# Point 11: refusals that need no data took 6-10 s (torch and Lightning imported first); now before either.
FAST = [
    (
        ["train", "trainer.precision=float8"],
        "error: trainer.precision=float8 needs CUDA GPUs of compute capability 8.9",
    ),
    (["train", "data.folds=1"], "error: data.folds 1 must be 0 (no k-fold) or a number of folds >= 2"),
    (["train", "data.fold=7"], "error: data.fold 7 needs data.folds=K (the number of folds); data.folds is 0"),
    (["train", "data.folds=3", "data.fold=3"], "error: data.fold 3 is not a fold of data.folds 3: give one of 0..2"),
    (["predict", "ckpt_path=a.ckpt", "images=[a.png,nope.png]"], "error: image file 'nope.png' does not exist"),
    (["vitlab", "train", "--config-dir"], "error: --config-dir needs a folder: --config-dir <dir>"),  # (was "train.py")
    (["train", "--config-dir"], "error: --config-dir needs a folder: --config-dir <dir>"),
    (
        ["train", "model=eva02_ti14", "model.rope_ref_feat_shape=[16]"],
        "error: rope_ref_feat_shape (16,) must be a grid of positive sizes: an int n or [height, width]",
    ),  # (was refused as the model was built, 10 s; its line said "needs rope 'axial' (got rope 'axial')")
    (
        ["train", "model=vit_b16_rope_mixed", "model.rope_ref_feat_shape=16"],
        "error: rope_ref_feat_shape 16 is the grid axial RoPE's positions are rescaled to: it needs rope 'axial' (got "
        "rope 'mixed')",
    ),
]


@pytest.mark.parametrize("args, said", FAST, ids=[" ".join(a) for a, _ in FAST])
def test_a_refusal_that_needs_no_data_comes_before_torch_lightning_or_timm(tmp_path, args, said):
    from vitlab.utils.cuda import no_cuda_here

    if "trainer.precision=float8" in args and not no_cuda_here():
        pytest.skip("a machine with a GPU's device files asks torch for their compute capability")
    (tmp_path / "a.ckpt").write_bytes(b"PK")
    (tmp_path / "a.png").write_bytes(b"\x89PNG")
    refused_without_torch(tmp_path, args, said)
