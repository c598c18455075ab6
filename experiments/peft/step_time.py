"""The time of one training step (forward, backward, AdamW) of each way of fine-tuning the study's start, on a batch
of 64 digits (random pixels: the time does not depend on them), the fastest of 30 steps after 5 warm-up steps (the least disturbed by other processes on a shared machine), measured
in one process: `python experiments/peft/step_time.py <base checkpoint>`."""

import sys
import time

import torch

from vitlab.convert.source import resolve
from vitlab.training.adapters import plan_peft
from vitlab.training.module import ViTModule
from vitlab.training.optim import OptimConfig, make_optimizer

METHODS = {
    "full": None,
    "lora_r4": {"method": "lora", "rank": 4},
    "lora_r16": {"method": "lora", "rank": 16},
    "dora": {"method": "dora", "rank": 4},
    "bitfit": {"method": "bitfit"},
    "last2": {"method": "partial", "blocks": 2},
    "probe": {"method": "partial", "blocks": 0},
}


def step_ms(base: str, peft: dict | None) -> float:
    weights = resolve(base)
    hparams = torch.load(base, weights_only=True, map_location="cpu")["hyper_parameters"]
    module = ViTModule(hparams["model"], peft=plan_peft(peft, weights, None) if peft else None)
    if peft is None:
        weights.load_into(module.model)
    model = module.model.train()
    opt = make_optimizer(model, OptimConfig.from_dict({}))
    x, y = torch.randn(64, model.cfg.in_chans, *model.cfg.img_hw), torch.randint(0, model.cfg.num_classes, (64,))
    times = []
    for i in range(35):
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 5:
            times.append(time.perf_counter() - start)
    return 1000 * min(times)


if __name__ == "__main__":
    torch.manual_seed(0)
    for name, peft in METHODS.items():
        print(f"{name}: {step_ms(sys.argv[1], peft):.1f} ms/step")
