"""Evaluation of frozen features: extraction and cache (features.py), the probes (k-NN, linear, few-shot), the
tasks of `vitlab.eval task=knn|linear|fewshot` (tasks.py), the representation callback, and figures."""
