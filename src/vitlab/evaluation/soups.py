"""Model soups (Wortsman et al. 2022, "Model soups: averaging weights of multiple fine-tuned models improves accuracy
without increasing inference time"): the weights of fine-tunes from one pretrained start, averaged. The ingredients are
a -m sweep's jobs (`sweep_dir`), each job's best checkpoint (the one its run tested: metrics.json tested_checkpoint).

- uniform_soup: the mean of every ingredient.
- greedy_soup: the paper's Algorithm 1. The ingredients sorted by held-out validation accuracy, best first; the soup
  starts as the best; each next ingredient is added if the soup with it scores at least as well on validation as
  the soup without it (the paper's >=; the reference code, mlfoundations/model-soups main.py, adds on > only). So the
  soup's validation accuracy is never below its best ingredient's.

Means are convert.averaging's (float64, cast back). Every ingredient and candidate is scored on the validation split
of the best ingredient's data (the ingredients must share its split: the same data, split and image size), and the
soup on the test split once, at the end. `soup.json` lists the ingredients in their order with their validation
accuracy, each step of the greedy search, and the soup's scores.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from vitlab.convert.averaging import network_weights
from vitlab.convert.weights import read_checkpoint
from vitlab.utils.errors import MissingFileError, UserError

log = logging.getLogger(__name__)

# Data settings that choose which images are the validation and test splits: the ingredients must agree on them.
SPLIT_KEYS = ("_target_", "data_dir", "name", "config", "train_file", "val_file", "test_file", "val_split",
              "test_split", "val_fraction", "test_fraction", "split_seed", "folds", "fold", "img_size")  # fmt: skip


@dataclass
class Ingredient:
    job: str
    overrides: list[str]
    checkpoint: str
    start: str | None  # the weights it was fine-tuned from (model.pretrained)
    val_acc: float = float("nan")


def ingredients(sweep_dir: str) -> list[Ingredient]:
    """The finished jobs of a sweep and their best checkpoints; refused in one line where fewer than two finished,
    or where they did not all start from the same pretrained weights."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise MissingFileError(f"sweep_dir {sweep_dir!r} does not exist")
    found, skipped = [], []
    for job in sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        metrics = json.loads((job / "metrics.json").read_text()) if (job / "metrics.json").is_file() else {}
        best = metrics.get("tested_checkpoint")
        if not best or not Path(best).exists() or (job / "error.json").is_file():
            skipped.append(job.name)
            continue
        overrides = OmegaConf.to_container(OmegaConf.load(job / ".hydra" / "overrides.yaml"))
        config = OmegaConf.load(job / "config.yaml")
        found.append(Ingredient(job.name, overrides, best, OmegaConf.select(config, "model.pretrained")))
    if skipped:
        log.info("sweep jobs without a finished run and its tested checkpoint, left out: %s", ", ".join(skipped))
    if len(found) < 2:
        raise UserError(
            f"a soup needs at least two ingredients, and sweep_dir {sweep_dir!r} has {len(found)} finished "
            f"job{'s' * (len(found) != 1)} with a tested checkpoint; average more fine-tunes (a -m sweep of them)"
        )
    starts = {i.start for i in found}
    if len(starts) > 1 or None in starts:
        other = next(i for i in found if i.start != found[0].start) if len(starts) > 1 else found[0]
        raise UserError(
            f"soup ingredients are fine-tunes of one pretrained start (model.pretrained): job {found[0].job} started "
            f"from {found[0].start}, job {other.job} from {other.start}; soup the jobs of one start"
        )
    return found


def check_same_split(data: list[dict[str, Any]], jobs: list[str]) -> None:
    """The ingredients' stored data configs agree on which images validate and test (SPLIT_KEYS)."""
    for d, job in zip(data[1:], jobs[1:], strict=True):
        for key in SPLIT_KEYS:
            if d.get(key) != data[0].get(key):
                raise UserError(
                    f"soup ingredients are scored on one validation split: job {jobs[0]} has data.{key}="
                    f"{data[0].get(key)}, job {job} data.{key}={d.get(key)}"
                )


class Scorer:
    """Scores weights on the validation or test split of the best ingredient's data: top-1 accuracy and mean
    cross-entropy of the model's logits on the split's eval images (what vitlab.train logs as val/acc, val/loss), on
    `device`, with one module whose weights are replaced."""

    def __init__(self, best: str, device: str, read: dict[str, dict[str, Any]]):
        from vitlab.training.run import inference

        self.read = read  # each ingredient's checkpoint, by path, as the soup read it (once)
        self.module = inference.load_for_inference(best, ckpt=read[best])
        if not self.module.objective.uses_labels or not self.module.model.cfg.num_classes:
            raise UserError(f"a soup is chosen by validation accuracy, and {best!r} has no classifier to score")
        self.prefixes, self.device = self.module.network_prefixes, torch.device(device)
        self.datamodule = inference.inference_datamodule(self.module, best)
        self.datamodule.setup("test")

    def weights(self, path: str) -> dict[str, torch.Tensor]:
        return network_weights(self.read[path]["state_dict"], self.prefixes)

    @torch.no_grad()
    def __call__(self, weights: dict[str, torch.Tensor], split: str = "val") -> dict[str, float]:
        self.module.load_state_dict(weights, strict=False)
        model, dm = self.module.model.eval().to(self.device), self.datamodule
        hits, loss, n = 0, 0.0, 0
        for batch in dm.val_dataloader() if split == "val" else dm.test_dataloader():
            x, y = dm.device_transform(dm.transfer_batch_to_device(batch, self.device, 0), train=False)
            logits = model(x).float()  # (B, classes)
            loss += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            hits, n = hits + int((logits.argmax(-1) == y).sum()), n + len(y)
        return {f"{split}/acc": hits / n, f"{split}/loss": loss / n}


