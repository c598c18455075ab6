"""A fit assembled from a config, the top floor of vitlab.training: every node checked before anything is built
(node_checks.py), the run's plan and its decisions (plan.py), the data module, module, callbacks, loggers and Trainer
built (build.py), where training starts from: a checkpoint, a resume or pretrained weights (resume.py), and
data.batch_size=auto (auto_batch.py). May import everything else in vitlab.training; the commands (vitlab/train.py,
eval.py, ...) and vitlab.evaluation import it."""
