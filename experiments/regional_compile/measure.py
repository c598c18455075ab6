"""Compile time of compile=true (the whole model, one graph) against compile=regional (each block, one shared graph)
at depth 4, 12 and 24 (README.md). Each (depth, mode) runs in a fresh process with Inductor's caches off, so every
compilation is done from scratch: the time of the first training step (forward and backward, where Dynamo and
Inductor compile) minus the median of the next 5 (the compiled step itself), and the graphs Dynamo captured.

    python experiments/regional_compile/measure.py                       # CPU, writes results_cpu.json
    python experiments/regional_compile/measure.py --device cuda --dim 768 --heads 12 --img 224 --patch 16
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one(args: argparse.Namespace) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from vitlab.model import ViT, ViTConfig

    torch.manual_seed(0)
    cfg = ViTConfig(img_size=args.img, patch_size=args.patch, num_classes=10, embed_dim=args.dim, depth=args.depth,
                    num_heads=args.heads, drop_path_rate=0.1)  # fmt: skip
    model = ViT(cfg).to(args.device).train()
    for region in model.blocks if args.mode == "regional" else [model]:
        region.compile()
    x = torch.randn(args.batch, 3, args.img, args.img, device=args.device)

    def step() -> float:
        start = time.perf_counter()
        model(x).square().mean().backward()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    first = step()
    steady = statistics.median(step() for _ in range(5))
    return {"depth": args.depth, "mode": args.mode, "compile_s": first - steady, "step_s": steady,
            "graphs": counters["stats"]["unique_graphs"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--depths", default="4,12,24")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--img", type=int, default=32)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--depth", type=int)
    p.add_argument("--mode")
    p.add_argument("--out", type=Path, help="the results file (default: results_<device>.json beside this script)")
    args = p.parse_args()
    if args.mode:  # one measurement, in this (fresh) process
        print(json.dumps(one(args)))
        return
    env = os.environ | {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    rows = []
    for depth in map(int, args.depths.split(",")):
        for mode in ("whole", "regional"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--depth", str(depth), "--mode", mode]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    device = args.device.split(":")[0]
    out = args.out or Path(__file__).parent / f"results_{device}.json"
    args.out = str(out)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
