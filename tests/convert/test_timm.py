import pickle
from pathlib import Path

import pytest
import timm
import torch
from omegaconf import OmegaConf

from tests.helpers.commands import ROOT
from tests.helpers.configs import tiny
from vitlab.convert.source import load_timm_weights
from vitlab.convert.timm_args import config_from_timm, create_timm_model, timm_model_args
from vitlab.convert.timm_hub import timm_pretrained_state_dict
from vitlab.convert.weights import (
    check_state_dict,
    expected_shapes,
    export_timm,
    fit_state_dict,
    read_state_dict,
)
from vitlab.model import ViT
from vitlab.model.config import vit_config
from vitlab.utils.errors import UserError


def zoo_with_timm():
    for path in sorted((ROOT / "conf" / "model").glob("*.yaml")):
        node = OmegaConf.merge(OmegaConf.load(ROOT / "conf/model/_base.yaml"), OmegaConf.load(path))
        if path.stem != "_base" and node.timm_name:
            node.pop("defaults", None)
            yield pytest.param(path.stem, node, id=path.stem)


def test_round_trip_is_bit_identical():
    cfg = tiny(reg_tokens=2, qk_norm=True, init_values=1e-4, global_pool="avg", pre_norm=True)
    sd = ViT(cfg).state_dict()
    back = fit_state_dict(check_state_dict(sd, cfg), cfg)
    assert list(back) == list(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_our_names_are_timms_for_every_parameter_of_every_option():
    cfg = tiny(reg_tokens=2, qk_norm=True, init_values=1e-4, pre_norm=True, global_pool="avg")
    for c in (cfg, tiny(fc_norm=True)):
        timm_sd = create_timm_model(c).state_dict()
        assert list(check_state_dict(ViT(c).state_dict(), c)) == list(timm_sd)
        assert {k: v.shape for k, v in timm_sd.items()} == dict(expected_shapes(c))


def test_strict_checks_name_the_offending_keys():
    cfg = tiny()
    sd = check_state_dict(ViT(cfg).state_dict(), cfg)
    with pytest.raises(ValueError, match=r"keys this ViT config does not use: \['dist_token'\]"):
        fit_state_dict({**sd, "dist_token": torch.zeros(1, 1, 32)}, cfg)
    with pytest.raises(ValueError, match=r"lacks keys this ViT config needs: \['blocks.1.mlp.fc2.bias'\]"):
        fit_state_dict({k: v for k, v in sd.items() if k != "blocks.1.mlp.fc2.bias"}, cfg)
    with pytest.raises(ValueError, match=r"head.weight \(7, 32\) != \(10, 32\)"):
        fit_state_dict(sd, tiny(num_classes=10))
    with pytest.raises(ValueError, match="does not use"):  # depth 2 weights into depth 1
        fit_state_dict(sd, tiny(depth=1))


def test_new_head_and_new_resolution():
    src = tiny(img_size=32)
    sd = check_state_dict(ViT(src).state_dict(), src)
    dst = tiny(img_size=64, num_classes=3)
    out = fit_state_dict(sd, dst, reset_head=True)
    assert "head.weight" not in out and out["pos_embed"].shape == (1, 1 + 64, 32)
    model = ViT(dst)
    head = model.head.weight.clone()
    model.load_state_dict(out, strict=False)
    assert torch.equal(model.head.weight, head)


@pytest.mark.parametrize("name, node", list(zoo_with_timm()))
def test_zoo_parameter_counts_and_shapes_equal_timm(name, node):
    cfg = vit_config(node)
    with torch.device("meta"):
        theirs = timm.create_model(node.timm_name, pretrained=False, num_classes=cfg.num_classes)
    assert {k: v.shape for k, v in theirs.state_dict().items()} == expected_shapes(cfg)
    with torch.device("meta"):
        ours = ViT(cfg)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())


@pytest.mark.parametrize("name, node", list(zoo_with_timm()))
def test_zoo_configs_are_the_config_timm_builds_for_their_name(name, node):
    """Every field, not only the shapes: a RoPE file's temperature, grid order or rotated halves differ in no key."""
    ours, theirs = vit_config(node), config_from_timm(node.timm_name, num_classes=node.num_classes)
    assert ours.replace(fc_norm=ours.use_fc_norm) == theirs.replace(fc_norm=theirs.use_fc_norm, img_size=ours.img_size)
    if not name.startswith("naflex"):  # (NaFlex takes every size natively: its file's 256 px is the run's choice)
        assert ours.img_hw == theirs.img_hw


def test_read_state_dict_formats(tmp_path: Path):
    cfg = tiny()
    sd = ViT(cfg).state_dict()
    torch.save(sd, tmp_path / "plain.pth")
    torch.save({"state_dict": {f"model.{k}": v for k, v in sd.items()}, "epoch": 3}, tmp_path / "lightning.ckpt")
    torch.save({"model": sd, "optimizer": {}}, tmp_path / "timm_train.pth.tar")
    for f in ("plain.pth", "lightning.ckpt", "timm_train.pth.tar"):
        got = read_state_dict(tmp_path / f)
        assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd), f


