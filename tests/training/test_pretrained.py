"""model.pretrained=<timm name> (vitlab.training.pretrained): timm's architecture fills only what the run left unset;
what the experiment or the command line sets is kept where the weights can serve it, and refused in one line where
they cannot. timm's pretrained configs are read offline; no weights are downloaded."""

import logging

import pytest
from omegaconf import OmegaConf

from vitlab.cli.plans import train_plan
from vitlab.utils.errors import UserError


def planned(cfg):
    """The run's config as its plan makes it (vitlab.cli.plans: model.pretrained resolved), as config.yaml has it."""
    return OmegaConf.create(train_plan(cfg).config)


def test_the_mae_fine_tune_recipe_composes_with_its_pretrained_name_to_avg_pooling_and_fc_norm(compose_cfg, caplog):
    cfg = compose_cfg("train", ["experiment=mae_finetune_b16_in1k"])
    assert cfg.model.pretrained == "vit_base_patch16_224.mae"
    with caplog.at_level(logging.INFO):
        cfg = planned(cfg)
    assert (cfg.model.global_pool, cfg.model.fc_norm, cfg.model.weight_init) == ("avg", True, "mae")
    assert (cfg.model.embed_dim, cfg.model.depth, cfg.model.drop_path_rate) == (768, 12, 0.1)
    assert "yours kept: model.global_pool=avg, model.fc_norm=true, model.weight_init=mae;" in caplog.text


def test_the_command_line_wins_even_where_it_types_a_default(compose_cfg):
    cfg = compose_cfg("train", ["experiment=mae_finetune_b16_in1k", "model.global_pool=token", "model.fc_norm=false"])
    cfg = planned(cfg)
    assert (cfg.model.global_pool, cfg.model.fc_norm) == ("token", False)
    # beit3's pooling is avg: a typed model.global_pool=token (vitlab's default value) is still the user's
    overrides = ["model.pretrained=beit3_base_patch16_224", "model.img_size=32", "data=fake", "model.fc_norm=true"]
    cfg = compose_cfg("train", overrides)
    cfg = planned(cfg)
    assert cfg.model.global_pool == "avg"
    cfg = compose_cfg("train", [*overrides, "model.global_pool=token"])
    cfg = planned(cfg)
    assert (cfg.model.global_pool, cfg.model.fc_norm) == ("token", True)  # the class token, then fc_norm (fresh)
    with pytest.raises(UserError, match=r"cannot serve model.global_pool=token \(the weights': avg\); drop it"):
        planned(compose_cfg("train", [*overrides[:-1], "model.global_pool=token"]))  # beit3 has no norm.*


@pytest.mark.parametrize(
    "typed, message",
    [
        (["model.depth=6"], r"timm's weights cannot serve model.depth=6 \(the weights': 12\); drop it, or train"),
        (
            ["model.patch_size=8", "model.embed_dim=384"],
            r"timm's weights cannot serve model.patch_size=8 \(the weights': 16\), model.embed_dim=384 \(the "
            r"weights': 768\); drop them, set model.resample_patch=true to resample the patch filters, or train "
            r"without model.pretrained",
        ),
        (["model.class_token=false", "model.global_pool=avg"], r"timm's weights cannot serve model.class_token=false "),
    ],
)
def test_what_the_weights_cannot_serve_is_refused_in_one_line(compose_cfg, typed, message):
    cfg = compose_cfg("train", ["experiment=mae_finetune_b16_in1k", *typed])
    with pytest.raises(UserError, match=rf"^model.pretrained=vit_base_patch16_224.mae: {message}") as e:
        cfg = planned(cfg)
    assert "\n" not in str(e.value)


def test_resample_patch_lets_the_weights_serve_another_patch_size(compose_cfg):
    cfg = compose_cfg("train", ["experiment=mae_finetune_b16_in1k", "model.patch_size=8", "model.resample_patch=true"])
    cfg = planned(cfg)
    assert cfg.model.patch_size == 8 and cfg.model.embed_dim == 768


def test_the_weights_crop_mode_crop_pct_and_interpolation_fill_what_the_data_left_null(compose_cfg):
    """The eval transform of every val/test split, eval and predict is the weights' (timm's pretrained_cfg): a squash
    config's crop_mode reaches data.eval_transform; what the command line sets stays."""
    name = "vit_base_patch16_clip_384.openai_ft_in12k_in1k"  # squash, crop_pct 0.95, bicubic, CLIP's mean
    overrides = [f"model.pretrained={name}", "model.img_size=32", "data=fake"]
    cfg = compose_cfg("train", overrides)
    assert cfg.data.eval_transform.crop_mode is None
    cfg = planned(cfg)
    assert dict(cfg.data.eval_transform) == {"crop_pct": 0.95, "crop_mode": "squash", "interpolation": "bicubic"}
    assert cfg.data.mean == pytest.approx([0.48145466, 0.4578275, 0.40821073])
    cfg = compose_cfg("train", [*overrides, "data.eval_transform.crop_mode=center"])
    cfg = planned(cfg)
    assert cfg.data.eval_transform.crop_mode == "center"
