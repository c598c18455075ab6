"""Training: the one LightningModule (module.py) and the objectives it calls (classification, distillation, MAE),
the optimiser and schedule, callbacks, checkpoint IO, per-rank state, resuming, pretrained weights, hardware
defaults, and the build of a fit from a config (build.py)."""
