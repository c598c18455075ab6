"""The one door for weights (convert/source.py, issue 52 point 2): every kind of source resolves to one `Weights` value,
its architecture, preprocessing, origin and tensors, with nothing downloaded (timm's download replaced by random
weights) and nothing read before the tensors are asked for."""

import pytest
import torch

import vitlab.convert.source as source
from tests.helpers.configs import tiny
from vitlab.convert.source import resolve
from vitlab.model import ViT

NAME = "vit_tiny_patch16_224.augreg_in21k"


def test_a_timm_name_gives_its_architecture_at_the_runs_fields_and_its_preprocessing(monkeypatch):
    weights = resolve(NAME, run={"img_size": 32, "in_chans": 1, "num_classes": 0})
    assert not weights.is_file and weights.timm_name == "vit_tiny_patch16_224" and weights.posemb_rule == "timm"
    assert (weights.arch["embed_dim"], weights.arch["img_size"], weights.arch["in_chans"]) == (192, 32, 1)
    assert weights.preprocessing["tag"] == NAME and tuple(weights.preprocessing["mean"]) == (0.5, 0.5, 0.5)
    random = {"cls_token": torch.zeros(1, 1, 192)}
    monkeypatch.setattr(source, "timm_pretrained_state_dict", lambda name: random)  # read on first use, once
    assert weights.tensors == (random, {}, f"timm's weights of {NAME}") and weights.tensors is weights.tensors
    untagged = resolve("vit_tiny_patch16_224", run={"img_size": None})  # null: the size the weights were trained at
    assert untagged.preprocessing["tag"].startswith("vit_tiny_patch16_224.") and untagged.arch["img_size"] == [224, 224]
    assert resolve(NAME).arch is None  # no run: the model exists already (load_timm_weights)


def test_the_users_fields_are_kept_where_the_weights_serve_them(monkeypatch):
    weights = resolve(NAME, run={"img_size": 32}, requested={"global_pool": "avg", "depth": 12, "embed_dim": None})
    assert weights.kept == {"global_pool": "avg"} and weights.arch["global_pool"] == "avg"


def test_a_timm_folder_gives_its_saved_architecture_labels_and_weights(tmp_path):
    import timm
    from timm.models._hub import save_for_hf

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                              num_classes=3)  # fmt: skip
    save_for_hf(model, str(tmp_path / "m"), {"label_names": ["a", "b", "c"]}, safe_serialization=True,
                data_config={"crop_pct": 0.8, "mean": [0.1] * 3})  # fmt: skip
    weights = resolve(f"local-dir:{tmp_path / 'm'}", run={"img_size": None})
    assert weights.timm_name == "vit_tiny_patch16_224" and weights.label_names == ("a", "b", "c")
    assert (weights.arch["embed_dim"], weights.arch["depth"], weights.arch["img_size"]) == (32, 2, [32, 32])
    assert weights.preprocessing["crop_pct"] == 0.8 and list(weights.preprocessing["mean"]) == [0.1] * 3
    encoder, decoder, origin = weights.tensors
    assert origin == f"timm's weights of local-dir:{tmp_path / 'm'}" and not decoder
    assert all(torch.equal(encoder[k], v) for k, v in model.state_dict().items())


def test_a_hub_repository_offline_is_the_one_line_naming_a_local_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ConnectionError, match=r"give a local \.safetensors/\.pth file or a timm folder \(local-dir:"):
        resolve(f"hf-hub:timm/{NAME}")


def _files(tmp_path):
    """One file of each kind a weights file may be, with the origin each is named by."""
    torch.manual_seed(0)
    sd = ViT(tiny()).state_dict()
    mae = {**sd, "mask_token": torch.zeros(1, 1, 32), "decoder_embed.weight": torch.zeros(16, 32)}
    dino = {"teacher": {f"backbone.{k}": v for k, v in sd.items()}, "student": {}, "epoch": 1}
    dinov2 = {**sd, "mask_token": torch.zeros(1, 32)}
    made = {
        "plain.pth": (sd, "weights file"),
        "run.ckpt": ({"state_dict": {f"model.{k}": v for k, v in sd.items()}}, "vitlab checkpoint"),
        "mae.pth": ({"model": mae}, "MAE checkpoint"),
        "dino.pth": (dino, "DINO checkpoint"),
        "dinov2.pth": (dinov2, "DINOv2 weights"),
    }
    for name, (obj, _) in made.items():
        torch.save(obj, tmp_path / name)
    return sd, {str(tmp_path / name): kind for name, (_, kind) in made.items()}


