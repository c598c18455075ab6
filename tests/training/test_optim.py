"""vitlab.training.optim: parameter groups, layer decay, the warmup-cosine schedule, and one recipe for Python
callers and the command line."""

import math

import lightning as L
import pytest
import timm.optim.kron
import torch
from omegaconf import OmegaConf

from tests.helpers.configs import tiny
from vitlab.cli.config_tree import config_dir
from vitlab.model import ViT
from vitlab.training.module import ViTModule
from vitlab.training.objectives.classification import ClassifyConfig
from vitlab.training.optim import (
    PLATEAU_MODES,
    OptimConfig,
    SchedulerConfig,
    layer_id,
    make_optimizer,
    make_scheduler,
    name_parameters,
    param_groups,
    states_by_name,
    warmup_cosine,
)
from vitlab.utils.errors import UserError
from vitlab.utils.values import to_dict


def test_no_weight_decay_on_norms_biases_layerscale_pos_embed_and_tokens():
    model = ViT(tiny(reg_tokens=2, init_values=1e-5))
    groups = param_groups(model, lr=1e-3, weight_decay=0.05)
    decayed = {n for g in groups if g["weight_decay"] for n in g["names"]}
    plain = {n for g in groups if not g["weight_decay"] for n in g["names"]}
    assert {
        "pos_embed",
        "cls_token",
        "reg_token",
        "blocks.0.norm1.weight",
        "blocks.0.attn.qkv.bias",
        "blocks.1.ls2.gamma",
        "norm.bias",
        "head.bias",
    } <= plain
    assert decayed == {n for n, p in model.named_parameters() if p.ndim >= 2 and n not in model.no_weight_decay()}
    assert "patch_embed.proj.weight" in decayed and "head.weight" in decayed


def test_fixed_sincos_pos_embed_is_not_optimised():
    model = ViT(tiny(pos_embed="sincos2d"))
    names = {n for g in param_groups(model, 1e-3, 0.05) for n in g["names"]}
    assert "pos_embed" not in names and "cls_token" in names


def test_layer_wise_lr_decay():
    model = ViT(tiny(depth=3))
    lrs = {n: g["lr"] for g in param_groups(model, 1.0, 0.05, layer_decay=0.5) for n in g["names"]}
    # depth 3: embeddings are layer 0 -> 0.5^4, block i -> 0.5^(3 - i), head/norm -> 1
    assert lrs["patch_embed.proj.weight"] == lrs["cls_token"] == 0.5**4
    assert [lrs[f"blocks.{i}.mlp.fc1.weight"] for i in range(3)] == [0.5**3, 0.5**2, 0.5]
    assert lrs["head.weight"] == lrs["norm.weight"] == 1.0
    assert [layer_id(n, 3) for n in ("pos_embed", "blocks.2.attn.qkv.weight", "fc_norm.bias")] == [0, 3, 4]


def test_warmup_then_cosine():
    f = [warmup_cosine(s, warmup=10, total=110, min_ratio=0.01) for s in range(111)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[110] == pytest.approx(0.01)
    assert f[60] == pytest.approx(0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))


def test_optim_yaml_and_dataclass_are_one_source_of_defaults():
    assert OmegaConf.to_container(OmegaConf.load(config_dir() / "optim" / "adamw.yaml")) == to_dict(OptimConfig())
    scheduler = OmegaConf.to_container(OmegaConf.load(config_dir() / "scheduler" / "warmup_cosine.yaml"))
    assert scheduler == to_dict(SchedulerConfig())
    classify = OmegaConf.to_container(OmegaConf.load(config_dir() / "objective" / "classify.yaml"))
    assert {k: v for k, v in classify.items() if k not in ("name", "label_smoothing")} == {
        k: v for k, v in to_dict(ClassifyConfig()).items() if k != "label_smoothing"
    }  # the command line's default smooths labels by 0.1, a module built in Python does not


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_a_module_built_in_python_trains_the_cli_default_recipe(compose_cfg):
    from vitlab.cli.plans import train_plan
    from vitlab.training.run.build import build_module, fit_datamodule

    plan = train_plan(compose_cfg("train", []))
    cli = build_module(plan, fit_datamodule(plan))
    plain = ViTModule(model=cli.hparams["model"])  # no optimizer arguments at all
    plain.model.load_state_dict(cli.model.state_dict())
    assert plain.optim == cli.optim and plain.objective.cfg.mixup == cli.objective.cfg.mixup
    assert plain.scheduler_cfg == cli.scheduler_cfg
    total, epochs = 300 * 19, 300  # the default: 300 epochs of 19 steps
    opts = [make_optimizer(m.model, m.optim) for m in (cli, plain)]
    scheds = [make_scheduler(o, m.scheduler_cfg, total, epochs) for o, m in zip(opts, (cli, plain), strict=True)]
    for a, b in zip(*(o.param_groups for o in opts), strict=True):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
        assert [p.shape for p in a["params"]] == [p.shape for p in b["params"]]
    lrs = {0: None, 50: None, 95: None, 2000: None, total - 1: None}
    for step in range(total):
        if step in lrs:
            lrs[step] = [s.get_last_lr() for s in scheds]
            assert lrs[step][0] == lrs[step][1]
        for s in scheds:
            s.step()
    assert lrs[95][0][0] == pytest.approx(1e-3)  # warmup (5 epochs = 95 steps) reaches the peak LR
    assert lrs[total - 1][0][0] == pytest.approx(1e-5, rel=1e-2)  # cosine down to lr * min_lr_ratio


