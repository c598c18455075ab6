"""Images as they are, measured (issue 65, point 5): scikit-learn's 8x8 digits, drawn 2x on canvases of three aspect
ratios (16x48 wide, 16x16, 48x16 tall) at a random place along the long side, classified by the same NaFlex ViT fed
three ways at the same tokens per step (16 patches of 4x4 px an image, batch 64):

- naflex: each canvas resized, aspect kept, to the most 4x4 patches within 16 (timm's ResizeToSequence, vitlab's
  data/naflex.py eval transform), padded to 16 and masked;
- square: each canvas squashed to 16x16 (the whole digit, its aspect lost);
- crop: the centre square of each canvas, resized to 16x16 (aspect kept, a wide or tall canvas's digit often cut).

Then the CPU's training throughput (valid and padded tokens a second) and NaFlex's padding waste per seq_lens setting.
Writes results.json and naflex.png beside this file.

    python experiments/naflex/study.py [--epochs 40] [--seeds 0 1 2]
    python experiments/naflex/study.py --tokens --device cuda   # B/16, 256 tokens, batch 256 (GPU point naflex_tokens)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitlab.data.naflex import eval_transform
from vitlab.model import ViT, ViTConfig
from vitlab.model.naflex import patchify

HERE = Path(__file__).parent
CANVASES = [(16, 48), (16, 16), (48, 16)]  # (h, w): 1:3 wide... as h x w: wide, square, tall
SEQ, P, BATCH = 16, 4, 64
MODEL = dict(img_size=16, patch_size=P, in_chans=1, num_classes=10, embed_dim=64, depth=4, num_heads=4, naflex=True,
             class_token=False, reg_tokens=0, global_pool="avg", pos_embed_grid_size=(4, 4))  # fmt: skip


def canvases(seed: int = 0):
    """(uint8 canvases (1, h, w), labels, aspect index) of every digit, its canvas by its index mod 3."""
    from sklearn.datasets import load_digits  # (here: the GPU point, --tokens, needs no scikit-learn)

    digits = load_digits()
    rng = np.random.default_rng(seed)
    out = []
    for i, img in enumerate(digits.images):
        h, w = CANVASES[i % 3]
        digit = np.kron(img * 255 / 16, np.ones((2, 2))).astype(np.uint8)  # 16x16
        canvas = np.zeros((h, w), np.uint8)
        y, x = rng.integers(0, h - 15), rng.integers(0, w - 15)
        canvas[y : y + 16, x : x + 16] = digit
        out.append(torch.from_numpy(canvas)[None])
    return out, torch.as_tensor(digits.target), torch.arange(len(out)) % 3


def as_inputs(images, way: str, seq: int = SEQ, patch: int = P) -> dict | torch.Tensor:
    """A list of canvases -> the model's NaFlex dict (every patch valid for square and crop), or for square_images the
    squares as an image batch (no mask: attention's fastest kernels). A square has as many patches as `seq`'s root."""
    if way == "naflex":
        items = [eval_transform(seq, (patch, patch))(img) for img in images]
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        batch["patches"] = batch["patches"].float().div(255).sub(0.5).div(0.5)
        return batch
    side, xs = math.isqrt(seq) * patch, []
    for img in images:
        x = img.float()[None] / 255
        if way == "crop":
            h, w = x.shape[-2:]
            s = min(h, w)
            x = x[..., (h - s) // 2 : (h - s) // 2 + s, (w - s) // 2 : (w - s) // 2 + s]
        x = F.interpolate(x, size=(side, side), mode="bicubic", antialias=True, align_corners=False)
        xs.append(x.clamp(0, 1))
    if way == "square_images":
        return (torch.cat(xs) - 0.5) / 0.5
    patches, (gh, gw) = patchify((torch.cat(xs) - 0.5) / 0.5, (patch, patch))
    y, x = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    coord = torch.stack([y.flatten(), x.flatten()], -1).expand(len(xs), -1, -1)
    return {"patches": patches, "patch_coord": coord, "patch_valid": torch.ones(len(xs), gh * gw, dtype=torch.bool)}


def take(batch: dict | torch.Tensor, idx) -> dict | torch.Tensor:
    return {k: v[idx] for k, v in batch.items()} if isinstance(batch, dict) else batch[idx]


def train_one(data, train_idx, test_idx, labels, aspects, seed: int, epochs: int) -> dict:
    torch.manual_seed(seed)
    model = ViT(ViTConfig(**MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    steps = epochs * math.ceil(len(train_idx) / BATCH)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    valid_tokens, start = 0, time.perf_counter()
    for _ in range(epochs):
        order = train_idx[torch.randperm(len(train_idx), generator=g)]
        for k in range(0, len(order), BATCH):
            idx = order[k : k + BATCH]
            batch = take(data, idx)
            loss = F.cross_entropy(model(batch), labels[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            valid_tokens += int(batch["patch_valid"].sum())
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        pred = model(take(data, test_idx)).argmax(-1)
    right = pred == labels[test_idx]
    per_aspect = {name: float(right[aspects[test_idx] == a].float().mean()) for a, name in enumerate(ASPECT_NAMES)}
    padded = steps * BATCH * SEQ * len(train_idx) / (math.ceil(len(train_idx) / BATCH) * BATCH)
    return {"acc": float(right.float().mean()), "per_aspect": per_aspect, "seconds": seconds,
            "tokens_per_s": padded / seconds, "valid_tokens_per_s": valid_tokens / seconds}  # fmt: skip


ASPECT_NAMES = ("3:1 wide", "1:1", "1:3 tall")


def padding_waste(images, budgets=((16,), (36,), (64,), (16, 36, 64))) -> dict:
    """The share of padded tokens when every canvas is resized to each budget of a seq_lens setting (uniform draw)."""
    out = {}
    for lens in budgets:
        waste = []
        for n in lens:
            valid = torch.stack([eval_transform(n, (P, P))(img)["patch_valid"] for img in images]).float()
            waste.append(1 - valid.mean().item())
        out[str(list(lens))] = float(np.mean(waste))
    return out


def throughput(images, rounds: int = 3, steps: int = 10, model=None, ways=("naflex", "square", "crop"), seq: int = SEQ,
               patch: int = P, batch: int = BATCH, device: str = "cpu") -> dict:  # fmt: skip
    """Training tokens a second of each way on the same batches, the ways interleaved round by round (a shared
    machine's load falls on all three alike): the median over rounds of padded and valid tokens a second. On a GPU in
    bf16 autocast, after an untimed round (kernel choices, the allocator)."""
    torch.manual_seed(0)
    model = (model or ViT(ViTConfig(**MODEL))).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randperm(len(images))[: steps * batch].view(steps, batch)
    data = {way: as_inputs(images, way, seq, patch) for way in ways}
    tokens = {way: idx.numel() * (d["patches"].shape[1] if isinstance(d, dict) else (d.shape[-1] // patch) ** 2)
              for way, d in data.items()}  # fmt: skip
    valid = {way: float(d["patch_valid"][idx].sum()) if isinstance(d, dict) else tokens[way] for way, d in data.items()}
    data = {
        way: {k: v.to(device) for k, v in d.items()} if isinstance(d, dict) else d.to(device) for way, d in data.items()
    }
    cuda = device.startswith("cuda")
    amp = torch.autocast("cuda", torch.bfloat16) if cuda else contextlib.nullcontext()
    rates = {way: [] for way in data}
    for r in range(rounds + cuda):
        for way, d in data.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for batch_idx in idx:
                with amp:
                    loss = model(take(d, batch_idx)).float().logsumexp(-1).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if r >= cuda:
                rates[way].append((tokens[way] / seconds, valid[way] / seconds))
    return {way: {"tokens_per_s": float(np.median([r[0] for r in v])),
                  "valid_tokens_per_s": float(np.median([r[1] for r in v]))} for way, v in rates.items()}  # fmt: skip


def tokens_at_size(args) -> dict:
    """The GPU point `naflex_tokens` (experiments/gpu/points.py): training tokens a second of `args.model` (a timm
    naflexvit name, through vitlab.create_model) on `args.device`, NaFlex's padded batches of `args.seq` patches
    against the same tokens as squares, fed as NaFlex's dict (the attention mask, nothing padded) and as images (no
    mask). Canvases of random pixels in the study's three shapes, scaled so a square holds `seq` patches."""
    import vitlab

    kwargs = {k: int(v) for k, v in (kv.split("=") for kv in args.model_kwargs.split(",") if kv)}
    model = vitlab.create_model(args.model, pretrained=False, num_classes=10, **kwargs)
    patch = model.cfg.patch_hw[0]
    side, g = math.isqrt(args.seq) * patch, torch.Generator().manual_seed(0)
    shapes = [(side * h // 16, side * w // 16) for h, w in CANVASES]
    images = [torch.randint(0, 256, (3, *shapes[i % 3]), generator=g, dtype=torch.uint8)
              for i in range(args.steps * args.batch)]  # fmt: skip
    ways = ("naflex", "square", "square_images")
    rates = throughput(images, args.rounds, args.steps, model, ways, args.seq, patch, args.batch, args.device)
    return {"naflex_tokens": rates, "model": args.model, "model_kwargs": kwargs, "seq": args.seq,
            "batch": args.batch, "steps": args.steps, "rounds": args.rounds, "device": args.device,
            "padding": 1 - rates["naflex"]["valid_tokens_per_s"] / rates["naflex"]["tokens_per_s"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--throughput-only", action="store_true", help="add the interleaved timing to results.json")
    ap.add_argument("--tokens", action="store_true", help="tokens/s at --model's size on --device (GPU point)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="naflexvit_base_patch16_gap")
    ap.add_argument("--model-kwargs", default="", help="k=v,... for create_model (the dry run's tiny sizes)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.tokens:  # one JSON line (experiments/gpu/points.py reads it)
        print(json.dumps(tokens_at_size(args)), flush=True)
        return
    torch.set_num_threads(1)
    images, labels, aspects = canvases()
    if args.throughput_only:
        results = json.loads((HERE / "results.json").read_text())
        results["throughput"] = throughput(images)
        (HERE / "results.json").write_text(json.dumps(results, indent=1))
        print(results["throughput"])
        return
    from sklearn.model_selection import train_test_split

    train_idx, test_idx = train_test_split(np.arange(len(images)), test_size=0.2, stratify=labels, random_state=0)
    train_idx, test_idx = torch.as_tensor(train_idx), torch.as_tensor(test_idx)
    results = {"epochs": args.epochs, "seeds": args.seeds, "runs": {}, "padding_waste": padding_waste(images)}
    for way in ("naflex", "square", "crop"):
        data = as_inputs(images, way)
        results["runs"][way] = [
            train_one(data, train_idx, test_idx, labels, aspects, s, args.epochs) for s in args.seeds
        ]
        accs = [r["acc"] for r in results["runs"][way]]
        print(f"{way}: acc {np.mean(accs):.4f} +- {np.std(accs):.4f}", flush=True)
    results["throughput"] = throughput(images)
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    plot(results)


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ways = list(results["runs"])
    for k, way in enumerate(ways):
        runs = results["runs"][way]
        means = [np.mean([r["per_aspect"][a] for r in runs]) for a in ASPECT_NAMES]
        ax.bar(np.arange(3) + (k - 1) * 0.27, means, 0.27, label=way)
    ax.set_xticks(range(3), ASPECT_NAMES)
    ax.set_ylim(0.0, 1.0)
    ax.set_ylabel("test accuracy")
    ax.set_title(f"digits on canvases, 16 tokens an image, {results['epochs']} epochs, {len(results['seeds'])} seeds")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "naflex.png", dpi=120)


if __name__ == "__main__":
    main()
