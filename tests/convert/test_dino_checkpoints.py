"""DINO's and DINOv2's released checkpoints load (convert/dino.py, convert.weights.read_weights), built here with their
key names and shapes (2 blocks to stay small), nothing downloaded:

- dino `dino_deitsmall16_pretrain.pth`: the teacher's backbone in timm's names;
- dino `dino_deitsmall16_full_checkpoint.pth` / main_dino.py's checkpoint.pth: student (`module.backbone.*`,
  `module.head.*`), teacher (`backbone.*`, `head.*`), optimizer, epoch, args (argparse.Namespace), dino_loss;
- dinov2 hub `dinov2_vits14_pretrain.pth` and `dinov2_vits14_reg4_pretrain.pth`: `mask_token`, `ls1.gamma`, a
  pos_embed with the class row, `register_tokens`: the same features as timm's model of those weights."""

import argparse
import logging

import pytest
import timm
import torch

from vitlab.convert.source import load_timm_weights
from vitlab.convert.timm_args import config_from_timm
from vitlab.convert.weights import read_weights
from vitlab.model import ViT, ViTConfig
from vitlab.model.dino_head import DINOHead


def vit_small(depth=2) -> ViTConfig:
    return ViTConfig.from_variant("S/16", depth=depth, num_classes=0)


def dino_head_sd(prefix: str) -> dict:
    return {f"{prefix}{k}": v for k, v in DINOHead(384, 64, hidden_dim=32, bottleneck_dim=16).state_dict().items()}


def test_dinos_pretrain_weights_are_its_teacher_in_timms_names(tmp_path):
    torch.manual_seed(0)
    backbone = ViT(vit_small()).state_dict()
    torch.save(backbone, tmp_path / "dino_deitsmall16_pretrain.pth")
    model = ViT(vit_small())
    load_timm_weights(model, str(tmp_path / "dino_deitsmall16_pretrain.pth"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in backbone.items())


def test_a_dino_training_checkpoint_gives_the_teachers_backbone(tmp_path, caplog):
    torch.manual_seed(1)
    teacher, student = ViT(vit_small()).state_dict(), ViT(vit_small()).state_dict()
    args = argparse.Namespace(arch="vit_small", patch_size=16, out_dim=65536, norm_last_layer=False, epochs=800,
                              teacher_temp=0.07, warmup_teacher_temp_epochs=30, data_path="/train")  # fmt: skip
    ckpt = {
        "student": {f"module.backbone.{k}": v for k, v in student.items()} | dino_head_sd("module.head."),
        "teacher": {f"backbone.{k}": v for k, v in teacher.items()} | dino_head_sd("head."),
        "optimizer": torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]).state_dict(),
        "epoch": 800,
        "args": args,
        "dino_loss": {"center": torch.zeros(1, 64)},
    }
    path = tmp_path / "dino_deitsmall16_full_checkpoint.pth"
    torch.save(ckpt, path)
    with caplog.at_level(logging.INFO, "vitlab"):
        sd, decoder, kind = read_weights(path)
    assert kind == "DINO checkpoint" and not decoder
    assert sd.keys() == teacher.keys() and all(torch.equal(sd[k], v) for k, v in teacher.items())
    assert "took the teacher's backbone; left out the student, the teacher's head.*" in caplog.text
    model = ViT(vit_small(depth=2).replace(num_classes=10))  # fine-tuning: a new head
    load_timm_weights(model, str(path))
    assert torch.equal(model.blocks[1].mlp.fc2.weight, teacher["blocks.1.mlp.fc2.weight"])


@pytest.mark.parametrize("name", ["vit_small_patch14_dinov2", "vit_small_patch14_reg4_dinov2"])
def test_dinov2_hub_weights_give_timms_features(tmp_path, name):
    torch.manual_seed(2)
    kwargs = {"depth": 2, "img_size": 56, "num_classes": 0}
    ref = timm.create_model(name, pretrained=False, **kwargs).eval()
    for p in ref.parameters():  # LayerScale and tokens away from their init
        p.data.add_(torch.randn_like(p) * 0.02)
    sd = ref.state_dict()
    hub = {k.replace("reg_token", "register_tokens"): v.clone() for k, v in sd.items()}
    hub["mask_token"] = torch.zeros(1, 384)
    if "register_tokens" in hub:  # dinov2 adds pos_embed's class row to the class token: timm folds it in
        row = torch.randn(1, 1, 384) * 0.02
        hub["pos_embed"] = torch.cat([row, sd["pos_embed"]], 1)
        hub["cls_token"] = sd["cls_token"] - row
    torch.save(hub, tmp_path / "hub.pth")
    sd_ours, _, kind = read_weights(tmp_path / "hub.pth")
    assert kind == "DINOv2 weights" and "mask_token" not in sd_ours
    model = ViT(config_from_timm(name, **kwargs)).eval()
    load_timm_weights(model, str(tmp_path / "hub.pth"))
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)
