"""objective=dino in Lightning with the real ViTModule and the digits data module's views (training/objectives/dino.py):
every schedule main_dino.py keeps is followed step by step (the learning rate, the weight decay, the teacher's momentum,
seen in the teacher's EMA step itself, and the teacher's temperature), the last layer gets no gradient in the first
epoch, the teacher none ever, the teacher starts as the student; the checkpoint's `model.*` is the teacher's backbone;
bad settings are one line."""

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf, open_dict

from tests.helpers.references import reference
from vitlab.cli.plans import train_plan
from vitlab.convert.weights import read_weights
from vitlab.training.module import ViTModule
from vitlab.training.run import build
from vitlab.utils.errors import UserError

EPOCHS, STEPS = 3, 3
cosine_scheduler = reference("dino", "utils").cosine_scheduler  # vendored verbatim (tests/reference/)


def dino_cfg(compose_cfg, *overrides):
    cfg = compose_cfg(
        "train",
        [
            "experiment=dino_pretrain_digits",
            "model.embed_dim=16",
            "model.depth=2",
            "model.num_heads=2",
            "objective.out_dim=32",
            "objective.hidden_dim=16",
            "objective.bottleneck_dim=8",
            "objective.crops.local_crops=2",
            "objective.warmup_teacher_temp_epochs=2",
            "objective.teacher_temp=0.07",
            "objective.centering=center",  # DINO's own (the digits recipe takes DINOv2's Sinkhorn-Knopp and KoLeo)
            "objective.koleo_weight=0",
            "scheduler.warmup_epochs=1",
            "data.batch_size=16",
            *overrides,
        ],
    )
    return cfg


class Record(L.Callback):
    """Per step: LR and weight decay of every group, the last layer and the teacher before and after the step, the
    student after it."""

    def __init__(self):
        self.steps = []

    @staticmethod
    def _teacher(module):
        return [p.detach().clone() for p in [*module.model.parameters(), *module.objective.teacher.parameters()]]

    def on_before_optimizer_step(self, trainer, module, optimizer):
        groups = optimizer.param_groups
        head = module.objective.student.dino_head.last_layer.weight_v
        backbone_grads = [p.grad for p in module.objective.student.backbone.parameters()]
        self.steps.append({
            "lr": [g["lr"] for g in groups], "wd": [g["weight_decay"] for g in groups], "epoch": trainer.current_epoch,
            "last_layer": head.detach().clone(), "teacher": self._teacher(module),
            "teacher_grads": any(p.grad is not None for p in module.model.parameters()),
            "backbone_grads": all(g is not None for g in backbone_grads),
        })  # fmt: skip

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        o = module.objective
        self.steps[-1]["student"] = [
            p.detach().clone() for p in [*o.student.backbone.parameters(), *o.student.dino_head.parameters()]
        ]
        self.steps[-1]["teacher_after"] = self._teacher(module)
        self.steps[-1]["last_layer_moved"] = not torch.equal(
            o.student.dino_head.last_layer.weight_v, self.steps[-1]["last_layer"]
        )


def fit(cfg, callbacks=(), **trainer_kwargs):
    plan = train_plan(cfg)
    torch.manual_seed(0)
    dm = build.fit_datamodule(plan)
    module = build.build_module(plan, dm)
    temps = []
    temperature = module.objective.temperature
    module.objective.temperature = lambda step, epoch: temps.append(temperature(step, epoch)) or temps[-1]
    trainer = L.Trainer(
        max_epochs=EPOCHS, limit_train_batches=STEPS, limit_val_batches=1, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=list(callbacks),
        accelerator="cpu", **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)
    return module, trainer, temps


@pytest.fixture(scope="module")
def run(compose_cfg_module):
    cfg = dino_cfg(compose_cfg_module)
    record = Record()
    module, trainer, temps = fit(cfg, [record])
    return cfg, record.steps, temps, module, trainer


