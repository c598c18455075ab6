"""A fit assembled from a run's plan, the top floor of vitlab.training: the plan's value (plan.py; vitlab.cli.plans
makes it from the config, once) and the run's steps that read it (steps.py), the data module, module, callbacks and
Trainer built (build.py), the loggers and their lifecycle (loggers.py), Lightning's work-arounds (workarounds.py),
where training starts from: a checkpoint, a resume or pretrained weights (resume.py), and data.batch_size=auto
(auto_batch.py). May import everything else in vitlab.training; the commands (vitlab/train.py, eval.py, ...),
vitlab.cli and vitlab.evaluation import it."""
