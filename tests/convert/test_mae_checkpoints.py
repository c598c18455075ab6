"""MAE's checkpoints in and out (vitlab.convert.mae, convert.weights): files built here with the key names and shapes of
models_mae.py's mae_vit_base_patch16_dec512d8b (768 wide, decoder 512; 2 + 1 blocks to stay small), in MAE's two
formats: the released `{'model': ...}` weights, and main_pretrain.py's misc.save_model checkpoint with its
argparse.Namespace. Nothing is downloaded."""

import argparse
import logging

import pytest
import torch

from tests.helpers.references import mae_state_dict_like_maes
from vitlab.convert.mae import export_mae, mae_keys, mae_state_dict
from vitlab.convert.source import load_timm_weights
from vitlab.convert.weights import read_weights
from vitlab.model import ViT, ViTConfig
from vitlab.model.mae import MAEConfig, MAEDecoder
from vitlab.utils.errors import UserError

DECODER = MAEConfig(decoder_embed_dim=512, decoder_depth=1, decoder_num_heads=16)


def encoder_cfg(**kw) -> ViTConfig:
    return ViTConfig.from_variant("B/16", depth=2, **({"num_classes": 0, "pos_embed": "sincos2d_mae"} | kw))


def main_pretrain_checkpoint(path, sd):
    """util/misc.py save_model: model, optimizer (AdamW over the parameters, betas (0.9, 0.95)), epoch, the loss
    scaler's state, and args: main_pretrain.py's argparse.Namespace."""
    params = [torch.nn.Parameter(v.clone()) for k, v in sd.items() if k not in ("pos_embed", "decoder_pos_embed")]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    args = argparse.Namespace(batch_size=64, epochs=800, accum_iter=1, model="mae_vit_base_patch16", input_size=224,
                              mask_ratio=0.75, norm_pix_loss=True, weight_decay=0.05, lr=None, blr=1.5e-4, min_lr=0.0,
                              warmup_epochs=40, data_path="/datasets01/imagenet_full_size/061417/", output_dir="./out",
                              distributed=True, world_size=64, dist_url="env://")  # fmt: skip
    scaler = {
        "scale": 65536.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 0,
    }
    torch.save({"model": sd, "optimizer": optimizer.state_dict(), "epoch": 399, "scaler": scaler, "args": args}, path)


@pytest.fixture(scope="module")
def mae_sd():
    return mae_state_dict_like_maes(depth=2, decoder_depth=1)


@pytest.mark.parametrize("fmt", ["released", "main_pretrain"])
def test_maes_checkpoints_fine_tune_with_the_decoder_left_out_and_named(tmp_path, mae_sd, fmt, caplog):
    path = tmp_path / "mae.pth"
    if fmt == "released":
        torch.save({"model": mae_sd}, path)
    else:
        main_pretrain_checkpoint(path, mae_sd)  # holds an argparse.Namespace: read with weights_only, nothing run
    model = ViT(encoder_cfg(num_classes=10, global_pool="avg", fc_norm=True, pos_embed="learn"))
    with caplog.at_level(logging.INFO):
        load_timm_weights(model, str(path))
    ours = model.state_dict()
    for key, value in mae_sd.items():
        if key.startswith(("mask_token", "decoder_", "norm.")):
            continue
        assert torch.equal(ours[key], value), key
    assert "norm.weight" not in ours and torch.equal(ours["fc_norm.weight"], torch.ones(768))  # as main_finetune.py
    line = caplog.records[-1].getMessage()
    assert line.startswith(
        f"loaded MAE checkpoint {str(path)!r} (new head) (final norm dropped, new fc_norm); left out"
    )
    decoder = "mask_token, decoder_pos_embed, decoder_embed.*, decoder_blocks.*, decoder_norm.*, decoder_pred.*"
    assert line.endswith(f"left out its MAE decoder ({decoder})")


def test_maes_checkpoint_continues_pretraining_with_its_decoder(tmp_path, mae_sd):
    path = tmp_path / "checkpoint-399.pth"
    main_pretrain_checkpoint(path, mae_sd)
    cfg = encoder_cfg()
    model, decoder = ViT(cfg), MAEDecoder(cfg, DECODER)
    load_timm_weights(model, str(path), decoder=decoder)
    both = {**model.state_dict(), **decoder.state_dict(), "decoder_pos_embed": decoder.decoder_pos_embed}
    assert list(mae_sd) == mae_keys(2, 1) and set(both) == set(mae_sd)
    assert all(torch.equal(both[k], v) for k, v in mae_sd.items())  # both fixed tables MAE's, bit for bit


