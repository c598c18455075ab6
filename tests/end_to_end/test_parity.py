import json

import pytest
from omegaconf import OmegaConf

from tests.helpers.commands import ROOT
from vitlab.convert.compare import compare, passes
from vitlab.model.config import vit_config

ACCEPTANCE_OVERRIDES = [
    dict(global_pool="avg"),
    dict(reg_tokens=4),
    dict(qk_norm=True),
    dict(init_values=1e-5),
    dict(no_embed_class=True),
    dict(img_size=384),
    dict(img_size=[224, 160]),
]


def zoo_node(name: str):
    base, entry = ROOT / "conf/model/_base.yaml", ROOT / f"conf/model/{name}.yaml"
    node = OmegaConf.merge(OmegaConf.load(base), OmegaConf.load(entry))
    node.pop("defaults")
    return node


def test_parity_command_writes_json_and_passes(cli, tmp_path):
    run_dir = tmp_path / "run"
    r = cli("parity", "model=vit_digits", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr
    assert "PASS" in r.stdout
    report = json.loads((run_dir / "parity.json").read_text())
    assert report["passed"] is True
    assert list(report["layers"]) == [
        "patch_embed",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "features",
        "logits",
    ]
    assert report["layers"]["logits"]["max_abs"] <= 1e-5 and report["top1_agreement"] == 1.0
    assert report["grad"]["relative"] <= 1e-4


def test_timm_zoo_sweeps_timms_own_architectures(cli, tmp_path):
    run_dir = tmp_path / "run"
    # vit_so400m_patch14_siglip_{378, 384}: 384 px is not a multiple of patch 14 (refused), 378 px is expressed
    r = cli("parity", "timm_zoo='vit_so400m_patch14_siglip_3[78]*'", "zoo_depth=1", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr
    assert "1 of 2 expressible; 1 match timm to 1e-05" in r.stdout
    rows = {row["arch"]: row for row in json.loads((run_dir / "timm_zoo.json").read_text())}
    assert rows["vit_so400m_patch14_siglip_384"]["reason"] == "img_size (384, 384) is not divisible by patch_size 14"
    row = rows["vit_so400m_patch14_siglip_378"]
    assert row["passed"] and row["round_trip_exact"] and row["depth"] == 1 and row["logits_max_abs"] <= 1e-5
    table = (run_dir / "timm_zoo.md").read_text().splitlines()
    assert len(table) == 2 + 2 and "| vit_so400m_patch14_siglip_384 | 1 | no: img_size" in table[3]
    none = cli("parity", "timm_zoo=resnet*", f"hydra.run.dir={tmp_path / 'r2'}")
    assert none.returncode == 2 and "timm_zoo 'resnet*' matches no architecture" in none.stderr


def test_parity_fails_with_exit_code_above_tolerance(cli, tmp_path):
    """timm's manual-softmax attention (TIMM_FUSED_ATTN=0) is ~1e-7 from SDPA: over atol=0 (a negative atol, which
    this test used to plant a failure, is refused as bad input now)."""
    env = {"TIMM_FUSED_ATTN": "0"}
    r = cli("parity", "model=vit_digits", "atol=0", f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert r.returncode == 1 and "FAIL" in r.stdout
    assert json.loads((tmp_path / "run" / "parity.json").read_text())["passed"] is False


def test_configs_found_from_any_directory_and_run_dirs_never_reused(cli, tmp_path):
    r = cli("parity", "model=vit_digits", "model.reg_tokens=2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (run_dir,) = (tmp_path / "outputs" / "parity" / "runs").iterdir()
    before = (run_dir / "parity.json").read_text()
    r = cli("parity", "model=vit_digits", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: run directory '{run_dir}' already holds files; vitlab never reuses a run directory: "
        "give a new hydra.run.dir or leave it to the default"
    ]
    assert (run_dir / "parity.json").read_text() == before


def test_pretrained_offline_is_an_error_never_a_check_of_random_weights(cli, tmp_path):
    # (issue 10: it used to fall back to random weights and print PASS; tests/end_to_end/test_fresh_clone.py too)
    r = cli("parity", "model=vit_ti16", "pretrained=true", "batch_size=1", f"hydra.run.dir={tmp_path / 'a'}")
    assert r.returncode == 2 and "PASS" not in r.stdout
    assert r.stderr.startswith("error: cannot fetch timm weights 'vit_tiny_patch16_224'")
    r = cli("parity", "model=vit_digits", "pretrained=true", f"hydra.run.dir={tmp_path / 'b'}")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: pretrained=true needs a model with a timm counterpart (model.timm_name)"


def test_bad_model_value_is_one_line(cli, tmp_path):
    r = cli("parity", "model=vit_digits", "model.img_size=10", f"hydra.run.dir={tmp_path / 'r'}")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: img_size 10 is not divisible by patch_size 4"


@pytest.mark.parametrize("override", ACCEPTANCE_OVERRIDES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_acceptance_overrides_on_vit_ti16(override):
    node = zoo_node("vit_ti16")
    node.merge_with(override)
    report = compare(vit_config(node), node.timm_name, batch_size=1)
    assert passes(report, atol=1e-5, grad_rtol=1e-4), report["layers"]["logits"]


def test_full_size_vit_b16_parity():
    node = zoo_node("vit_b16")
    report = compare(vit_config(node), node.timm_name, batch_size=2)
    assert report["layers"]["logits"]["max_abs"] <= 1e-5
    assert all(d["max_abs"] <= 1e-5 for d in report["layers"].values())
    assert report["top1_agreement"] == 1.0 and report["grad"]["relative"] <= 1e-4