def _mean(total: dict[str, torch.Tensor], count: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """convert.averaging.mean_state_dict's cast of a float64 sum of `count` state dicts."""
    out = {}
    for k, v in like.items():
        t = total[k] / count
        info = torch.finfo(v.dtype) if v.is_floating_point() else torch.iinfo(v.dtype)
        t = t.clamp(info.min, info.max)
        out[k] = (t if v.is_floating_point() else t.round()).to(v.dtype)
    return out


def _add(total: dict[str, torch.Tensor] | None, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A float64 running sum of state dicts, in the order they are added (the same sums as mean_state_dict's)."""
    if total is None:
        return {k: v.detach().to(torch.float64).clone() for k, v in weights.items()}
    return {k: total[k] + weights[k].detach().to(torch.float64) for k in total}


def cook(method: str, found: list[Ingredient], score: Scorer) -> tuple[list[Ingredient], list[dict[str, Any]], dict]:
    """(the soup's ingredients, the greedy steps, the soup's validation metrics): every ingredient scored on
    validation, sorted best first, then the soup of `method` made and scored."""
    shared = set.intersection(*(set(i.overrides) for i in found))  # (the log names what sets each apart)
    for ing in found:
        ing.val_acc = score(score.weights(ing.checkpoint))["val/acc"]
        own = " ".join(o for o in ing.overrides if o not in shared)
        log.info("ingredient job %s (%s): val/acc %.4f", ing.job, own, ing.val_acc)
    found.sort(key=lambda i: -i.val_acc)  # stable: ties keep the sweep's order
    first = score.weights(found[0].checkpoint)
    total, soup, steps = _add(None, first), [found[0]], []
    if method == "uniform_soup":
        for ing in found[1:]:
            total = _add(total, score.weights(ing.checkpoint))
        soup = list(found)
        return soup, steps, score(_mean(total, len(soup), first))
    best = {"val/acc": found[0].val_acc}
    for ing in found[1:]:  # Algorithm 1: add if the soup's held-out accuracy does not drop
        candidate = _add(total, score.weights(ing.checkpoint))
        scores = score(_mean(candidate, len(soup) + 1, first))
        added = scores["val/acc"] >= best["val/acc"]
        steps.append({"job": ing.job, "soup_val/acc": scores["val/acc"], "added": added})
        log.info("greedy soup: with job %s val/acc %.4f (best so far %.4f): %s", ing.job, scores["val/acc"],
                 best["val/acc"], "added" if added else "left out")  # fmt: skip
        if added:
            total, best = candidate, scores
            soup.append(ing)
    if len(soup) == 1:
        best = score(first)
    return soup, steps, best


def make_soup(method: str, sweep_dir: str, device: str) -> tuple[dict, dict[str, Any]]:
    """(the soup's checkpoint, its soup.json record): the sweep's ingredients checked, scored, souped (`cook`),
    averaged from their files (convert.averaging) and the soup scored on the test split once."""
    from vitlab.convert.averaging import average_checkpoints, check_compatible

    found = ingredients(sweep_dir)
    read = {i.checkpoint: read_checkpoint(i.checkpoint) for i in found}  # once each (memory-mapped files)
    check_same_split([read[i.checkpoint]["hyper_parameters"].get("data") or {} for i in found], [i.job for i in found])
    score = Scorer(found[0].checkpoint, device, read)
    check_compatible([score.weights(i.checkpoint) for i in found], [f"job {i.job}" for i in found])
    soup, steps, val = cook(method, found, score)
    ckpt = average_checkpoints([i.checkpoint for i in soup], read=read)
    has_test = getattr(score.datamodule, "test_set", True) is not None  # (scored once, the soup alone)
    test = score(network_weights(ckpt["state_dict"], score.prefixes), "test") if has_test else {}
    ckpt["averaged"] |= {"method": method, "sweep_dir": str(Path(sweep_dir).resolve()), "jobs": [i.job for i in soup]}
    record = {
        "method": method,
        "sweep_dir": str(Path(sweep_dir).resolve()),
        "ingredients": [
            {"job": i.job, "overrides": i.overrides, "checkpoint": i.checkpoint, "val/acc": i.val_acc} for i in found
        ],  # fmt: skip
        "greedy_steps": steps,
        "soup": {"jobs": [i.job for i in soup], **val, **test},
    }
    return ckpt, record
