import pytest
import torch

from vitlab.convert.hf import canonical_hf_key, hf_to_vitlab, vit_config_from_hf
from vitlab.model import ViT

transformers = pytest.importorskip("transformers")


def _hf_model(num_labels=7, **kw):
    cfg = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=num_labels,
        **kw,
    )
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():  # HF zero-initialises some biases and LayerNorms: make every weight count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("names", ["transformers-5 (in memory)", "transformers-4 (hub checkpoints)"])
def test_hf_logits_match(names):
    hf = _hf_model()
    cfg = vit_config_from_hf(hf.config)
    assert cfg.norm_eps == 1e-12 and cfg.num_classes == 7 and cfg.mlp_ratio == 4.0
    sd = hf.state_dict()
    if names.startswith("transformers-4"):
        sd = {canonical_hf_key(k): v for k, v in sd.items()}
        assert "vit.encoder.layer.1.attention.attention.query.weight" in sd
    ours = ViT(cfg).eval()
    ours.load_state_dict(hf_to_vitlab(sd, cfg))
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(pixel_values=x).logits, atol=1e-5, rtol=0)


def test_hf_errors():
    hf = _hf_model()
    cfg = vit_config_from_hf(hf.config)
    sd = hf.state_dict()
    missing_value = {k: v for k, v in sd.items() if "v_proj" not in k or ".0." not in k}
    with pytest.raises(ValueError, match="HF block 0 has \\['key', 'query'\\]"):
        hf_to_vitlab(missing_value, cfg)
    with pytest.raises(ValueError, match="keys vitlab does not map: \\['vit.pooler.dense.weight'\\]"):
        hf_to_vitlab({**sd, "vit.pooler.dense.weight": torch.zeros(32, 32)}, cfg)
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
        vit_config_from_hf({"hidden_act": "relu"})


@pytest.mark.parametrize("pooler", [True, False])
def test_a_bare_vitmodel_state_dict_loads_as_the_backbone(pooler, caplog):
    hf = _hf_model()
    backbone = transformers.ViTModel(hf.config, add_pooling_layer=pooler).eval()
    backbone.load_state_dict({k.removeprefix("vit."): v for k, v in hf.state_dict().items() if k.startswith("vit.")},
                             strict=False)  # fmt: skip
    sd = backbone.state_dict()
    assert not any(k.startswith("vit.") for k in sd) and any(k.startswith("pooler.") for k in sd) == pooler
    cfg = vit_config_from_hf(hf.config, num_classes=0)
    ours = ViT(cfg).eval()
    with caplog.at_level("INFO", logger="vitlab.convert.hf"):
        ours.load_state_dict(hf_to_vitlab(sd, cfg))
    assert ("left out its pooler" in caplog.text) == pooler
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():  # features: the final norm's class token (HF's last_hidden_state[:, 0])
        torch.testing.assert_close(ours(x), backbone(pixel_values=x).last_hidden_state[:, 0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no classifier, and the config asks for 7 classes"):
        hf_to_vitlab(sd, vit_config_from_hf(hf.config))
    classifier = ViT(vit_config_from_hf(hf.config))
    fresh = classifier.head.weight.clone()
    missing = classifier.load_state_dict(hf_to_vitlab(sd, classifier.cfg, reset_head=True), strict=False).missing_keys
    assert missing == ["head.weight", "head.bias"] and torch.equal(classifier.head.weight, fresh)
