"""ViTModule: the one LightningModule. It holds our ViT, calls its objective (`objective=classify|distill|mae|dino`,
vitlab.training.objectives.objective) for the loss, the metrics and any network trained beside the ViT, keeps the
metrics, and wires the optimisation recipe of vitlab.training.optim into Lightning. What guards a run is a callback of
its own (training.callbacks.standard: NonFiniteLoss, RankState), and Lightning workarounds live where the Trainer is
built (training.run.build).

Its constructor takes plain data only (dicts, lists, numbers), saved as the checkpoint's hyper-parameters, so
`ViTModule.load_from_checkpoint(path)` rebuilds the model without Hydra and without executing anything from the file
(weights_only loading works); checkpoints written before objectives were objects load through
training.checkpoint_io.load_module.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import lightning as L
import torch
from timm.scheduler.scheduler import Scheduler as TimmScheduler
from torch import nn
from torch.utils.data import IterableDataset
from torchmetrics import MaxMetric, MeanMetric, MinMetric

from vitlab.model import ViTConfig
from vitlab.model.draws import drawn_by_images, drawn_by_rows
from vitlab.training.adapters import WEIGHT_SETS, attach, drop_frozen, fill_frozen
from vitlab.training.devices.float8 import Float8Precision, plain_state
from vitlab.training.devices.sharding import new_vit, splits_weights
from vitlab.training.objectives.classification import Classification
from vitlab.training.objectives.dino import DINO
from vitlab.training.objectives.distill_kinds import Distill
from vitlab.training.objectives.label_metrics import class_values
from vitlab.training.objectives.mae import MAE
from vitlab.training.objectives.objective import Objective, reads_no_labels
from vitlab.training.optim import (
    PLATEAU_MODES,
    make_optimizer,
    make_scheduler,
    name_parameters,
    recipe,
)
from vitlab.utils.errors import UserError
from vitlab.utils.kernels import compile_mode
from vitlab.utils.seeds import mix

log = logging.getLogger("vitlab.train")  # the command's own lines

OBJECTIVES: dict[str, type[Objective]] = {"classify": Classification, "distill": Distill, "mae": MAE, "dino": DINO}


def build_objective(options: dict[str, Any] | None, model: ViTConfig, unlabeled: bool = False) -> Objective:
    """The objective `options["name"]` names (classify when none), from the rest of its options; `unlabeled`: the
    data has no labels (data.unlabeled=true), which only a pretraining objective can learn from."""
    values = dict(options or {})
    name = values.pop("name", "classify")
    if name not in OBJECTIVES:
        raise UserError(f"objective {name!r} is not one of {list(OBJECTIVES)}")
    if "gram" in values and name != "dino":  # the one key another objective's dataclass would list as unknown
        raise UserError(
            f"objective.gram (DINOv3's Gram anchoring of a DINO teacher's patch features) is objective=dino's; "
            f"objective={name} has no Gram teacher: drop objective.gram or train with objective=dino"
        )
    if unlabeled and (refusal := OBJECTIVES[name].unlabeled_refusal(values)):
        raise UserError(refusal)
    objective = OBJECTIVES[name](values, model)
    if unlabeled:
        objective.read_no_labels()  # (objective=distill kind=feature|tokens: the distillation term alone)
    return objective


class ViTModule(L.LightningModule):
    """The one LightningModule: a ViT, the objective that computes its loss (`OBJECTIVES`), and the optimizer and
    schedule; its hyper-parameters are plain data, so a checkpoint rebuilds it without Hydra."""

    def __init__(
        self,
        model: ViTConfig | dict[str, Any],  # a dict: the plain data a checkpoint carries
        objective: dict[str, Any] | None = None,  # {"name": <an OBJECTIVES key>, its options}: conf/objective/
        optim: dict[str, Any] | None = None,
        scheduler: dict[str, Any] | None = None,
        compile: bool | str = False,  # or a torch.compile mode (COMPILE_MODES), or regional
        class_names: list[str] | None = None,
        data: dict[str, Any] | None = None,  # the data config that trained it, for vitlab.eval/predict
        freeze_backbone: bool = False,  # linear probe: train the head (and fc_norm) only
        peft: dict[str, Any] | None = None,  # peft=: the method and its base weights (training.adapters.plan_peft)
        weights: Any = None,  # the plan's weights to start from (convert.source.Weights); not a hyper-parameter
        resample_patch: bool = False,  # model.resample_patch, for them
    ):
        super().__init__()
        cfg = model if isinstance(model, ViTConfig) else ViTConfig.from_dict(model)
        model = cfg.to_dict()  # what save_hyperparameters keeps: a checkpoint carries the config as plain data
        self.save_hyperparameters(ignore=["weights", "resample_patch"])
        self.model = new_vit(cfg)  # on the meta device under sharding.networks_on_meta (trainer=fsdp)
        if freeze_backbone:
            for name, p in self.model.named_parameters():
                p.requires_grad_(name.startswith(("head.", "fc_norm.")))
        self.objective = build_objective(objective, cfg, unlabeled=reads_no_labels(data))
        self.optim, self.scheduler_cfg = recipe(optim, scheduler)  # omitted keys: conf/optim, conf/scheduler's
        compile_mode(compile)  # a bad compile= refused here (its mode is read where the steps are compiled)
        self.objective.check(cfg, self.optim)
        self.objective.prepare(self.model)
        self.started_from_weights = self._start_from(weights, resample_patch)  # pretrained, an average's, a base
        self._eval_batches: dict = {}  # (evaluation_draws: an evaluation loader's batches of indices)
        attach(self, peft)  # peft=: the adapters injected (training.adapters)
        for name, network in self.objective.extra_modules().items():  # e.g. a decoder: checkpoint keys decoder.*
            self.add_module(name, network)
        # Updated every step, computed (and synced across processes) once per epoch: logging a value costs ~1 ms in
        # Lightning, as much as the forward pass of the digits model. A non-finite training loss stops the run before
        # it is averaged (NonFiniteLoss), so its mean skips the NaN check (a device sync per step on a GPU); the
        # accuracy skips its input checks (objective.metrics: validate_args=False).
        k = cfg.num_classes
        self.train_metrics = nn.ModuleDict(
            {"loss": MeanMetric(nan_strategy="disable")}
            | self.objective.metrics("train", k)
            | {f"loss_{t}": MeanMetric(nan_strategy="disable") for t in self.objective.term_names()}  # its terms
        )
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric()} | self.objective.metrics("val", k))
        self.test_metrics = nn.ModuleDict({"loss": MeanMetric()} | self.objective.metrics("test", k))
        watched, mode = self.objective.best  # val/acc_best (max) or val/loss_best (min): what chooses the checkpoint
        self.best_key = f"val/{watched}"
        self.class_values: dict[str, Any] = {}  # metrics with one value a class, for metrics.json (_log_epoch)
        self.kept_values: dict[str, torch.Tensor] | None = None  # set by an EMA whose average the checkpoints keep
        self.add_module(f"val_{watched}_best", MaxMetric() if mode == "max" else MinMetric())
        # Running training metrics and the best so far are checkpointed, so a run resumed mid-epoch logs the same
        # values as one that was never interrupted.
        for metric in [*self.train_metrics.values(), self.best_metric]:
            metric.persistent(True)

    def _start_from(self, weights: Any, resample_patch: bool) -> bool:
        """The weights the module starts from, the plan's (model.pretrained's, an average's, peft='s base; resolved,
        and named by sha256, once): the encoder, and objective=mae's decoder from a file that holds one, so pretraining
        goes on. Nothing on the meta device (a memory probe, FSDP's layout) or without weights (a module rebuilt from a
        checkpoint: its state is the checkpoint's, adapters.fill_frozen); whether they were loaded."""
        if weights is None or any(p.is_meta for p in self.model.parameters()):
            return False
        decoder = self.objective.extra_modules().get("decoder")
        weights.load_into(self.model, decoder=decoder, resample_patch=resample_patch)
        self.objective.prepare(self.model)  # what it sets from the weights (objective=dino: the student starts as them)
        return True

    @property
    def compile_mode(self) -> str | None:
        """compile= as torch.compile's mode (None: eager), read where the steps are compiled (setup)."""
        return compile_mode(self.hparams.compile)

    @property
    def compile_regional(self) -> bool:
        return self.hparams.compile == "regional"

    @property
    def best_metric(self) -> MaxMetric | MinMetric:
        return getattr(self, f"val_{self.objective.best[0]}_best")

    # ---- steps -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The objective's training loss of a batch and the logits its metrics read (a plain training loop calls this
        too, so both optimise the same objective)."""
        return self.objective.training_loss(self.model, x, y, self.current_epoch)

    @property
    def network_prefixes(self) -> tuple[str, ...]:
        """The state-dict prefixes of the networks (strictly checked on load); the rest is metric bookkeeping."""
        return ("model.", *(f"{name}." for name in self.objective.extra_modules()))

    def configure_model(self) -> None:
        """trainer.precision=float8 (training.devices.float8) swaps the ViT's large Linears for float8 ones, then a
        sharded strategy (trainer=fsdp: training.devices.sharding) shards the network the steps call and those they
        call beside it (a distillation's teachers and heads); each once, in torchtitan's order (float8 before
        sharding). (Lightning calls this without a Trainer too, loading a checkpoint for inference: nothing to convert
        or shard then.)"""
        if self._trainer is not None and isinstance(self._trainer.precision_plugin, Float8Precision):
            self._trainer.precision_plugin.convert(self.model, sharded=splits_weights(self._trainer))
        shard = getattr(self._trainer.strategy, "shard_module", None) if self._trainer is not None else None
        if shard is not None and shard(self):
            self.objective.prepare(self.model)  # what it set on the weights, now that they exist

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.objective.setup_fit(self.model.cfg.num_classes)
            if self.compile_mode:
                self.objective.compile(self.model, self.compile_mode, self.compile_regional)
                if self.trainer.is_global_zero:  # torch.compile says nothing while it works
                    what = "each transformer block (one code for all)" if self.compile_regional else "the training step"
                    log.info(
                        "compile=%s: torch.compile compiles %s on the first steps, and validation's on its first "
                        "batch: they take tens of seconds (a minute or more for a large model), the steps after "
                        "them run compiled",
                        "regional" if self.compile_regional else self.compile_mode,
                        what,
                    )
        self.train_flops_per_image = self.objective.train_flops_per_image(self.model.cfg)  # callbacks.Throughput

    def on_fit_start(self) -> None:
        self.objective.fit_start(self.trainer.datamodule, self.device)
        names = getattr(self.trainer.datamodule, "class_names", None)
        if names:  # known once the dataset is read (CIFAR, ImageFolder); saved with the checkpoint
            self.hparams["class_names"] = list(names)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if type(self.objective).step_start is not Objective.step_start:  # (asking Lightning for the optimizer costs)
            self.objective.step_start(self.optimizers().optimizer, self.global_step)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if not self.objective.clip_gradients(self.current_epoch):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        step = self.global_step
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self.objective.step_end(self.model, step)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with self._drawn_by_rows(batch_idx, len(y)):
            loss, logits = self.loss(x, y)
        self.update_metrics("train", loss, logits, y)  # a classifier's accuracy: against the unmixed labels
        for name in self.objective.term_names():  # the loss's terms (objective=dino's), each a mean as train/loss is
            if name in self.objective.terms:
                self.train_metrics[f"loss_{name}"].update(self.objective.terms[name].expand(len(y)))
        if (self.global_step + 1) % self.trainer.log_every_n_steps == 0:  # the steps Lightning writes logs at
            # Read here, on a step that logs (and waits) anyway: a device tensor in the progress bar would be
            # read again, and waited for, after every later step.
            # The global batch's loss (the mean of the processes'), the same on any count of processes.
            value = loss.detach().float()
            value = self.trainer.strategy.reduce(value, reduce_op="mean") if self.trainer.world_size > 1 else value
            self.log("train/loss_step", value.cpu(), prog_bar=True)
        scale = getattr(x, "loss_scale", None)  # a batch that weighs its loss: NaFlex's, by its size (data/naflex.py)
        return loss if scale is None else loss * scale

    def _drawn_by_rows(self, batch_idx: int, count: int) -> contextlib.AbstractContextManager:
        """Stochastic depth's draws as the global batch's rows (model.layers.drawn_by_rows), when the data's order is
        global (data/seeded.py: each process `count` rows of every global batch, count x world_size; a schedule's
        batches vary in size, data/sizes.py): keyed by the run's seed, the epoch and the batch, the same in every
        process."""
        data = self._trainer.datamodule if self._trainer is not None else None
        if not getattr(data, "global_order", False):
            return contextlib.nullcontext()
        seed = mix(data.shuffle_seed, self.current_epoch, batch_idx, 1)
        return drawn_by_rows(self.model, seed, self.global_rank * count, count, count * self.trainer.world_size)

    def evaluate(self, stage: str, batch) -> None:
        """A validation or test batch's loss and metrics (EMA's averaged copy calls this too)."""
        x, y = batch
        loss, logits = self.objective.evaluation_loss(self.model, x, y)
        self.update_metrics(stage, loss, logits, y)

    def validation_step(self, batch, batch_idx: int) -> None:
        with self.evaluation_draws("val", batch_idx):
            self.evaluate("val", batch)

    def test_step(self, batch, batch_idx: int) -> None:
        with self.evaluation_draws("test", batch_idx):
            self.evaluate("test", batch)

    def evaluation_draws(self, stage: str, batch_idx: int) -> contextlib.AbstractContextManager:
        """An evaluated batch's random draws (objective=mae's masks) by each image's index in the split
        (model.draws.drawn_by_images): the same on any number of processes, and at every validation."""
        loader = getattr(self.trainer, f"{stage}_dataloaders", None) if self._trainer is not None else None
        data = self._trainer.datamodule if self._trainer is not None else None
        batches = getattr(loader, "batch_sampler", None)
        if batches is None or isinstance(loader.dataset, IterableDataset) or not hasattr(data, "shuffle_seed"):
            return contextlib.nullcontext()  # (a stream has no indices: its masks are drawn as before)
        key = (stage, id(batches))
        if self._eval_batches.get("key") != key:  # (an evaluation loader's batches are the same every time)
            self._eval_batches = {"key": key, "batches": [torch.as_tensor(list(b)) for b in batches]}
        numbers = self._eval_batches["batches"][batch_idx]
        return drawn_by_images(mix(data.shuffle_seed, 2, stage == "test"), numbers, len(loader.dataset))

    def update_metrics(self, stage: str, loss: torch.Tensor, logits: torch.Tensor | None, y: torch.Tensor) -> None:
        m = getattr(self, f"{stage}_metrics")
        loss = loss.detach()
        if stage == "train":
            # The mean over images: the batch's loss once per image (a view, no copy). The weight is in the values
            # because torchmetrics (1.9) replaces a weight by ones under nan_strategy="disable" (its issue 3434).
            m["loss"].update(loss.expand(len(y)))
        else:  # the weight is made on the device: a Python number would be copied there, and that copy waits
            m["loss"].update(loss, weight=torch.full((), len(y), dtype=loss.dtype, device=loss.device))
        for name, metric in m.items():
            if not name.startswith("loss"):  # (the loss's terms: training_step)
                metric.update(logits.detach(), y)

    def _log_epoch(self, stage: str) -> dict[str, torch.Tensor]:
        values = {}
        for name, metric in getattr(self, f"{stage}_metrics").items():
            if name.startswith("loss_") and not metric.weight:  # a loss term not begun (objective.gram.start)
                metric.reset()
                continue
            value = metric.compute()
            metric.reset()
            if value.ndim == 1:  # one value a class (objectives/label_metrics.py): metrics.json's alone
                self.class_values |= class_values(stage, name, value, self.hparams)
                continue
            values[f"{stage}/{name}"] = value
        # torchmetrics has already reduced these over processes; sync_dist=True averages equal values (and
        # keeps Lightning from warning, under DDP, that epoch-level values were not synced).
        self.log_dict(values, prog_bar=stage == "val", sync_dist=True)
        return values

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")
        scheduler = self.lr_schedulers()
        if isinstance(scheduler, TimmScheduler):  # timm's epoch step, after validation (a plateau watches it)
            watched = self.trainer.callback_metrics.get(PLATEAU_MODES[self.scheduler_cfg.plateau_mode])
            epoch = self.current_epoch + self.scheduler_cfg.epoch_offset  # timm's train.py: + 1; DeiT's main.py: + 0
            scheduler.step(epoch, None if watched is None else watched.item())

    def on_validation_epoch_end(self) -> None:
        values = self._log_epoch("val")
        if not self.trainer.sanity_checking:  # the sanity check's numbers are no result
            # The weights the checkpoints keep give the best: the EMA callback, whose hook runs first, hands over the
            # average's values when the monitor chose it (val/acc_best is then the best val/acc_ema).
            kept = self.kept_values if self.kept_values is not None else values
            self.best_metric.update(kept[self.best_key])
            self.log(f"{self.best_key}_best", self.best_metric.compute(), prog_bar=True, sync_dist=True)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The epochs the run was to train: a resume of it once it had finished says so (training.run.resume).
        checkpoint["max_epochs"] = self.trainer.max_epochs
        if getattr(self.trainer.precision_plugin, "float8_all_gather", False) and "state_dict" in checkpoint:
            checkpoint["state_dict"] = plain_state(checkpoint["state_dict"])  # plain weights, without torchao's wrapper
        drop_frozen(self, checkpoint)  # peft=: the trainable tensors only; the hyper-parameters name the base

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Metric states are bookkeeping, not weights: a checkpoint without them (older, or written elsewhere) starts
        # them fresh; the networks' own keys stay strictly checked.
        if "state_dict" not in checkpoint:  # a sharded strategy has loaded it already (training.devices.sharding)
            return
        for key in (k for k in WEIGHT_SETS if k in checkpoint):  # peft=: the base, as attach loaded it
            fill_frozen(self, checkpoint[key])
        state, ours = checkpoint["state_dict"], self.state_dict()
        for key, value in ours.items():
            if not key.startswith(self.network_prefixes) and key not in state:
                state[key] = value
        for key in [k for k in state if k not in ours and not k.startswith(self.network_prefixes)]:
            del state[key]  # another version's metric states (e.g. train_metrics.means.sums, 2026-11-28)

    # ---- optimisation ----------------------------------------------------------------------------
    def configure_optimizers(self):
        optimizer = make_optimizer(self.objective.optimized(self.model), self.optim)
        name_parameters(optimizer, {id(p): name for name, p in self.named_parameters()})  # its state, by name
        total = max(1, int(self.trainer.estimated_stepping_batches))
        epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 1
        scheduler = make_scheduler(optimizer, self.scheduler_cfg, total, epochs)
        self.objective.schedule(optimizer, total, max(1, total // epochs))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric) -> None:
        """timm's schedulers take the number of updates so far (Lightning's steps: exact on resume); PyTorch's
        step as Lightning steps them."""
        if isinstance(scheduler, TimmScheduler):
            scheduler.step_update(num_updates=self.trainer.global_step)
        else:
            super().lr_scheduler_step(scheduler, metric)
