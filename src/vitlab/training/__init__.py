"""Training: the one LightningModule and how a fit is made of it, by role, lowest first (a sub-package imports only
from those listed before it, and from below vitlab.training: model, data, convert, utils):

- devices/: processes and devices: sharding (FSDP2), the per-rank state checkpoints carry, hardware defaults, the
  memory estimate;
- callbacks/: what watches or steers a fit from the outside: checkpoints, the stop on a signal, health and the spike
  guard, EMA, an Optuna trial's pruning;
- objectives/: what a step computes: classification, distillation, MAE, DINO/iBOT and their losses;
- module.py (the LightningModule), optim.py (optimizer, schedules, layer decay), checkpoint_io.py (reading and
  upgrading checkpoints), pretrained.py (timm's architecture for pretrained weights): the module and its recipe;
- run/: a fit assembled from a config: the build (data, module, callbacks, loggers, Trainer), the run's plan, where
  it starts from (resume), the automatic batch size, and the config's checks before anything is built.

A new objective goes in objectives/ (an Objective subclass, named in module.OBJECTIVES); a new callback in callbacks/
(and conf/callbacks/); a new strategy or device rule in devices/.
"""
