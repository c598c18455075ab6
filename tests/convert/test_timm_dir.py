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


# A model file of each class of timm's that builds our ViT (convert/timm_dir.FAMILIES): the RoPE files are timm's Eva,
# the NaFlex file its NaFlexVit, the plain ViT its VisionTransformer
FAMILIES = {"eva02_ti14": "Eva", "vit_s16_dinov3": "Eva", "vit_b16_rope_mixed": "Eva", "naflexvit_b16": "NaFlexVit",
            "vit_ti16": "VisionTransformer"}  # fmt: skip


@pytest.mark.parametrize("name", FAMILIES)
def test_export_format_timm_for_every_family(name, compose_cfg, tmp_path):
    """issue 74, point 3: `vitlab.export format=timm` of a checkpoint of each family (the zoo file shrunk to depth 2, 32
    wide, on 8 px digits) is a folder timm's create_model builds as its own class with the checkpoint's logits, on
    images and (NaFlex) on NaFlex's patch dict, and that vitlab.create_model reads back weight for weight. Every
    weight is moved off its init (LayerScale's 1e-5, the head's 0.001 scale, RoPE-Mixed's learned frequencies): an
    argument the folder got wrong shows in the logits."""
    from timm.data.naflex_transforms import patchify_image

    from vitlab import export
    from vitlab.model.config import vit_config

    swiglu = ["model.mlp_hidden_dim=170"] if name.startswith("eva02") else []  # 2 x int(32 x 8/3): timm's packed fc1
    small = [f"model={name}", "model.depth=2", "model.embed_dim=32", "model.num_heads=2", "model.img_size=8",
             "model.patch_size=2", "model.in_chans=1", "model.num_classes=10", *swiglu]  # fmt: skip
    train = compose_cfg("train", small)  # digits: 8x8 grayscale, 10 classes
    torch.manual_seed(0)
    module = ViTModule(model=vit_config(train.model), data=OmegaConf.to_container(train.data, resolve=True),
                       class_names=[str(i) for i in range(10)]).eval()  # fmt: skip
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    ckpt = tmp_path / f"{name}.ckpt"
    hp = json.loads(json.dumps(dict(module.hparams)))
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hp, "pytorch-lightning_version": L.__version__},
               ckpt)  # fmt: skip
    out = tmp_path / "timm_folder"
    report = export.export(compose_cfg("export", [f"ckpt_path={ckpt}", "format=timm", f"output={out}"]))
    assert report["max_abs_diff"] <= 1e-5
    theirs = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert type(theirs).__name__ == FAMILIES[name] and type(theirs).__module__.startswith("timm.")
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        logits = module.model(x)
        assert logits.std() > 0.1  # (logits that differ from model to model)
        torch.testing.assert_close(theirs(x), logits, atol=1e-5, rtol=0)
        if FAMILIES[name] == "NaFlexVit":  # two images of other shapes, the smaller padded
            patches, coord, valid = torch.zeros(2, 12, 4), torch.zeros(2, 12, 2, dtype=torch.long), torch.zeros(2, 12)
            for i, img in enumerate([torch.randn(1, 6, 8), torch.randn(1, 4, 4)]):
                p, c, _ = patchify_image(img, (2, 2))
                patches[i, : len(p)], coord[i, : len(p)], valid[i, : len(p)] = p, c, 1
            batch = dict(patches=patches, patch_coord=coord, patch_valid=valid.bool())
            torch.testing.assert_close(theirs(batch), module.model(batch), atol=1e-5, rtol=0)
    back = vitlab.create_model(f"local-dir:{out}", pretrained=True).eval()  # and back to ours
    assert isinstance(back, ViT)
    torch.testing.assert_close(back.state_dict(), module.model.state_dict(), atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(back(x), logits, atol=0, rtol=0)


def test_a_naflex_model_timm_cannot_name_is_one_line_and_nothing_written(tmp_path):
    """NaFlexVit builds its norms from their names at timm's eps 1e-6: a NaFlex ViT at another eps cannot be written as
    config.json's arguments, said in one line before anything is written (not timm's load error of a folder)."""
    model = ViT(tiny(naflex=True, class_token=False, reg_tokens=1, global_pool="avg", norm_eps=1e-5))
    with pytest.raises(UserError, match="timm's NaFlexVit builds its norms by name, at eps 1e-06: .* norm_eps 1e-05"):
        save_timm_dir(model, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []
