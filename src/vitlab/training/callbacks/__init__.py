"""Lightning callbacks: what watches or steers a fit from outside the step: the best and last checkpoints, the stop on
a signal, the non-finite-loss stop, the epoch log, throughput and the progress bars (standard.py), gradient health,
adaptive clipping and the spike guard (health.py), the weights' EMA (ema.py), an Optuna trial's reports and pruning
(trial.py, with pruners.py: the pruners by name, read before Lightning is imported). May import devices/; not the
objectives, the module or run/ (a callback reads the module through Lightning's hooks)."""