class _RunsCode:
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('x')",))


def test_pickle_that_would_run_code_is_refused(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "evil.pth", "wb") as f:
        pickle.dump({"pos_embed": _RunsCode()}, f, protocol=2)
    with pytest.raises(ValueError, match="cannot be read safely"):
        read_state_dict(tmp_path / "evil.pth")
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        ({"lr": 0.1}, "does not hold a state dict"),
        ([torch.zeros(1)], "does not hold a state dict"),
    ],
)
def test_not_a_state_dict(tmp_path: Path, content, message):
    torch.save(content, tmp_path / "w.pth")
    with pytest.raises(ValueError, match=message):
        read_state_dict(tmp_path / "w.pth")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_state_dict(tmp_path / "missing.pth")
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        read_state_dict(tmp_path / "bad.safetensors")


def test_export_is_timm_loadable_and_atomic(tmp_path: Path):
    torch.manual_seed(0)
    cfg = tiny(reg_tokens=1)
    model = ViT(cfg).eval()
    path = export_timm(model, tmp_path / "sub" / "w.safetensors", timm_name=None)
    assert sorted(p.name for p in path.parent.iterdir()) == ["w.safetensors"]  # no temporary left
    theirs = create_timm_model(cfg)
    exported = read_state_dict(path)
    expected = check_state_dict(model.state_dict(), cfg)
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)
    theirs.load_state_dict(exported)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():  # not bitwise: our last block computes the class-token row alone
        torch.testing.assert_close(theirs.eval()(x), model(x), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="must end in .safetensors"):
        export_timm(model, tmp_path / "w.pth")


def test_load_timm_weights_from_file_resamples(tmp_path: Path):
    torch.manual_seed(0)
    src = tiny(img_size=32)
    timm_model = create_timm_model(src)
    torch.save(timm_model.state_dict(), tmp_path / "w.pth")
    model = ViT(tiny(img_size=48, num_classes=3))
    load_timm_weights(model, str(tmp_path / "w.pth"), reset_head=True)
    torch.testing.assert_close(model.blocks[1].mlp.fc2.weight, timm_model.blocks[1].mlp.fc2.weight)
    assert model.pos_embed.shape == (1, 1 + 36, 32)


def test_offline_download_fails_with_a_clear_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConnectionError, match="cannot fetch timm weights 'vit_tiny_patch16_224.augreg_in21k'"):
        timm_pretrained_state_dict("vit_tiny_patch16_224.augreg_in21k")
    with pytest.raises(ConnectionError, match="no network and not in the Hugging Face cache"):
        load_timm_weights(ViT(tiny()), "vit_tiny_patch16_224.augreg_in21k")


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("vit_small_patch14_reg4_dinov2", dict(depth=2, img_size=98)),  # DINOv2: registers, patch 14, LayerScale
        ("vit_giant_patch14_dinov2", dict(depth=1, img_size=56)),  # SwiGLU (packed), SiLU
        ("vit_base_patch16_clip_quickgelu_224", dict(depth=1)),  # CLIP: quick GELU, pre-norm, no class bias
        ("test_vit4", {"depth": 2}),  # RmsNorm
        ("vit_base_patch32_siglip_gap_256", dict(depth=1)),  # tanh GELU, average pool without fc_norm
        ("vit_base_patch16_radio_v3", dict(depth=1, img_size=64)),  # no final norm
        ("vit_base_patch16_siglip_224", dict(depth=1)),  # SigLIP: attention-pool head ('map'), tanh GELU
        ("aimv2_large_patch14_224", dict(depth=1, img_size=56)),  # AIMv2: norm after the patch embedding
        ("beit3_base_patch16_224", dict(depth=1, img_size=64)),  # BEiT-3: norms inside attention and MLP
        ("vit_base_patch16_xp_224", dict(depth=1, img_size=64)),  # ViT-22B's parallel blocks, RmsNorm, qk-norm
        ("vit_base_patch16_224.augreg_in21k", dict(depth=1, num_classes=10, img_size=64)),  # a tag, new head and size
        ("vit_base_patch16_rpn_224", dict(depth=1, img_size=64)),  # post-norm residual blocks
        ("vit_small_patch16_18x2_224", dict(depth=2, img_size=64)),  # two attention and two MLP branches
        ("vit_dwee_patch16_reg1_gap_256", dict(depth=3, img_size=64)),  # differential attention
        ("vit_dpwee_patch16_reg1_gap_256", dict(depth=2, img_size=64)),  # the parallel block, differential
    ],
)
def test_config_from_timm_builds_what_timm_builds(name, overrides):
    torch.manual_seed(0)
    cfg = config_from_timm(name, **overrides)
    theirs = timm.create_model(name, pretrained=False, **overrides).eval()
    ours = ViT(cfg).eval()
    ours.load_state_dict(fit_state_dict(theirs.state_dict(), cfg))
    x = torch.randn(2, cfg.in_chans, *cfg.img_hw)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
    assert cfg.depth == overrides["depth"]


