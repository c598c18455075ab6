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
from PIL import Image

from tests.helpers.commands import run_cli
from tests.helpers.configs import RESUMABLE, extra_callback
from tests.helpers.runs import (
    assert_close_run,
    assert_goes_on_on_one,
    assert_same_run,
    digits_checkpoint,
    interrupt,
    resume,
    trained,
)
from vitlab.convert.averaging import ema_weights
from vitlab.convert.source import resolve
from vitlab.convert.timm_args import create_timm_model
from vitlab.convert.weights import read_checkpoint
from vitlab.training.run.inference import load_for_inference


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return digits_checkpoint(tmp_path_factory)  # the suite's one-epoch digits run


DROPOUT_TWO = ["peft.dropout=0.2", "trainer=ddp_cpu", "trainer.devices=2"]


def lora(base) -> list[str]:
    return [f"model.pretrained={base}", "peft=lora", "peft.rank=8", *RESUMABLE]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base):
    return trained(tmp_path_factory, "peft-lora-resumable", *lora(base))


def test_a_lora_checkpoint_holds_the_trainable_tensors_and_names_its_base(lora_run, base):
    """Every set of weights in it (callbacks=ema's: the EMA's, and the raw weights beside them, which held the whole
    network, base and all, before) holds the adapters and the head only."""
    ckpt = read_checkpoint(lora_run / "checkpoints" / "last.ckpt")
    model_keys = {k for k in ckpt["state_dict"] if k.startswith("model.")}
    assert model_keys and all(".lora_" in k or ".modules_to_save." in k for k in model_keys), model_keys
    beside = ckpt.get("current_model_state") or ckpt["average_model_state"]  # (which: the monitor's choice)
    assert {k for k in beside if k.startswith("model.")} == model_keys
    named = ckpt["hyper_parameters"]["peft"]["base"]
    assert named["source"] == str(base.resolve())
    assert named["sha256"] == hashlib.sha256(base.read_bytes()).hexdigest()


def test_a_lora_run_stopped_by_sigterm_resumes_exactly(lora_run, base, tmp_path):
    command = interrupt(lora(base), tmp_path, "SIGTERM", 12)
    assert_same_run(lora_run, resume(command, tmp_path))


def test_two_processes_with_lora_dropout_stopped_mid_epoch_go_on_on_one_as_the_uninterrupted_two(
    base, tmp_path_factory, tmp_path
):
    """DDP over two processes, peft's lora_dropout on: stopped by SIGTERM mid-epoch, the run goes on on one process as
    the two would have (issue 78: the adapters' dropout draws by each sample's row of the global batch; issue 75: a
    DDP adapter run resumes), its adapters' checkpoint read back on the new count."""
    assert_goes_on_on_one(tmp_path_factory, tmp_path, "peft-lora-dropout-two", [*lora(base), *DROPOUT_TWO])


