"""A way back to timm (convert/timm_dir.py, `vitlab.export format=timm`): the folder timm's `local-dir:` reads gives
our logits in timm's own VisionTransformer, for each kind of architecture and for checkpoints of every objective."""

import json
import os

import lightning as L
import pytest
import timm
import torch
from omegaconf import OmegaConf

import vitlab
from tests.helpers.configs import tiny
from vitlab.convert.timm_dir import save_timm_dir
from vitlab.model import ViT
from vitlab.training.module import ViTModule
from vitlab.utils.errors import UserError

KINDS = {
    "class_token": {},
    "distilled": dict(distilled=True),
    "registers_avg": dict(reg_tokens=2, global_pool="avg"),
    "parallel_scaling": dict(block_fn="parallel_scaling", qk_norm=True, init_values=1e-5),
    "map_swiglu": dict(global_pool="map", class_token=False, mlp_layer="swiglu", act_layer="silu"),
    "non_square_sincos2d": dict(img_size=[32, 24], patch_size=[8, 4], pos_embed="sincos2d", dynamic_img_size=True),
    "norm_eps_1e-5_headless": dict(norm_eps=1e-5, num_classes=0),
}


@pytest.mark.parametrize("kind", KINDS)
def test_timm_reads_the_folder_as_our_model(kind, tmp_path):
    torch.manual_seed(0)
    model = ViT(tiny(**KINDS[kind])).eval()
    report = save_timm_dir(model, tmp_path / "m", label_names=[f"c{i}" for i in range(model.num_classes)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # nothing else left beside it
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architecture"] == report["architecture"] and config["num_classes"] == model.num_classes
    theirs = timm.create_model(f"local-dir:{tmp_path / 'm'}", pretrained=True).eval()
    assert type(theirs).__module__.startswith("timm.") and theirs.num_classes == model.num_classes
    x = torch.randn(3, 3, *model.cfg.img_hw)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), model(x), atol=1e-5, rtol=0)
    assert theirs.pretrained_cfg.get("label_names", []) == [f"c{i}" for i in range(model.num_classes)]
    back = vitlab.create_model(f"local-dir:{tmp_path / 'm'}", pretrained=True)  # and back to ours, interchangeably
    assert isinstance(back, ViT)
    torch.testing.assert_close(back.state_dict(), model.state_dict(), atol=0, rtol=0)


def test_a_folder_timm_would_not_read_back_is_refused(tmp_path):
    model = ViT(tiny())
    with pytest.raises(UserError, match="refused, nothing written"):
        save_timm_dir(model, tmp_path / "m", atol=-1.0)  # no difference passes a negative tolerance
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "m").mkdir()
    with pytest.raises(UserError, match="exists; choose another output or set overwrite=true"):
        save_timm_dir(model, tmp_path / "m")


def test_the_folder_is_as_readable_as_any_new_file(tmp_path):
    """The folder and its files get the permissions the umask gives a checkpoint, not tempfile's 0700 folder and
    safetensors' 0600 file (issue 53, point 13); an existing folder is replaced whole with overwrite."""
    model = ViT(tiny())
    for umask, modes in {0o022: (0o755, 0o644), 0o027: (0o750, 0o640)}.items():
        old = os.umask(umask)
        try:
            save_timm_dir(model, tmp_path / "m", overwrite=True)
        finally:
            os.umask(old)
        files = {f.name: f.stat().st_mode & 0o7777 for f in (tmp_path / "m").iterdir()}
        assert ((tmp_path / "m").stat().st_mode & 0o7777, files) == (modes[0], dict.fromkeys(files, modes[1]))
        assert sorted(files) == ["config.json", "model.safetensors"] and [p.name for p in tmp_path.iterdir()] == ["m"]


OBJECTIVES = {
    "classify": (dict(), {"name": "classify"}),
    "distill": (dict(distilled=True), {"name": "distill", "teacher": "test_vit", "teacher_pretrained": False}),
    "mae": (dict(num_classes=0), {"name": "mae", "decoder_embed_dim": 16, "decoder_depth": 1, "decoder_num_heads": 2}),
}


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_export_format_timm_for_every_objective(objective, compose_cfg, tmp_path):
    """`vitlab.export format=timm` of a checkpoint: timm's model of the folder gives the checkpoint's logits (an MAE
    pretraining checkpoint: its encoder's features), with the data's mean and std and the class names."""
    from vitlab import export
    from vitlab.training.run import inference

    train = compose_cfg("train", [])  # digits: 8x8 grayscale, 10 classes
    overrides, objective_cfg = OBJECTIVES[objective]
    cfg = tiny(**dict(dict(img_size=8, patch_size=2, in_chans=1, num_classes=10), **overrides))
    torch.manual_seed(0)
    data = OmegaConf.to_container(train.data, resolve=True)
    module = ViTModule(model=cfg, objective=objective_cfg, data=data, class_names=[str(i) for i in range(10)]).eval()
    ckpt = tmp_path / f"{objective}.ckpt"
    hp = json.loads(json.dumps(dict(module.hparams)))  # plain data, as a checkpoint holds it
    torch.save(
        {"state_dict": module.state_dict(), "hyper_parameters": hp, "pytorch-lightning_version": L.__version__}, ckpt
    )
    out = tmp_path / "timm_folder"
    report = export.export(compose_cfg("export", [f"ckpt_path={ckpt}", "format=timm", f"output={out}"]))
    assert report["max_abs_diff"] <= 1e-5 and report["format"] == "timm"
    theirs = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), module.model(x), atol=1e-5, rtol=0)
    assert theirs.num_classes == (0 if objective == "mae" else 10)
    config = json.loads((out / "config.json").read_text())["pretrained_cfg"]
    data = inference.inference_datamodule(module, str(ckpt))  # the preprocessing the checkpoint trained with
    assert config["mean"] == list(data.mean) != [0.5] and config["std"] == list(data.std) and len(data.std) == 1
    assert config.get("label_names") == [str(i) for i in range(10)]