@pytest.mark.parametrize(
    "values, message",
    [
        ({"lr": "fast"}, "optim.lr 'fast' must be a number >= 0"),
        ({"betas": [0.9, 1.5]}, "optim.betas [0.9, 1.5] must be two numbers in [0, 1)"),
        ({"layer_decay": 0}, "optim.layer_decay 0 must be in (0, 1]"),
        ({"momentun": 0.9}, "unknown optim key(s) ['momentun']; allowed:"),
        ({"name": "adamww"}, "optim.name 'adamww' is not an optimizer of timm's; did you mean "),
        ({"lr_base_scale": "log"}, "optim.lr_base_scale 'log' is not one of ['linear', 'sqrt']"),
    ],
)
def test_bad_optim_settings_name_the_field(values, message):
    with pytest.raises(ValueError) as e:
        OptimConfig.from_dict(values)
    assert str(e.value).startswith(message)


def test_schedule_steps_the_optimizer_lr():
    model = ViT(tiny())
    opt = make_optimizer(model, OptimConfig(fused=False))
    sched = make_scheduler(opt, SchedulerConfig(warmup_steps=2, min_lr_ratio=0.0), total_steps=4, epochs=1)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])
    assert torch.is_tensor(model.head.weight)


def _optimizer_names() -> list[str]:
    from timm.optim import list_optimizers

    return list_optimizers()


@pytest.mark.parametrize("name", _optimizer_names())
def test_every_optimizer_of_timm_builds_and_steps_on_the_tiny_model(name, monkeypatch):
    """optim.name: each of timm's optimizers over our parameter groups, two steps that change the weights; those
    that need a package this machine lacks (bitsandbytes, apex) say which, in one line."""
    torch.manual_seed(0)
    model = ViT(tiny())
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    # Kron torch.compile's its preconditioner, an inductor graph per tensor shape: half a minute on 2 cores. timm's
    # own path for a torch without dynamo runs the same functions eagerly.
    monkeypatch.setattr(timm.optim.kron, "has_dynamo", False)
    try:
        opt = make_optimizer(model, OptimConfig(name=name, lr=1e-2))
    except UserError as e:
        if "second-order" in str(e):
            assert name == "adahessian"  # the one in timm's registry
            return
        assert str(e).startswith(f"optim.name {name!r} needs a package that is not installed")
        pytest.skip(str(e))
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    decay = {g["weight_decay"] for g in opt.param_groups}
    assert 0.0 in decay and 0.05 in decay  # our groups: no decay on norms, biases, tokens, pos_embed


def test_the_default_optimizer_is_todays_adamw_update_for_update():
    """optim.name=adamw through timm: the same groups and, step for step, the same weights as the AdamW
    (betas 0.9/0.999, eps 1e-8, fused) vitlab built itself before."""
    torch.manual_seed(0)
    ours, before = ViT(tiny()), ViT(tiny())
    before.load_state_dict(ours.state_dict())
    o = OptimConfig()
    new = make_optimizer(ours, o)
    groups = param_groups(before, o.lr, o.weight_decay)
    for g in groups:
        g.pop("names")
    old = torch.optim.AdamW(groups, lr=o.lr, betas=(0.9, 0.999), eps=1e-8, fused=True)
    assert type(new) is torch.optim.AdamW
    assert [{k: v for k, v in g.items() if k != "params"} for g in new.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in old.param_groups
    ]
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    for _ in range(3):
        for model, opt in ((ours, new), (before, old)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), before.state_dict().values(), strict=True))