def test_lr_weight_decay_and_teacher_temperature_follow_main_dinos_schedules_step_by_step(run):
    cfg, steps, temps, module, _ = run
    assert len(steps) == EPOCHS * STEPS
    lr = cosine_scheduler(module.optim.lr, cfg.scheduler.min_lr, EPOCHS, STEPS, warmup_epochs=1)
    wd = cosine_scheduler(0.04, 0.4, EPOCHS, STEPS)
    for it, step in enumerate(steps):
        assert step["lr"] == pytest.approx([lr[it]] * len(step["lr"]), rel=1e-9, abs=1e-15), it
        decayed = [w for w in step["wd"] if w > 0]
        assert decayed and decayed == pytest.approx([wd[it]] * len(decayed), rel=1e-9), it
        assert 0.0 in step["wd"]  # biases and norms: never decayed
    teacher_temp = [0.04, 0.07, 0.07]  # np.linspace(0.04, 0.07, 2), then 0.07
    assert temps == pytest.approx([teacher_temp[e] for e in range(EPOCHS) for _ in range(STEPS)], abs=1e-15)


def test_the_teacher_is_the_students_ema_with_the_momentum_schedule(run):
    _, steps, _, _, _ = run
    momentum = cosine_scheduler(0.99, 1.0, EPOCHS, STEPS)
    moved = 0
    for it, step in enumerate(steps):
        m = momentum[it]
        for before, student, after in zip(step["teacher"], step["student"], step["teacher_after"], strict=True):
            torch.testing.assert_close(after, before * m + student * (1 - m), atol=1e-6, rtol=1e-5)
            moved += not torch.equal(before, after)
    assert moved > 0


def test_the_last_layer_is_frozen_for_an_epoch_and_the_teacher_gets_no_gradient(run):
    _, steps, _, _, _ = run
    assert [s["last_layer_moved"] for s in steps] == [s["epoch"] >= 1 for s in steps]  # (its gradient: None)
    assert not any(s["teacher_grads"] for s in steps) and all(s["backbone_grads"] for s in steps)


def test_the_teacher_starts_as_the_student_and_the_checkpoint_holds_it_as_the_model(run, tmp_path):
    cfg, _, _, module, trainer = run
    plan = train_plan(cfg)
    fresh = build.build_module(plan, build.fit_datamodule(plan))
    for (name, t), s in zip(fresh.model.named_parameters(), fresh.objective.student.backbone.parameters(), strict=True):
        assert torch.equal(t, s), name
    path = tmp_path / "dino.ckpt"
    trainer.save_checkpoint(path)
    keys = torch.load(path, weights_only=True)["state_dict"].keys()
    assert {k.split(".")[0] for k in keys} >= {"model", "student", "teacher", "dino_loss"}
    sd, _, kind = read_weights(path)  # vitlab.eval, model.pretrained, export: the teacher
    assert kind == "vitlab checkpoint"
    assert all(torch.equal(sd[k], v) for k, v in module.model.state_dict().items())
    loaded = ViTModule.load_from_checkpoint(path, weights_only=True)
    assert torch.equal(loaded.objective.dino_loss.center, module.objective.dino_loss.center)
    assert module.objective.dino_loss.center.abs().sum() > 0


@pytest.mark.parametrize(
    "overrides, said",
    [
        (
            ["model.dynamic_img_size=false"],
            "objective=dino's crops of [8, 16] px need position embeddings at each size",
        ),
        (["objective.centering=mean"], "objective.centering 'mean' is not one of ['center', 'sinkhorn_knopp']"),
        (["model.num_classes=10"], "objective=dino trains an encoder without a head: model.num_classes is 10"),
        (["objective.momentum_teacher=1.5"], "objective.momentum_teacher"),
    ],
)
def test_settings_it_cannot_train_with_are_one_line(compose_cfg, overrides, said):
    cfg = dino_cfg(compose_cfg, *overrides)
    with pytest.raises(UserError) as e:
        plan = train_plan(cfg)
        build.build_module(plan, build.fit_datamodule(plan))
    assert said in str(e.value) and "\n" not in str(e.value)


def test_ibot_and_koleo_train_the_mask_token_and_sinkhorn_knopp_replaces_the_centre(compose_cfg):
    cfg = dino_cfg(
        compose_cfg, "objective.ibot_weight=1.0", "objective.koleo_weight=0.1", "objective.centering=sinkhorn_knopp",
        "objective.clip_mode=network",
    )  # fmt: skip
    with open_dict(cfg):
        cfg.objective.mask_probability = 1.0
    module, _, _ = fit(cfg)
    o = module.objective
    assert o.student.mask_token.abs().sum() > 0  # it learned: masked patches reached the loss
    assert o.dino_loss.center.abs().sum() == 0 and o.ibot_loss.center.abs().sum() == 0  # Sinkhorn-Knopp: no centre
    assert OmegaConf.to_container(cfg.objective)["ibot_weight"] == 1.0