def test_every_kind_of_weights_file_is_one_value_read_on_first_use(tmp_path):
    sd, files = _files(tmp_path)
    for path, kind in files.items():
        weights = resolve(path, run={"img_size": 32}, requested={"depth": 3})  # a file's architecture is the run's
        assert weights.is_file and (weights.arch, weights.preprocessing, weights.timm_name) == (None, None, None)
        encoder, decoder, origin = weights.tensors
        assert origin == f"{kind} {path!r}" and bool(decoder) == (kind == "MAE checkpoint"), path
        assert encoder.keys() == sd.keys() and all(torch.equal(encoder[k], v) for k, v in sd.items()), path
        model = ViT(tiny())
        weights.load_into(model)
        assert torch.equal(model.blocks[1].mlp.fc2.weight, sd["blocks.1.mlp.fc2.weight"])
    missing = resolve(str(tmp_path / "gone.pth"))  # named, not read: the error comes where the tensors are loaded
    with pytest.raises(FileNotFoundError, match="does not exist"):
        missing.load_into(ViT(tiny()))


def test_a_sharded_vitlab_checkpoint_is_read_whole(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    sd = ViT(tiny()).state_dict()
    folder = tmp_path / "last.ckpt"
    dcp.save({"state_dict": {f"model.{k}": v for k, v in sd.items()}}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"epoch": 1, "hyper_parameters": {"model": {}}}, folder / "meta.pt")
    encoder, _, origin = resolve(str(folder)).tensors
    assert origin == f"vitlab checkpoint {str(folder)!r}"
    assert all(torch.equal(encoder[k], v) for k, v in sd.items())


def test_a_files_position_table_rule_is_the_one_its_code_used_and_the_run_takes_it(tmp_path, compose_cfg):
    """Issue 54, point 2: DINOv2's hub weights without registers and DINO's training checkpoints were made (and are
    evaluated by their code) with interpolate_pos_encoding's rule; DINOv2's register models and everything else with
    timm's; a vitlab checkpoint carries its own. model.pretrained=<such a file> makes the run's model take it."""
    from vitlab.cli.plans import train_plan

    backbone = ViT(tiny(embed_dim=16, num_heads=2, depth=1)).state_dict()
    dinov2 = dict(backbone) | {"mask_token": torch.zeros(1, 16)}
    files = {
        "dinov2.pth": (dinov2, "dino"),
        "dinov2_reg4.pth": (dinov2 | {"register_tokens": torch.zeros(1, 4, 16)}, "timm"),
        "dino_full_checkpoint.pth": (
            {"teacher": {f"backbone.{k}": v for k, v in backbone.items()}, "student": {}},
            "dino",
        ),  # fmt: skip
        # timm's names alone: DINO's released file name says it is DINO's (issue 64 point 19), another name does not
        "dino_deitsmall16_pretrain.pth": (backbone, "dino"),
        "dino_vitbase8_pretrain.pth": (backbone, "dino"),
        "my_backbone.pth": (backbone, "timm"),
        "vitlab.ckpt": (
            {
                "state_dict": {f"model.{k}": v for k, v in backbone.items()},
                "hyper_parameters": {"model": {"pos_embed_resample": "dino"}},
            },
            "dino",
        ),  # fmt: skip
    }
    for name, (content, rule) in files.items():
        torch.save(content, tmp_path / name)
        assert resolve(str(tmp_path / name)).posemb_rule == rule, name
    cfg = compose_cfg("train", [f"model.pretrained={tmp_path / 'dinov2.pth'}"])
    assert cfg.model.pos_embed_resample == "timm"
    assert train_plan(cfg).model.pos_embed_resample == "dino"


def test_the_load_line_names_the_resampling_rule_and_the_other(tmp_path, caplog):
    """Issue 64 point 19: a position table resampled to another grid says by which rule, and how to choose the other
    (model.pos_embed_resample=dino for DINO's and DINOv2's weights)."""
    import logging

    torch.save(ViT(tiny(embed_dim=16, num_heads=2, depth=1)).state_dict(), tmp_path / "backbone.pth")
    model = ViT(tiny(embed_dim=16, num_heads=2, depth=1, img_size=16))
    with caplog.at_level(logging.INFO, logger="vitlab.convert.weights"):
        resolve(str(tmp_path / "backbone.pth")).load_into(model)
    assert (
        "its position table of 16 patches resampled to the 2x2 grid by timm's rule (model.pos_embed_resample=timm;"
        " the other: model.pos_embed_resample=dino" in caplog.text
    )
