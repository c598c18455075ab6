"""vitlab's RoPE model against timm's of the same name and weights on one CPU thread, each step timed by the thread's
CPU time (what other jobs on a shared machine disturb least), the two interleaved per round, their order alternating;
prints the medians, the fastest rounds and the median of the per-round ratios (timm's time over ours: above 1, ours
faster). The benchmark's contenders and steps (vitlab.benchmark.models), fp32, AdamW for train.

    python experiments/rope/cpu_time.py eva02_tiny_patch14_224 8 10
    python experiments/rope/cpu_time.py vit_small_patch16_dinov3 4 8
"""

import statistics
import sys
import time

import torch

from vitlab.benchmark.config import BenchmarkConfig
from vitlab.benchmark.models import build_contenders
from vitlab.convert.timm_args import config_from_timm
from vitlab.training.optim import OptimConfig


def main(name: str, batch: int, rounds: int) -> None:
    torch.set_num_threads(1)
    cfg = config_from_timm(name)
    torch.manual_seed(0)
    contenders = build_contenders(cfg, BenchmarkConfig(batch_size=batch), OptimConfig(), torch.device("cpu"))
    x, y = torch.randn(batch, 3, *cfg.img_hw), torch.randint(0, 10, (batch,))
    for mode in ("train", "infer"):
        for c in contenders:
            c.model.train(mode != "infer")
            for _ in range(2):
                c.step(mode, x, y)
        ms: dict[str, list[float]] = {c.name: [] for c in contenders}
        for r in range(rounds):
            for c in contenders if r % 2 == 0 else contenders[::-1]:
                start = time.thread_time()
                c.step(mode, x, y)
                ms[c.name].append((time.thread_time() - start) * 1e3)
        ours, theirs = ms["vitlab"], ms["timm"]
        paired = sorted(t / o for o, t in zip(ours, theirs, strict=True))
        print(
            f"{name} {cfg.img_hw} batch {batch} {mode}: ours {statistics.median(ours):.0f} ms (min {min(ours):.0f}), "
            f"timm {statistics.median(theirs):.0f} ms (min {min(theirs):.0f}); timm/ours per round: median "
            f"{statistics.median(paired):.3f} [{paired[0]:.2f}, {paired[-1]:.2f}]",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