def test_settings_an_optimizer_does_not_have_are_refused():
    with pytest.raises(UserError, match="optim.betas is not a setting of optimizer 'sgd'; set it to null"):
        make_optimizer(ViT(tiny()), OptimConfig(name="sgd", betas=(0.9, 0.99)))
    with pytest.raises(UserError, match=r"optim.opt_args \{'nesterovv': True\} do not fit optimizer 'sgd'"):
        make_optimizer(ViT(tiny()), OptimConfig(name="sgd", opt_args={"nesterovv": True}))
    sgd = make_optimizer(ViT(tiny()), OptimConfig(name="sgd", momentum=0.8))
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.8 and sgd.defaults["nesterov"]


@pytest.mark.parametrize("scale, expected", [("linear", 5e-4 * 1024 / 512), ("sqrt", 5e-4 * 2**0.5)])
def test_lr_base_scales_with_the_global_batch_and_is_saved_in_the_config(compose_cfg, scale, expected, caplog):
    """DeiT's rule (lr = 5e-4 x batch / 512): the effective LR is logged and written into the config that
    config.yaml and the checkpoint keep."""
    from vitlab.cli.plans import train_plan
    from vitlab.training.run.build import build_module, fit_datamodule

    overrides = ["optim.lr_base=5e-4", "optim.lr_base_size=512", f"optim.lr_base_scale={scale}"]
    cfg = compose_cfg("train", [*overrides, "data.batch_size=1024"])
    with caplog.at_level("INFO"):
        plan = train_plan(cfg)
        module = build_module(plan, fit_datamodule(plan))
    assert plan.optim["lr"] == pytest.approx(expected) and module.optim.lr == pytest.approx(expected)
    assert f"optim.lr {expected:.4g}: optim.lr_base 0.0005 x " in caplog.text
    assert make_optimizer(module.model, module.optim).param_groups[0]["lr"] == pytest.approx(expected)


def test_lr_base_scales_with_batch_times_devices_times_nodes_times_accumulation(compose_cfg, caplog):
    """MAE's eff_batch_size = batch x accum_iter x world size: data.batch_size is already global (per device x devices
    x nodes), trainer.accumulate_grad_batches multiplies it; the global batch is logged and written beside the LR."""
    from vitlab.cli.plans import train_plan

    overrides = ["optim.lr_base=1.5e-4", "data.batch_size=512", "trainer.accumulate_grad_batches=8"]
    # (8 CPU processes: the plan checks the device request, and this machine has no GPU)
    cfg = compose_cfg("train", [*overrides, "trainer=ddp_cpu", "trainer.devices=8", "trainer.num_nodes=1"])
    with caplog.at_level("INFO"):
        optim = train_plan(cfg).optim
    assert optim["global_batch"] == 4096 and optim["lr"] == pytest.approx(1.5e-4 * 4096 / 256, rel=1e-12)
    assert "optim.lr 0.0024: optim.lr_base 0.00015 x (global batch 4096 / optim.lr_base_size 256); global batch = " in (
        caplog.text
    )
    how = "data.batch_size 512 (64 per device x 8 devices x 1 nodes) x trainer.accumulate_grad_batches 8"
    assert how in caplog.text
    cfg = compose_cfg("train", [*overrides, "optim.global_batch=1024"])  # given: the user's batch to scale by
    optim = train_plan(cfg).optim
    assert optim["global_batch"] == 1024 and optim["lr"] == pytest.approx(1.5e-4 * 4, rel=1e-12)


def test_decay_tokens_is_maes_pretraining_rule():
    """timm 0.3.2's add_weight_decay as MAE's main_pretrain.py calls it (no skip list): every parameter but the 1-D
    ones (biases, norms) is decayed, the class token included; a fixed pos_embed is no parameter at all."""
    model = ViT(tiny(pos_embed="sincos2d_mae", reg_tokens=1))
    groups = param_groups(model, lr=1e-3, weight_decay=0.05, decay_tokens=True)
    decayed = {n for g in groups if g["weight_decay"] for n in g["names"]}
    mae_rule = {n for n, p in model.named_parameters() if not (p.ndim == 1 or n.endswith(".bias"))}
    assert decayed == mae_rule and {"cls_token", "reg_token", "patch_embed.proj.weight"} <= decayed
    assert "pos_embed" not in {n for g in groups for n in g["names"]}
    mae = {"name": "mae", "decoder_embed_dim": 8, "decoder_depth": 1, "decoder_num_heads": 2}
    module = ViTModule(model=tiny(num_classes=0, pos_embed="sincos2d_mae"), objective=mae)
    joint = module.objective.optimized(module.model)  # encoder and decoder, as objective=mae optimises them
    groups = param_groups(joint, lr=1e-3, weight_decay=0.05, decay_tokens=True)
    decayed = {n for g in groups if g["weight_decay"] for n in g["names"]}
    assert decayed == {n for n, p in joint.named_parameters() if p.ndim > 1}
    assert {"decoder.mask_token", "model.cls_token"} <= decayed
    plain = param_groups(joint, lr=1e-3, weight_decay=0.05)  # without it: timm's rule, tokens not decayed
    assert {"decoder.mask_token", "model.cls_token"} <= {n for g in plain if not g["weight_decay"] for n in g["names"]}