def test_pretraining_from_weights_starts_student_and_teacher_from_them(compose_cfg, tmp_path):
    """model.pretrained=<weights> under objective=dino (go on from a released backbone): both networks are those
    weights."""
    from vitlab.model import ViT
    from vitlab.model.config import vit_config

    cfg = dino_cfg(compose_cfg, f"model.pretrained={tmp_path / 'backbone.pth'}")
    torch.manual_seed(3)
    weights = ViT(vit_config(cfg.model)).state_dict()
    torch.save(weights, tmp_path / "backbone.pth")
    plan = train_plan(cfg)
    module = build.build_module(plan, build.fit_datamodule(plan))  # (the weights it starts from loaded)
    for name, value in weights.items():
        assert torch.equal(module.model.state_dict()[name], value), name
        assert torch.equal(module.objective.student.backbone.state_dict()[name], value), name


def test_dinov2s_parameter_groups_are_get_params_groups_with_decay(compose_cfg):
    """DINOv2's optimizer (issue 54, point 3), against its dinov2/utils/param_groups.py (tests/reference/, verbatim)
    applied to the same student: every parameter's learning-rate multiplier (layer decay 0.9, the mask token and the
    tokens in layer 0's group, the patch embedding's x 0.2) and whether it decays (not biases, norms, LayerScale)."""
    from vitlab.training.optim import OptimConfig, make_optimizer

    get_params_groups_with_decay = reference("dinov2", "dinov2.utils.param_groups").get_params_groups_with_decay
    cfg = dino_cfg(
        compose_cfg, "objective.ibot_weight=1.0", "objective.ibot_separate_head=true", "objective.ibot_out_dim=24",
        "objective.ibot_bottleneck_dim=12", "model.init_values=1e-5", "model.reg_tokens=2", "optim.layer_decay=0.9",
        "optim.patch_embed_lr_mult=0.2", "optim.decay_tokens=true", "model.drop_path_rate=0.3",
        "model.drop_path_uniform=true",
    )  # fmt: skip
    plan = train_plan(cfg)
    module = build.build_module(plan, build.fit_datamodule(plan))
    student = module.objective.optimized(module.model)
    o = OptimConfig.from_dict(OmegaConf.to_container(cfg.optim, resolve=True))
    optimizer = make_optimizer(student, o)
    ours = {id(p): (g["lr"] / o.lr, g["weight_decay"] > 0) for g in optimizer.param_groups for p in g["params"]}

    class AsDinov2Names:  # the student under DINOv2's names: timm's (and our) reg_token is its register_tokens
        blocks = student.blocks

        def named_parameters(self):
            return ((n.replace("reg_token", "register_tokens"), p) for n, p in student.named_parameters())

    theirs = {
        id(d["params"]): (d["lr_multiplier"], d["wd_multiplier"] > 0)
        for d in get_params_groups_with_decay(AsDinov2Names(), lr_decay_rate=0.9, patch_embed_lr_mult=0.2)
    }
    names = {id(p): n for n, p in student.named_parameters()}
    assert ours.keys() == theirs.keys()
    differ = {names[i]: (ours[i], theirs[i]) for i in ours if ours[i][1] != theirs[i][1] or
              abs(ours[i][0] - theirs[i][0]) > 1e-12}  # fmt: skip
    assert differ == {}
    assert ours[id(student.mask_token)][0] == pytest.approx(0.9**3)  # layer 0 of 2 blocks
    assert ours[id(student.patch_embed.proj.weight)][0] == pytest.approx(0.2 * 0.9**3)
    # the separate iBOT head's own bottleneck; every block's drop path at the rate (drop_path_uniform)
    assert module.objective.student.ibot_head.last_layer.weight_v.shape[1] == 12
    assert [b.drop_path1.p for b in module.objective.student.backbone.blocks] == [0.3, 0.3]
