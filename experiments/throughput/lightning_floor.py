"""The floor of Lightning's per-step cost on the digits ViT: a bare LightningModule (the model, cross-entropy, fused
AdamW, a per-step LR scheduler; no logger, callbacks, metrics, checkpoints, progress bar) against the same loop
written by hand, in alternating rounds; the median step time of each, the first epoch of every run left out.

    python experiments/throughput/lightning_floor.py            # automatic optimization (what vitlab.train uses)
    python experiments/throughput/lightning_floor.py --manual   # manual optimization (manual_backward, opt.step())

benchmark.task=overhead measures vitlab.train itself against the same hand-written loop; this says how much of that
ratio is Lightning's own (README.md, issue 57 point 4).
"""

import argparse
import logging
import statistics
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F

from vitlab.model import ViT, ViTConfig

CFG = ViTConfig(img_size=8, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=4, num_heads=4)


class Timer(L.Callback):
    def __init__(self):
        self.steps: list[list[float]] = []

    def on_train_epoch_start(self, *args):
        self.last = time.perf_counter()
        self.steps.append([])

    def on_train_batch_end(self, *args):
        now = time.perf_counter()
        self.steps[-1].append(now - self.last)
        self.last = now


class Bare(L.LightningModule):
    def __init__(self, manual: bool):
        super().__init__()
        self.model = ViT(CFG)
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.lr_schedulers().step()
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


def lightning(data, epochs: int, manual: bool) -> list[float]:
    timer = Timer()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer], num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Bare(manual), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return [s for epoch in timer.steps[1:] for s in epoch[1:]]


def plain(data, epochs: int) -> list[float]:
    model = ViT(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    steps = []
    for epoch in range(epochs):
        last = time.perf_counter()
        for i, (x, y) in enumerate(data):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            now = time.perf_counter()
            if epoch and i:
                steps.append(now - last)
            last = now
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manual", action="store_true")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    data = [(torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))) for _ in range(20)]  # the digits' shapes
    times: dict[str, list[float]] = {"lightning": [], "plain": []}
    for r in range(args.rounds):
        for name in ("lightning", "plain") if r % 2 == 0 else ("plain", "lightning"):
            times[name] += lightning(data, 3, args.manual) if name == "lightning" else plain(data, 3)
    light, hand = statistics.median(times["lightning"]), statistics.median(times["plain"])
    kind = "manual" if args.manual else "automatic"
    print(f"bare Lightning ({kind} optimization) {light * 1e3:.3f} ms, plain {hand * 1e3:.3f} ms: {light / hand:.3f}")


if __name__ == "__main__":
    main()