def test_the_optimizer_configs_compose_and_build():
    for name, kind in (("sgd", torch.optim.SGD), ("lamb", None), ("adamw", torch.optim.AdamW)):
        values = OmegaConf.to_container(OmegaConf.load(config_dir() / "optim" / f"{name}.yaml"))
        values.pop("defaults", None)
        o = OptimConfig.from_dict({**to_dict(OptimConfig()), **values})
        opt = make_optimizer(ViT(tiny()), o)
        assert kind is None or type(opt) is kind


class _RecordLR(L.Callback):
    """The learning rate each training step runs with, and val/acc at each epoch's end."""

    def __init__(self, stop_after: int | None = None):
        self.lrs, self.metrics, self.stop_after = [], {"max": [], "min": []}, stop_after

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_epoch_end(self, trainer, pl_module):  # after validation: what a plateau schedule watches
        for mode, key in PLATEAU_MODES.items():
            self.metrics[mode].append(trainer.callback_metrics[key].item())
        if trainer.current_epoch + 1 == self.stop_after:  # an interruption, not the planned end
            trainer.should_stop = True


def _lightning_lrs(scheduler: dict, epochs: int, steps: int, tmp_path, ckpt=None, stop_after=None) -> _RecordLR:
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4 * steps, 3, 32, 32), torch.arange(4 * steps) % 7)
    module = ViTModule(model=tiny().to_dict(), optim={"name": "sgd", "lr": 0.1}, scheduler=scheduler)
    record = _RecordLR(stop_after)
    trainer = L.Trainer(
        max_epochs=epochs, callbacks=[record], logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, num_sanity_val_steps=0,
    )  # fmt: skip
    loader = DataLoader(data, batch_size=4)
    trainer.fit(module, loader, DataLoader(data, batch_size=8), ckpt_path=ckpt)
    return record


def _timm_lrs(scheduler: dict, epochs: int, steps: int, metrics: list[float]) -> list[float]:
    """What timm's train.py does with the same scheduler: step_update(num_updates) after every update,
    step(epoch + 1, metric) after every epoch."""
    from timm.scheduler import create_scheduler_v2

    s = SchedulerConfig.from_dict(scheduler)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    # timm's train.py trains num_epochs + warmup (warmup_prefix) + cooldown epochs: the run's epochs are all three
    num_epochs = epochs - s.cooldown_epochs - (s.warmup_epochs if s.warmup_prefix else 0)
    sched, _ = create_scheduler_v2(
        opt, sched=s.name, num_epochs=num_epochs, decay_epochs=s.decay_epochs,
        decay_milestones=list(s.decay_milestones), cooldown_epochs=s.cooldown_epochs, patience_epochs=s.patience_epochs,
        decay_rate=s.decay_rate, min_lr=s.min_lr, warmup_lr=s.warmup_lr, warmup_epochs=s.warmup_epochs,
        warmup_prefix=s.warmup_prefix, plateau_mode=s.plateau_mode, step_on_epochs=s.step_on_epochs,
        updates_per_epoch=steps,
    )  # fmt: skip
    lrs, updates = [], 0
    for epoch in range(epochs):
        for _ in range(steps):
            lrs.append(opt.param_groups[0]["lr"])
            updates += 1
            sched.step_update(num_updates=updates)
        sched.step(epoch + 1, metrics[epoch])
    return lrs


TIMM_SCHEDULES = {
    "cosine per step": dict(name="cosine", warmup_epochs=1, min_lr=1e-3),
    "cosine per epoch, cooldown (DeiT)": dict(name="cosine", warmup_epochs=1, cooldown_epochs=1, step_on_epochs=True),
    "tanh, warmup prefix": dict(name="tanh", warmup_epochs=1, warmup_prefix=True),
    "step": dict(name="step", warmup_epochs=0, decay_epochs=2, decay_rate=0.5),
    "multistep": dict(name="multistep", warmup_epochs=0, decay_milestones=[1, 3], step_on_epochs=True),
    "plateau": dict(name="plateau", warmup_epochs=0, patience_epochs=0, decay_rate=0.5, step_on_epochs=True),
    "poly": dict(name="poly", warmup_epochs=1, decay_rate=2.0),
}