def test_a_decoder_that_does_not_fit_is_named_with_the_fix(tmp_path, mae_sd):
    torch.save({"model": mae_sd}, tmp_path / "mae.pth")
    cfg = encoder_cfg(pos_embed="learn")  # its decoder's table: big_vision's frequencies, not MAE's
    with pytest.raises(UserError, match=r"decoder_pos_embed \(1, 197, 512\) is not this decoder's fixed table .*set "
                                        r"model.pos_embed=sincos2d_mae"):  # fmt: skip
        load_timm_weights(ViT(cfg), str(tmp_path / "mae.pth"), decoder=MAEDecoder(cfg, DECODER))
    cfg = encoder_cfg()  # pos_embed=sincos2d_mae already: the file's own table is what is wrong (issue 41)
    changed = {**mae_sd, "decoder_pos_embed": mae_sd["decoder_pos_embed"] + 0.01}
    torch.save({"model": changed}, tmp_path / "changed.pth")
    with pytest.raises(UserError, match=r"not this decoder's fixed table \(1, 197, 512\): the file's table is not the "
                                        r"fixed sin-cos one MAE's code writes"):  # fmt: skip
        load_timm_weights(ViT(cfg), str(tmp_path / "changed.pth"), decoder=MAEDecoder(cfg, DECODER))
    two = MAEConfig(decoder_embed_dim=512, decoder_depth=2, decoder_num_heads=16)
    with pytest.raises(UserError, match=r"its MAE decoder does not fit objective=mae's \(missing \['decoder_blocks.1."):
        load_timm_weights(ViT(cfg), str(tmp_path / "mae.pth"), decoder=MAEDecoder(cfg, two))


def test_an_encoder_only_file_is_read_as_one(tmp_path, mae_sd):
    encoder = {k: v for k, v in mae_sd.items() if not k.startswith(("mask_token", "decoder_"))}
    torch.save({"model": encoder}, tmp_path / "enc.pth")
    sd, decoder, kind = read_weights(tmp_path / "enc.pth")
    assert decoder == {} and kind == "weights file" and list(sd) == list(encoder)


def test_export_writes_maes_names_and_shapes_and_reloads(tmp_path, mae_sd):
    cfg = encoder_cfg()
    model, decoder = ViT(cfg), MAEDecoder(cfg, DECODER)
    load_timm_weights(model, str(_saved(tmp_path, mae_sd)), decoder=decoder)
    export_mae(model, decoder, tmp_path / "out.pth")
    back = torch.load(tmp_path / "out.pth", weights_only=True)
    assert list(back) == ["model"] and list(back["model"]) == list(mae_sd)  # MAE's keys, in MAE's order
    assert all(torch.equal(back["model"][k], v) for k, v in mae_sd.items())
    model2, decoder2 = ViT(cfg), MAEDecoder(cfg, DECODER)
    load_timm_weights(model2, str(tmp_path / "out.pth"), decoder=decoder2)
    assert mae_state_dict(model2, decoder2).keys() == back["model"].keys()
    with pytest.raises(UserError, match=r"format=mae writes MAE's MaskedAutoencoderViT .* pos_embed rows 196 for 196"):
        bv = encoder_cfg(pos_embed="sincos2d")  # big_vision's table has no class row: no place for it in MAE's
        mae_state_dict(ViT(bv), MAEDecoder(bv, DECODER))
    with pytest.raises(UserError, match=r"output '.*out.safetensors' must end in .pth for format=mae"):
        export_mae(model, decoder, tmp_path / "out.safetensors")


def _saved(tmp_path, sd):
    torch.save({"model": sd}, tmp_path / "in.pth")
    return tmp_path / "in.pth"


def test_another_pickled_class_than_namespace_is_still_refused(tmp_path, mae_sd):
    torch.save({"model": mae_sd, "args": logging.Formatter()}, tmp_path / "bad.pth")
    with pytest.raises(UserError, match=r"cannot be read safely .*nothing in it was run"):
        read_weights(tmp_path / "bad.pth")
