"""DINOv3's released backbones (facebookresearch/dinov3 hub files, `dinov3_vit*16_pretrain_*.pth`) convert to timm's
keys, which are ours, as timm's eva.checkpoint_filter_fn converts them (issue 63, point 3). No real file is needed: a
random timm model's state dict is put back into the hub's layout (timm's filter inverted), then both conversions are
held to the original and to each other; timm names with tags resolve offline to one line."""

import pytest
import timm
import torch
from timm.models.eva import checkpoint_filter_fn

import vitlab
from vitlab.convert.dinov3 import from_dinov3, is_dinov3
from vitlab.convert.source import load_timm_weights, resolve
from vitlab.convert.weights import read_weights
from vitlab.utils.errors import UserError

SMALL = dict(depth=2, embed_dim=64, num_heads=2, img_size=32)
# the hub's names <- timm's (each of eva.checkpoint_filter_fn's DINOv3 renames, inverted)
TO_HUB = [("reg_token", "storage_tokens"), ("gamma_1", "ls1.gamma"), ("gamma_2", "ls2.gamma"),
          ("mlp.fc1_g", "mlp.w1"), ("mlp.fc1_x", "mlp.w2")]  # fmt: skip


def hub_layout(sd: dict) -> dict:
    """timm's DINOv3 state dict in the hub's layout: storage tokens, ls1/ls2, SwiGLU w1/w2/w3, one qkv bias with a
    zero third for the keys (zero whole without q/v biases, as the distilled ViT-B/L/H+ files), its bias mask, the
    mask token and the RoPE periods (bf16, as the released files)."""
    out, swiglu = {}, any(".mlp.fc1_g." in k for k in sd)
    for key, value in sd.items():
        if key.endswith(("q_bias", "v_bias")):
            continue
        for new, old in TO_HUB:
            key = key.replace(new, old)
        out[key.replace("mlp.fc2", "mlp.w3") if swiglu else key] = value
        if key.endswith("attn.qkv.weight"):
            block, dim = key.removesuffix(".qkv.weight"), value.shape[1]
            q, v = sd.get(f"{block}.q_bias", torch.zeros(dim)), sd.get(f"{block}.v_bias", torch.zeros(dim))
            out[f"{block}.qkv.bias"] = torch.cat([q, torch.zeros(dim), v])
            out[f"{block}.qkv.bias_mask"] = torch.cat([torch.ones(dim), torch.zeros(dim), torch.ones(dim)])
    dim = sd["cls_token"].shape[-1]
    return out | {"mask_token": torch.zeros(1, dim), "rope_embed.periods": torch.ones(dim // 2 // 4).bfloat16()}


@pytest.mark.parametrize(
    "name", ["vit_small_patch16_dinov3_qkvb", "vit_small_plus_patch16_dinov3", "vit_small_patch16_dinov3"]
)
def test_the_hub_layout_converts_as_timms_filter_does(name, tmp_path):
    torch.manual_seed(0)
    theirs = timm.create_model(name, **SMALL).eval()
    for key, value in theirs.named_parameters():  # trained q/v biases (timm starts them at zero)
        if key.endswith(("q_bias", "v_bias")):
            value.data.normal_()
    original = theirs.state_dict()
    hub = hub_layout(original)
    assert is_dinov3(hub) and not is_dinov3(original)
    converted, filtered = from_dinov3(hub), checkpoint_filter_fn(hub, theirs)
    assert converted.keys() == filtered.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(converted[key], value) and torch.equal(filtered[key], value), key
    torch.save(hub, tmp_path / "dinov3_vits16_pretrain_test.pth")  # recognised by its keys, read as ours
    read, decoder, kind = read_weights(tmp_path / "dinov3_vits16_pretrain_test.pth")
    assert kind == "DINOv3 weights" and not decoder and read.keys() == original.keys()
    ours = vitlab.create_model(name, **SMALL).eval()
    load_timm_weights(ours, str(tmp_path / "dinov3_vits16_pretrain_test.pth"))
    overlay = dict(file=str(tmp_path / "dinov3_vits16_pretrain_test.pth"))  # timm's own filter, on our model
    via_timm = vitlab.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **SMALL).eval()
    x = torch.randn(2, 3, 48, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(via_timm(x), theirs(x), atol=1e-5, rtol=0)


def test_a_file_with_dinov3_tokens_in_neither_layout_is_one_line_naming_it(tmp_path):
    hub = hub_layout(timm.create_model("vit_small_patch16_dinov3", **SMALL).state_dict())
    hub["blocks.0.attn.qkv_proj.weight"] = hub.pop("blocks.0.attn.qkv.weight")  # a layout of no one's
    path = tmp_path / "dinov3_vits16_pretrain_odd.pth"
    torch.save(hub, path)
    with pytest.raises(UserError, match=rf"^weights file '{path}' holds DINOv3's storage tokens, but its keys are "
                       r"neither DINOv3's hub layout nor timm's: \['blocks.0.attn.qkv_proj.weight'\]$"):  # fmt: skip
        read_weights(path)


@pytest.mark.parametrize(
    "name", ["vit_small_patch16_dinov3.lvd1689m", "eva02_tiny_patch14_224.mim_in22k", "vit_pe_core_tiny_patch16_384.fb"]
)
def test_timm_names_with_tags_resolve_offline_and_fail_to_download_in_one_line(name, monkeypatch, tmp_path):
    """model.pretrained=<timm name with tag>: its architecture is resolved without a download, its weights come
    through timm's hub download (when online); offline the one line naming the weights and the ways out."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    weights = resolve(name, run=dict(img_size=None, num_classes=0))
    assert weights.arch["rope"] in ("axial", "dinov3") and weights.preprocessing["tag"] == name
    with pytest.raises(ConnectionError, match=rf"^cannot fetch timm weights '{name}': no network") as e:
        _ = weights.tensors
    assert "\n" not in str(e.value)