@pytest.mark.parametrize("settings", TIMM_SCHEDULES.values(), ids=TIMM_SCHEDULES.keys())
def test_timm_schedulers_give_in_lightning_the_learning_rates_of_timms_own_loop(settings, tmp_path):
    epochs, steps = 5, 3
    record = _lightning_lrs(settings, epochs, steps, tmp_path)
    assert len(record.lrs) == epochs * steps and len(set(record.lrs)) > 1
    metrics = record.metrics[settings.get("plateau_mode", "max")]
    assert record.lrs == pytest.approx(_timm_lrs(settings, epochs, steps, metrics), rel=1e-12)


def test_a_timm_schedule_resumes_exactly(tmp_path):
    """Stopped after 2 of 5 epochs and resumed from the checkpoint: the learning rates of the remaining steps are
    those of the uninterrupted run (timm's scheduler state travels in the checkpoint)."""
    settings = dict(name="cosine", warmup_epochs=1, cooldown_epochs=1, step_on_epochs=True, min_lr=1e-3)
    full = _lightning_lrs(settings, 5, 3, tmp_path / "full")
    _lightning_lrs(settings, 5, 3, tmp_path / "first", stop_after=2)
    (ckpt,) = (tmp_path / "first").rglob("*.ckpt")
    rest = _lightning_lrs(settings, 5, 3, tmp_path / "rest", ckpt=str(ckpt))
    assert rest.lrs == full.lrs[2 * 3 :]


def test_bad_scheduler_settings_name_the_field():
    listed = r"scheduler.name 'cosin' is not one of \['warmup_cosine', 'mae_cosine', 'dino_cosine', 'cos"
    with pytest.raises(UserError, match=listed):
        SchedulerConfig(name="cosin")
    with pytest.raises(UserError, match=r"scheduler.epoch_offset 2 must be 1 \(timm's train.py\) or 0 \(DeiT's\)"):
        SchedulerConfig(epoch_offset=2)
    with pytest.raises(UserError, match="scheduler.warmup_steps -1 must be a number >= 0 or null"):
        SchedulerConfig(warmup_steps=-1)
    with pytest.raises(UserError, match="scheduler.name=plateau changes the LR once per epoch: set scheduler.step_"):
        SchedulerConfig(name="plateau")


def _layer_decayed(order):
    """AdamW over a tiny ViT with layer decay: each block's norms in a group of their own, equal in shape across
    blocks (where a state given by position would silently go to the wrong parameter). `order` reorders the groups."""
    from torch.optim import AdamW

    from tests.helpers.configs import tiny

    model = ViT(tiny(depth=3))
    groups = param_groups(model, 1e-3, 0.05, layer_decay=0.75)
    optimizer = AdamW([{k: v for k, v in groups[i].items() if k != "names"} for i in order])
    name_parameters(optimizer, {id(p): n for n, p in model.named_parameters()})
    return model, optimizer


def test_an_optimizer_state_loads_by_parameter_name_whatever_the_group_order():
    model, saved = _layer_decayed(order=range(8))
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    saved.step()
    state = saved.state_dict()
    assert all("param_names" in g for g in state["param_groups"])
    by_name = {n: s["exp_avg"] for n, s in states_by_name(state).items()}
    _, loaded = _layer_decayed(order=reversed(range(8)))  # the same groups, numbered the other way round
    loaded.load_state_dict(state)
    for group in loaded.param_groups:
        for p, name in zip(group["params"], group["param_names"], strict=True):
            assert torch.equal(loaded.state[p]["exp_avg"], by_name[name]), name
    blocks = [n for g in loaded.param_groups for n in g["param_names"] if n.endswith("norm1.weight")]
    assert len(blocks) == 3  # equal shapes in three different groups: each got its own


def test_a_state_for_other_parameters_is_one_line():
    _, saved = _layer_decayed(order=range(8))
    state = saved.state_dict()
    state["param_groups"][0]["param_names"] = ["not.a.parameter"] + state["param_groups"][0]["param_names"][1:]
    _, loaded = _layer_decayed(order=range(8))
    with pytest.raises(UserError, match=r"optimizer state is for other parameters \(not saved: \['"):
        loaded.load_state_dict(state)
