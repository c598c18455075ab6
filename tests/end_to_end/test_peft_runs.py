"""peft= as users type it (issue 75): `python -m vitlab.train model.pretrained=<a checkpoint> peft=lora peft.rank=8`
trains, keeps the trainable tensors in its checkpoints (the base named by sha256), resumes exactly after a SIGTERM,
is evaluated from its adapter checkpoint, and exports both ways: format=timm (merged, read by timm) and format=peft
(read by PeftModel.from_pretrained on timm's model of the base), each with the checkpoint's logits."""

import hashlib
import json

import pytest
import timm
import torch
from peft import PeftModel

from tests.helpers.commands import run_cli
from tests.helpers.configs import RESUMABLE
from tests.helpers.runs import assert_same_run, digits_checkpoint, interrupt, resume, trained
from vitlab.convert.source import resolve
from vitlab.convert.timm_args import create_timm_model
from vitlab.convert.weights import read_checkpoint
from vitlab.training.run.inference import load_for_inference


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return digits_checkpoint(tmp_path_factory)  # the suite's one-epoch digits run


def lora(base) -> list[str]:
    return [f"model.pretrained={base}", "peft=lora", "peft.rank=8", *RESUMABLE]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base):
    return trained(tmp_path_factory, "peft-lora-resumable", *lora(base))


def test_a_lora_checkpoint_holds_the_trainable_tensors_and_names_its_base(lora_run, base):
    ckpt = read_checkpoint(lora_run / "checkpoints" / "last.ckpt")
    model_keys = {k for k in ckpt["state_dict"] if k.startswith("model.")}
    assert model_keys and all(".lora_" in k or ".modules_to_save." in k for k in model_keys), model_keys
    named = ckpt["hyper_parameters"]["peft"]["base"]
    assert named["source"] == str(base.resolve())
    assert named["sha256"] == hashlib.sha256(base.read_bytes()).hexdigest()


def test_a_lora_run_stopped_by_sigterm_resumes_exactly(lora_run, base, tmp_path):
    command = interrupt(lora(base), tmp_path, "SIGTERM", 12)
    assert_same_run(lora_run, resume(command, tmp_path))


def test_an_adapter_checkpoint_is_evaluated_and_exported_both_ways_with_its_logits(lora_run, base, tmp_path):
    tested = json.loads((lora_run / "metrics.json").read_text())
    ckpt = tested["tested_checkpoint"]  # the checkpoint the run tested: eval's test/acc is the run's
    r = run_cli("eval", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'eval'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["test/acc"] == pytest.approx(tested["test/acc"])
    for fmt in ("timm", "peft"):
        r = run_cli("export", f"ckpt_path={ckpt}", f"format={fmt}", f"output={tmp_path / fmt}",
                    f"hydra.run.dir={tmp_path / ('export_' + fmt)}")  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
    ours = load_for_inference(str(ckpt)).model.eval()
    x = torch.randn(3, ours.cfg.in_chans, *ours.cfg.img_hw, generator=torch.Generator().manual_seed(0))
    merged = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    timm_base = create_timm_model(ours.cfg)
    timm_base.load_state_dict(resolve(str(base)).tensors.encoder)
    with torch.no_grad():
        before = timm_base.eval()(x)  # (PeftModel injects the adapters into it: the base's logits first)
    adapted = PeftModel.from_pretrained(timm_base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        logits = ours(x)
        assert (logits - before).abs().max() > 1e-4  # the adapters changed the base's logits
        torch.testing.assert_close(merged(x), logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(adapted(x), logits, atol=1e-5, rtol=0)
