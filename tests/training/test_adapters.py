"""peft= (issue 75): our LoRA/DoRA is Hugging Face peft's own, held to peft applied to timm's model of the same name and
weights (logits, one optimiser step, B zero-initialised, merged); BitFit and partial fine-tuning train what they say;
adapter checkpoints keep the trainable tensors and refuse another base; the one-line refusals."""

import copy

import pytest
import timm
import torch
from peft import LoraConfig, inject_adapter_in_model
from safetensors.torch import save_file

import vitlab
from tests.model.test_draws import _split
from tests.model.test_eva_models import shrink
from tests.training.test_compile import eager_backend  # noqa: F401  (a fixture)
from vitlab.cli.entry import check_config
from vitlab.cli.schemas import SCHEMAS
from vitlab.convert.peft_dir import merged
from vitlab.convert.source import resolve
from vitlab.model import ViT, ViTConfig
from vitlab.training.adapters import PeftConfig, apply, check_peft_version, drop_frozen, plan_peft
from vitlab.training.devices.memory import estimate
from vitlab.training.module import ViTModule
from vitlab.training.optim import OptimConfig, make_optimizer
from vitlab.utils.errors import UserError

SMALL = dict(depth=2, embed_dim=32, num_heads=2, num_classes=5)
# (timm name, its arguments, the adapters' targets): each family, in timm's module names
FAMILIES = {
    "vision_transformer": ("vit_tiny_patch16_224", SMALL | dict(img_size=32), ("qkv", "fc2")),
    "eva_unfused": (
        "eva02_tiny_patch14_224",
        shrink("eva02_tiny_patch14_224") | dict(qkv_fused=False, num_classes=5),
        ("q_proj", "k_proj", "v_proj"),
    ),
    # (naflexvit's LayerScale of 1e-5 would hide the adapters: 1.0)
    "naflexvit": ("naflexvit_base_patch16_gap", SMALL | dict(init_values=1.0), ("qkv", "attn.proj")),
}


def pair(family: str):
    """(ours, timm's) of the family's name and arguments, ours holding timm's random weights; and the targets."""
    name, kwargs, targets = FAMILIES[family]
    torch.manual_seed(0)
    theirs = timm.create_model(name, pretrained=False, **kwargs).eval()
    ours = vitlab.create_model(name, **kwargs).eval()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs, targets


def images(model) -> torch.Tensor:
    return torch.randn(4, 3, *model.cfg.img_hw, generator=torch.Generator().manual_seed(3))


def adapted(ours, theirs, cfg: PeftConfig, reference: LoraConfig):
    """`cfg` applied to ours (training.adapters.apply) and peft's `reference` config, by peft itself, to timm's, each
    from the same seed; then the same non-zero B in both, so that the adapters change the logits."""
    torch.manual_seed(1)
    apply(ours, cfg)
    torch.manual_seed(1)
    inject_adapter_in_model(reference, theirs)
    g = torch.Generator().manual_seed(2)
    mine, reference = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert [n for n, p in mine.items() if p.requires_grad] == [n for n, p in reference.items() if p.requires_grad]
    with torch.no_grad():
        for name, p in mine.items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                reference[name].copy_(p)
    return ours, theirs


@pytest.mark.parametrize("method", ["lora", "dora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_our_adapters_are_peft_on_timm_in_logits_and_after_a_step(family, method):
    ours, theirs, targets = pair(family)
    cfg = PeftConfig(method=method, rank=4, alpha=8, targets=targets, use_rslora=method == "dora")
    reference = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), modules_to_save=["head"],
                           use_dora=method == "dora", use_rslora=method == "dora")  # fmt: skip
    ours, theirs = adapted(ours, theirs, cfg, reference)
    x, y = images(ours), torch.tensor([0, 1, 2, 3])
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
    before = {n: p.detach().clone() for n, p in ours.named_parameters() if p.requires_grad}
    for model in (ours, theirs):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        torch.nn.functional.cross_entropy(model.train()(x), y).backward()
        opt.step()
    reference = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p, reference[name], atol=1e-5, rtol=0, msg=name)
            assert not torch.equal(p, before[name]), f"{name} did not train"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_with_b_zero_is_the_base_model_exactly_and_merged_equals_unmerged(family):
    ours, _, targets = pair(family)
    base, x = copy.deepcopy(ours), images(ours)
    apply(ours, PeftConfig(method="lora", rank=4, targets=targets))
    with torch.no_grad():
        assert torch.equal(ours(x), base(x))
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)
        adapted_logits = ours(x)
        assert (adapted_logits - base(x)).abs().max() > 1e-3  # the adapters matter
        plain = merged(ours)
        torch.testing.assert_close(plain(x), adapted_logits, atol=1e-5, rtol=0)
    assert list(plain.state_dict()) == list(base.state_dict())  # timm's names again


