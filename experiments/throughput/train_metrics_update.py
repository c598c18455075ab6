"""The CPU time of one training step's metric update (ViTModule.update_metrics("train", ...): the epoch's mean loss and
top-1 accuracy) at the digits default's shapes (batch 64, 10 classes), by `time.process_time`, which other processes
on a shared machine move far less than the wall clock. Run it once per source tree to compare two versions:

    PYTHONPATH=src python experiments/throughput/train_metrics_update.py
    PYTHONPATH=/path/to/other/checkout/src python experiments/throughput/train_metrics_update.py

The step it sits in (benchmark.task=overhead) takes 11-17 ms of CPU on the 2-core machine (README.md).
"""

import time

import torch

from vitlab.model import ViTConfig
from vitlab.training.module import ViTModule

CALLS, REPEATS = 5000, 7


def main() -> None:
    torch.set_num_threads(1)
    cfg = ViTConfig(img_size=8, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=1, num_heads=4)
    module = ViTModule(model=cfg.to_dict())
    loss, logits, y = torch.tensor(1.3), torch.randn(64, 10), torch.randint(0, 10, (64,))
    for _ in range(500):  # warm-up
        module.update_metrics("train", loss, logits, y)
    per_call = []
    for _ in range(REPEATS):
        start = time.process_time()
        for _ in range(CALLS):
            module.update_metrics("train", loss, logits, y)
        per_call.append((time.process_time() - start) / CALLS * 1e6)
    per_call.sort()
    print(f"update_metrics('train'): {per_call[0]:.1f} us of CPU a call (min of {REPEATS}), median {per_call[3]:.1f}")


if __name__ == "__main__":
    main()