def test_config_from_timm_names_what_it_cannot_express():
    with pytest.raises(ValueError, match="timm's vit_so400m_patch14_siglip_384 is not expressible .* img_size"):
        config_from_timm("vit_so400m_patch14_siglip_384")
    with pytest.raises(ValueError, match="'vit_base_patch16_2244' is not an architecture .* did you mean"):
        config_from_timm("vit_base_patch16_2244")
    assert timm_model_args("vit_small_patch14_dinov2")["img_size"] == (518, 518)  # timm's pretrained-cfg default


def test_a_bad_value_given_with_a_timm_name_is_named_with_what_is_allowed_not_blamed_on_timm():
    """Issue 74 point 11: a typo in a value given on top of timm's architecture (config_from_timm's overrides,
    create_model's keywords, the run's fields model.pretrained=<timm name> resolves with) is the value's, named with
    what is allowed; what timm registers and we cannot express still names timm's architecture."""
    import vitlab
    from vitlab.convert.source import resolve

    rope = r"^rope 'axiall' is not one of \['', 'axial', 'mixed', 'dinov3'\] \('' = none\)$"
    with pytest.raises(UserError, match=rope):
        config_from_timm("vit_tiny_patch16_224", rope="axiall")
    with pytest.raises(UserError, match=rope):
        vitlab.create_model("vit_tiny_patch16_224", depth=1, rope="axiall")
    with pytest.raises(UserError, match=r"^drop_path_rate 2.0 must be in \[0, 1\)$"):
        resolve("vit_tiny_patch16_224", run=dict(img_size=32, num_classes=10, drop_path_rate=2.0))
    with pytest.raises(UserError, match="^timm's vit_so400m_patch14_siglip_384 is not expressible .* img_size"):
        config_from_timm("vit_so400m_patch14_siglip_384", depth=1)


def test_config_from_timm_takes_a_tag_without_weights_and_refuses_keywords_as_timm():
    """A registered tag without published weights names a configuration (pretrained is not asked for); an unknown tag
    is a one-line UserError; a keyword no ViT takes is a TypeError, as timm's create_model raises (issue 40)."""
    assert config_from_timm("test_vit4.r160_in1k", depth=1).img_hw == (160, 160)  # the tag's input size
    with pytest.raises(UserError, match=r"timm has no tag 'nope' for test_vit4; it has \['test_vit4.r160_in1k'\]"):
        config_from_timm("test_vit4.nope")
    with pytest.raises(TypeError, match=r"unknown model key\(s\) \['bogus'\]") as raised:
        config_from_timm("test_vit", bogus=1)
    assert isinstance(raised.value, UserError)
    with pytest.raises(TypeError):
        timm.create_model("test_vit", bogus=1)


def test_pretrained_cfg_follows_the_weights_loaded_by_name(monkeypatch):
    """A model loaded with timm's weights by name carries their pretrained_cfg (what the data transforms use),
    read from timm's registry; a fresh model carries timm's ViT defaults."""

    import vitlab.convert.source as ct

    name = "vit_base_patch16_clip_224.openai"
    cfg = config_from_timm(name, depth=1, num_classes=5, img_size=32)
    model = ViT(cfg)
    assert model.pretrained_cfg["mean"] == (0.5, 0.5, 0.5) and model.pretrained_cfg["crop_pct"] == 0.9
    weights = timm.create_model(name, pretrained=False, depth=1, num_classes=5, img_size=32).state_dict()
    monkeypatch.setattr(ct, "timm_pretrained_state_dict", lambda source: weights)
    load_timm_weights(model, name)
    expected = timm.models.get_pretrained_cfg(name)
    assert model.pretrained_cfg["mean"] == expected.mean and model.pretrained_cfg["std"] == expected.std
    assert model.pretrained_cfg["tag"] == name and model.pretrained_cfg["input_size"] == (3, 32, 32)
    assert ct.timm_pretrained_cfg("vit_base_patch16_224")["tag"] == "vit_base_patch16_224.augreg2_in21k_ft_in1k"


def test_every_component_name_of_the_config_has_a_timm_counterpart_and_back():
    """timm_components is the one table between our component names and timm's: each name the config accepts
    maps to timm's, and each of timm's maps back to the same name (what config_from_timm reads)."""
    from vitlab.convert.timm_args import _ours, timm_components
    from vitlab.model import choices

    accepted = {  # (attn_layer and block_fn 'eva' are timm's Eva's, not its VisionTransformer's: convert/timm_eva.py)
        "act_layer": choices.ACT_LAYERS,
        "attn_layer": tuple(n for n in choices.ATTN_LAYERS if n != "eva"),
        "norm_layer": choices.NORM_LAYERS,
        "mlp_layer": choices.MLP_LAYERS,
        "block_fn": tuple(n for n in choices.BLOCK_FNS if n != "eva"),
    }
    table = timm_components()
    assert {k: set(v) for k, v in table.items()} == {k: set(v) for k, v in accepted.items()}
    for key, names in table.items():
        for ours, theirs in names.items():
            if (key, ours) != ("mlp_layer", "swiglu_packed"):  # a partial of GluMlp, read by _mlp
                assert _ours(key, theirs) == ours