def test_lora_dropout_draws_by_a_samples_row_of_the_global_batch():
    """Issue 78: peft's lora_dropout drops by each sample's row of the global batch (model/draws.py), not from the
    process's generator: two processes' halves of a batch are dropped as one process drops the whole."""
    ours, _, targets = pair("vision_transformer")
    apply(ours, PeftConfig(method="lora", rank=4, targets=targets, dropout=0.5))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)  # (zero B: nothing the dropout drops would show)
    x, state = images(ours), torch.get_rng_state()
    whole, halves = _split(ours.train(), x, 2)
    assert torch.equal(torch.get_rng_state(), state)  # torch's generator untouched
    torch.testing.assert_close(whole, halves, rtol=1e-5, atol=1e-5)  # (matmuls over another batch size)
    assert (whole - ours.eval()(x)).abs().max() > 1e-2  # it drops


def tiny(**kw) -> ViTConfig:
    return ViTConfig(img_size=16, patch_size=8, in_chans=3, num_classes=5, embed_dim=32, depth=2, num_heads=2, **kw)


def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_bitfit_and_partial_train_what_they_say():
    bitfit = apply(ViT(tiny()), PeftConfig(method="bitfit"))
    assert trainable(bitfit) == {n for n, _ in bitfit.named_parameters()
                                 if n.endswith("bias") or "norm" in n or n.startswith("head.")}  # fmt: skip
    partial = apply(ViT(tiny()), PeftConfig(method="partial", blocks=1, names=("cls_token",)))
    assert trainable(partial) == {n for n, _ in partial.named_parameters()
                                  if n.startswith(("blocks.1.", "norm.", "head.")) or n == "cls_token"}  # fmt: skip
    distilled = apply(ViT(tiny(distilled=True)), PeftConfig(method="lora", rank=2))  # objective=distill's second head
    assert {n for n in trainable(distilled) if "lora_" not in n} == {
        f"{h}.modules_to_save.default.{w}" for h in ("head", "head_dist") for w in ("weight", "bias")
    }
    probe = apply(ViT(tiny()), PeftConfig(method="partial", blocks=0, trainable=("head",)))
    assert trainable(probe) == {"norm.weight", "norm.bias", "head.weight", "head.bias"}


def test_the_optimiser_and_the_memory_estimate_see_only_the_trainable_tensors(base_file):
    module = ViTModule(tiny(), peft=plan_peft({"method": "lora", "rank": 2}, resolve(str(base_file)), None))
    names = trainable(module.model)
    assert names and all("lora_" in n or "modules_to_save" in n for n in names)
    opt = make_optimizer(module.model, OptimConfig.from_dict({}))
    grouped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert grouped == {id(p) for p in module.model.parameters() if p.requires_grad}
    est = estimate(module, "adamw", 8, 1, "32-true", False)
    assert est.gradients == 4 * sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    assert est.gradients < est.weights / 4


@pytest.mark.usefixtures("eager_backend")
@pytest.mark.parametrize("how", ["checkpointing", "regional compile"])
def test_adapters_train_under_activation_checkpointing_and_regional_compile(base_file, how):
    """peft=lora with model.grad_checkpointing (each block's activations recomputed in backward, the adapters' among
    them) or compile=regional (each block compiled with its adapters; Dynamo's graphs run eagerly here): the same
    loss and the same adapters' gradients as the plain step."""
    weights = resolve(str(base_file))
    plan = plan_peft({"method": "lora", "rank": 2, "dropout": 0.0}, weights, None)
    plain = ViTModule(tiny(), peft=plan, weights=weights)
    other = (
        ViTModule(tiny(grad_checkpointing=True), peft=plan, weights=weights)
        if how == "checkpointing"
        else ViTModule(tiny(), peft=plan, weights=weights, compile="regional")
    )
    other.load_state_dict(plain.state_dict())
    if how != "checkpointing":
        other.objective.compile(other.model, other.compile_mode, other.compile_regional)
        assert all(b._compiled_call_impl is not None for b in other.model.blocks)
    x = torch.randn(4, 3, *plain.model.cfg.img_hw, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 3])
    losses, calls = [], []
    for module in (plain, other):
        module.train()
        called = []
        module.model.blocks[0].attn.qkv.lora_A["default"].register_forward_hook(lambda *_, c=called: c.append(1))
        loss = module.loss(x, y)[0]
        loss.backward()
        losses.append(loss.detach())
        calls.append(len(called))
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=0)
    assert calls == ([1, 2] if how == "checkpointing" else [1, 1])  # (recomputed in backward, the adapter too)
    grads = [{n: p.grad for n, p in m.model.named_parameters() if p.requires_grad} for m in (plain, other)]
    assert grads[0].keys() == grads[1].keys() and any("lora_B" in n for n in grads[0])
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=0)