def test_under_fsdp2_the_frozen_base_is_sharded_lora_trains_as_under_ddp_and_resumes_exactly(
    base, tmp_path_factory, tmp_path
):
    """trainer=fsdp_cpu with LoRA (issue 75, point 5): each block one FSDP unit holding the frozen base and the
    adapters together (FSDP2 takes mixed requires_grad in a unit), every tensor of it split between the two processes;
    the run equals the DDP one up to the order of reductions (every logged value within 1e-5, the adapters and head
    within 1e-4), its checkpoint holds the trainable tensors only, and a SIGTERM mid-epoch resumes bit for bit (the
    base the module holds, the adapters from the checkpoint)."""
    ddp = trained(tmp_path_factory, "peft-lora-dropout-two", *lora(base), *DROPOUT_TWO)
    args = [*lora(base), "peft.dropout=0.2", "trainer=fsdp_cpu"]
    shards = extra_callback("shards", "tests.end_to_end.test_fsdp.Shards")
    fsdp = tmp_path / "fsdp"
    r = run_cli("train", *args, *shards, f"hydra.run.dir={fsdp}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_close_run(ddp, fsdp)
    kept = [read_checkpoint(d / "checkpoints" / "last.ckpt")["state_dict"] for d in (ddp, fsdp)]
    ddp_keys, fsdp_keys = ({k for k in state if k.startswith("model.")} for state in kept)
    assert fsdp_keys == ddp_keys and all(".lora_" in k or ".modules_to_save." in k for k in fsdp_keys)
    whole = read_checkpoint(base)["state_dict"]["model.blocks.0.attn.qkv.weight"].shape
    for rank in (0, 1):
        local = json.loads((fsdp / f"shards{rank}.json").read_text())["shapes"]
        assert local["model.blocks.0.attn.qkv.base_layer.weight"] == [whole[0] // 2, whole[1]]  # the frozen base
        assert local["model.blocks.0.attn.qkv.lora_A.default.weight"][0] == 8 // 2  # an adapter
    command = interrupt([*args, *shards], tmp_path, "SIGTERM", 4)
    assert_same_run(fsdp, resume(command, tmp_path))


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


def test_adapter_checkpoints_are_averaged_raw_and_ema_and_the_average_is_evaluated_visualized_and_predicted(
    lora_run, base, tmp_path
):
    """vitlab.average over a LoRA run's checkpoints (issue 75, point 3): the averaged checkpoint holds the adapters'
    mean (the trainable tensors only, its base still named by sha256), and with use_ema=true the EMA's; eval scores
    it, visualize draws its attention on an image, predict ranks the image's classes: each takes it as it takes a
    full checkpoint (the base found and checked as it loads)."""
    ckpts = sorted((lora_run / "checkpoints").glob("*.ckpt"))
    assert len(ckpts) >= 2, ckpts
    paths = f"ckpt_paths=[{','.join(map(str, ckpts))}]"
    for name, extra in (("averaged", []), ("ema", ["use_ema=true"])):
        r = run_cli("average", paths, *extra, f"output={tmp_path / name}.ckpt", f"hydra.run.dir={tmp_path / name}")
        assert r.returncode == 0, r.stderr[-3000:]
    held = [read_checkpoint(c) for c in ckpts]
    averaged, ema = (read_checkpoint(tmp_path / f"{n}.ckpt") for n in ("averaged", "ema"))
    keys = {k for k in averaged["state_dict"] if k.startswith("model.")}
    assert keys and all(".lora_" in k or ".modules_to_save." in k for k in keys), keys
    assert averaged["hyper_parameters"]["peft"]["base"]["sha256"] == hashlib.sha256(base.read_bytes()).hexdigest()
    for k in keys:
        mean = sum(c["state_dict"][k] for c in held) / len(held)
        torch.testing.assert_close(averaged["state_dict"][k], mean, atol=1e-7, rtol=0)
    lora_b = next(k for k in keys if ".lora_B." in k)
    ema_mean = sum(ema_weights(c)[lora_b] for c in held) / len(held)
    torch.testing.assert_close(ema["state_dict"][lora_b], ema_mean, atol=1e-7, rtol=0)
    raw = sum(c["current_model_state"][lora_b] for c in held) / len(held)  # (the monitor, val/acc_ema, chose the EMA)
    torch.testing.assert_close(averaged["current_model_state"][lora_b], raw, atol=1e-7, rtol=0)
    assert set(averaged["current_model_state"]) == keys and not torch.equal(raw, ema_mean)
    r = run_cli("eval", f"ckpt_path={tmp_path / 'averaged.ckpt'}", f"hydra.run.dir={tmp_path / 'eval'}")
    assert r.returncode == 0 and 0 <= json.loads((tmp_path / "eval" / "metrics.json").read_text())["test/acc"] <= 1
    image = tmp_path / "digit.png"
    Image.fromarray((torch.rand(8, 8, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy()).save(image)
    r = run_cli(
        "visualize", f"ckpt_path={tmp_path / 'averaged.ckpt'}", f"image={image}", f"hydra.run.dir={tmp_path / 'v'}"
    )
    assert r.returncode == 0 and (tmp_path / "v" / "attention_rollout.png").is_file(), r.stderr[-3000:]
    r = run_cli("predict", f"ckpt_path={tmp_path / 'ema.ckpt'}", f"images=[{image}]", f"hydra.run.dir={tmp_path / 'p'}")
    assert r.returncode == 0, r.stderr[-3000:]
    (result,) = json.loads((tmp_path / "p" / "predictions.json").read_text())
    assert len(result["top_k"]) == 5


def test_a_soup_of_adapter_fine_tunes_is_an_adapter_checkpoint_of_their_mean(lora_run, base, tmp_path):
    """vitlab.average method=greedy_soup over a sweep's LoRA fine-tunes of one base (issue 75, point 3; the sweep's
    jobs stand in as the run's epoch checkpoints, as tests/test_average.py's do): each ingredient scored from its
    adapter checkpoint (the base found by its path and sha256), the soup an adapter checkpoint of the same base whose
    tensors are the mean of the ingredients it took, A and B each; vitlab.eval scores it."""
    ckpts = sorted((lora_run / "checkpoints").glob("*.ckpt"))  # (the best epoch's and the last)
    assert len(ckpts) >= 2, ckpts
    sweep = tmp_path / "sweep"
    for i, ckpt in enumerate(ckpts):
        job = sweep / str(i)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={i}\n")
        (job / "config.yaml").write_text(f"model:\n  pretrained: {base}\n")
        (job / "metrics.json").write_text(json.dumps({"tested_checkpoint": str(ckpt)}))
    r = run_cli("average", "method=greedy_soup", f"sweep_dir={sweep}", f"hydra.run.dir={tmp_path / 'soup'}")
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads((tmp_path / "soup" / "soup.json").read_text())
    taken = [i["checkpoint"] for i in record["ingredients"] if i["job"] in record["soup"]["jobs"]]
    soup = read_checkpoint(tmp_path / "soup" / "soup.ckpt")
    keys = {k for k in soup["state_dict"] if k.startswith("model.")}
    assert keys and all(".lora_" in k or ".modules_to_save." in k for k in keys), keys
    assert soup["hyper_parameters"]["peft"]["base"]["sha256"] == hashlib.sha256(base.read_bytes()).hexdigest()
    held = [read_checkpoint(c)["state_dict"] for c in taken]
    for k in keys:
        torch.testing.assert_close(soup["state_dict"][k], sum(h[k] for h in held) / len(held), atol=1e-7, rtol=0)
    r = run_cli("eval", f"ckpt_path={tmp_path / 'soup' / 'soup.ckpt'}", f"hydra.run.dir={tmp_path / 'eval'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["test/acc"] == pytest.approx(
        record["soup"]["test/acc"]
    )