@pytest.fixture
def base_file(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "base.safetensors"
    save_file(ViT(tiny()).state_dict(), str(path))
    return path


def test_an_adapter_checkpoint_holds_the_trainable_tensors_and_its_base_by_hash(base_file):
    weights = resolve(str(base_file))
    module = ViTModule(tiny(), peft=plan_peft({"method": "lora", "rank": 2}, weights, None), weights=weights)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    checkpoint = {"state_dict": module.state_dict()}
    drop_frozen(module, checkpoint)
    kept = {k for k in checkpoint["state_dict"] if k.startswith("model.")}
    assert kept == {f"model.{n}" for n in trainable(module.model)}
    hparams = dict(module.hparams)
    again = ViTModule(**hparams)  # the adapters injected; the base from the named file, as the checkpoint loads
    again.on_load_checkpoint(filled := copy.deepcopy(checkpoint))
    again.load_state_dict(filled["state_dict"])
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(again.eval()(x), module.eval()(x), atol=0, rtol=0)
    torch.manual_seed(5)
    save_file(ViT(tiny()).state_dict(), str(base_file))  # other base weights under the same name
    with pytest.raises(UserError, match=r"base weights .*base.safetensors' have sha256 \w+\.\.\., not the"):
        ViTModule(**hparams).on_load_checkpoint(copy.deepcopy(checkpoint))


def test_a_training_run_hashes_its_base_once_and_loads_the_weights_its_plan_resolved(base_file, monkeypatch):
    """The plan names the base by sha256 (plan_peft); the module it builds loads the Weights the plan resolved as
    they are: the file is read and hashed once, not again as the adapters are attached (a checkpoint rebuilt later
    resolves and checks its base itself: the test above)."""
    from vitlab.training import pretrained

    digests = []
    monkeypatch.setattr(pretrained, "weights_digest", lambda w, f=pretrained.weights_digest: digests.append(1) or f(w))
    weights = resolve(str(base_file))
    peft = plan_peft({"method": "lora", "rank": 2}, weights, None)
    module = ViTModule(tiny(), peft=peft, weights=weights)
    assert len(digests) == 1 and "weights" not in module.hparams
    torch.testing.assert_close(module.model.pos_embed, weights.tensors.encoder["pos_embed"], atol=0, rtol=0)


def test_bad_peft_input_is_one_line():
    with pytest.raises(UserError, match=r"peft.targets 'qkvv' matches no module of this ViT; its Linear modules end "
                                        r"in \['fc1', 'fc2', 'head', 'proj', 'qkv'\]"):  # fmt: skip
        apply(ViT(tiny()), PeftConfig(method="lora", targets=("qkvv",)))
    with pytest.raises(UserError, match="peft.rank 0 must be an integer >= 1"):
        PeftConfig(method="lora", rank=0)
    with pytest.raises(UserError, match=r"peft 0.16.2 is too old for peft=: install peft>=0.17"):
        check_peft_version("0.16.2")
    with pytest.raises(UserError, match="peft=lora adapts pretrained weights: give model.pretrained="):
        plan_peft({"method": "lora"}, None, None)


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["peft=lora", "freeze_backbone=true"], "peft=lora chooses what trains, and freeze_backbone=true too"),
        (["peft=lora", "peft.rank=0"], "peft.rank"),
        (["peft=dora", "objective=mae"], "objective=mae pretrains the whole encoder"),
        (["peft=partial", "peft.blocks=-1"], "peft.blocks"),
    ],
)
def test_the_train_schema_refuses_what_peft_cannot_do(compose_cfg, overrides, said):
    with pytest.raises(UserError, match=said):
        check_config(compose_cfg("train", overrides), *SCHEMAS["train"])


def test_a_checkpoint_goes_on_only_with_the_peft_settings_it_trained_with(base_file):
    peft = plan_peft({"method": "lora", "rank": 2}, resolve(str(base_file)), None)
    resumed = {"peft": peft}  # a peft=lora peft.rank=2 checkpoint's hyper-parameters
    assert plan_peft({"method": "lora", "rank": 2}, None, resumed) == peft  # its base, as it names it
    with pytest.raises(UserError, match=r"trained with peft=lora .*'rank': 2.*: go on with the same peft settings"):
        plan_peft({"method": "lora", "rank": 4}, None, resumed)
    with pytest.raises(UserError, match="trained with peft=lora"):
        plan_peft({"method": "none"}, None, resumed)
    with pytest.raises(UserError, match="a full fine-tune's: to adapt its weights with peft=lora, give it as model"):
        plan_peft({"method": "lora"}, resolve(str(base_file)), {"model": {}})
