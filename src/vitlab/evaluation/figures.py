"""Figures of a ViT and its training: attention maps and rollout over an image, position-embedding
similarity and patch-filter components (ViT paper, Figure 7), learning curves from a run's CSV log.
Library code (no Hydra): `python -m vitlab.visualize` and the studies in experiments/ call it."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from vitlab.model import ViT
from vitlab.utils.errors import MissingFileError


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def attention_rollout(maps: list[torch.Tensor]) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020): average the heads, add the residual as 0.5*(A + I),
    renormalise the rows, multiply through the blocks. (B, N, N) with rows summing to 1."""
    n = maps[0].shape[-1]
    eye = torch.eye(n, device=maps[0].device)
    rollout = eye.expand(maps[0].shape[0], n, n)
    for a in maps:
        a = 0.5 * a.mean(dim=1) + 0.5 * eye
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a @ rollout
    return rollout


def _to_display(x: torch.Tensor, mean, std) -> torch.Tensor:
    """A normalised (C, H, W) input back to a (H, W) or (H, W, 3) image in [0, 1]."""
    img = x * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    img = img.clamp(0, 1)
    return img[0] if img.shape[0] == 1 else img[:3].permute(1, 2, 0)


def _patch_map(row: torch.Tensor, model: ViT, hw: tuple[int, int]):
    """Attention of one query over the patch tokens -> a (H, W) map upsampled to the image."""
    gh, gw = model.cfg.grid_size
    patches = row[model.num_prefix_tokens :].reshape(1, 1, gh, gw)
    return F.interpolate(patches, size=hw, mode="nearest")[0, 0].numpy()


def plot_attention(model: ViT, x: torch.Tensor, mean, std, out_dir: Path) -> dict[str, Path]:
    """Patch grid, last-block class-token attention per head, and rollout, for one image (1, C, H, W)."""
    plt = _pyplot()
    model.eval()
    maps = model.attention_maps(x)
    img = _to_display(x[0], mean, std).numpy()
    hw = tuple(x.shape[-2:])
    ph, pw = model.cfg.patch_hw
    cmap = "gray" if img.ndim == 2 else None
    # The class token's row; without one, the mean over all queries.
    query = (lambda a: a[0]) if model.cfg.class_token else (lambda a: a.mean(dim=0))
    files = {}

    fig, ax = plt.subplots(figsize=(4, 4))
    ax.imshow(img, cmap=cmap)
    for k in range(0, hw[0] + 1, ph):
        ax.axhline(k - 0.5, color="y", lw=0.8)
    for k in range(0, hw[1] + 1, pw):
        ax.axvline(k - 0.5, color="y", lw=0.8)
    ax.set(title=f"{model.cfg.grid_size[0]}x{model.cfg.grid_size[1]} patches of {ph}x{pw}", xticks=[], yticks=[])
    files["patch_grid"] = _save(fig, out_dir / "patch_grid.png")

    last = maps[-1][0]  # (heads, N, N)
    heads = last.shape[0]
    fig, axes = plt.subplots(1, heads, figsize=(3 * heads, 3), squeeze=False)
    for h, ax in enumerate(axes[0]):
        ax.imshow(img, cmap=cmap)
        ax.imshow(_patch_map(query(last[h]), model, hw), alpha=0.6, cmap="inferno")
        ax.set(title=f"head {h}", xticks=[], yticks=[])
    fig.suptitle("last block: class-token attention per head")
    files["attention_heads"] = _save(fig, out_dir / "attention_heads.png")

    rollout = attention_rollout(maps)[0]
    fig, axes = plt.subplots(1, 2, figsize=(6, 3))
    axes[0].imshow(img, cmap=cmap)
    axes[1].imshow(img, cmap=cmap)
    axes[1].imshow(_patch_map(query(rollout), model, hw), alpha=0.6, cmap="inferno")
    for ax, title in zip(axes, ("input", f"attention rollout over {len(maps)} blocks"), strict=True):
        ax.set(title=title, xticks=[], yticks=[])
    files["attention_rollout"] = _save(fig, out_dir / "attention_rollout.png")
    return files


def plot_embeddings(model: ViT, out_dir: Path) -> dict[str, Path]:
    """Position-embedding similarity (paper Fig. 7 centre) and patch-filter principal components (left)."""
    plt = _pyplot()
    files = {}
    gh, gw = model.cfg.grid_size
    if model.pos_embed is not None:
        pe = model.pos_embed[0].detach()
        pe = pe[-gh * gw :]  # the patch rows (prefix rows, when present, come first)
        pe = F.normalize(pe, dim=-1)
        sim = (pe @ pe.T).reshape(gh, gw, gh, gw).numpy()
        fig, axes = plt.subplots(gh, gw, figsize=(max(3.0, 1.2 * gw), max(3.0, 1.2 * gh)), squeeze=False)
        for i in range(gh):
            for j in range(gw):
                axes[i][j].imshow(sim[i, j], vmin=-1, vmax=1, cmap="viridis")
                axes[i][j].set(xticks=[], yticks=[])
        fig.suptitle("position embedding similarity")
        files["pos_embed_similarity"] = _save(fig, out_dir / "pos_embed_similarity.png")
    w = model.patch_embed.proj.weight.detach()  # (D, C, Ph, Pw)
    d, c, ph, pw = w.shape
    flat = w.reshape(d, -1)
    _, _, vt = torch.linalg.svd(flat - flat.mean(0), full_matrices=False)
    k = min(28, vt.shape[0])
    fig, axes = plt.subplots(4, 7, figsize=(7, 4), squeeze=False)
    for idx, ax in enumerate(axes.flat):
        ax.set(xticks=[], yticks=[])
        if idx >= k:
            ax.axis("off")
        else:
            comp = vt[idx].reshape(c, ph, pw)
            comp = (comp - comp.min()) / (comp.max() - comp.min() + 1e-12)
            ax.imshow((comp[0] if c == 1 else comp[:3].permute(1, 2, 0)).numpy(), cmap="gray" if c == 1 else None)
    fig.suptitle(f"patch-embedding filters: first {k} principal components")
    files["patch_filters"] = _save(fig, out_dir / "patch_filters.png")
    return files


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def read_csv_log(run_dir: Path) -> dict[str, list[tuple[float, float]]]:
    """Every logged series of a run's CSVLogger file as (epoch or step, value) pairs."""
    path = Path(run_dir) / "csv" / "metrics.csv"
    if not Path(run_dir).is_dir():
        what = "is a file, not a run directory" if Path(run_dir).exists() else "does not exist"
        raise MissingFileError(f"run_dir {str(run_dir)!r} {what}: give the run directory a training run printed")
    if not path.is_file():
        raise MissingFileError(f"run_dir {str(run_dir)!r} has no csv/metrics.csv (train with logger=csv or many)")
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with path.open() as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key in ("epoch", "step") or value in ("", None):
                    continue
                x = row["step"] if key.startswith("lr-") or key.endswith("_step") else row["epoch"]
                if x not in ("", None):
                    series[key].append((float(x), float(value)))
    return series


def plot_learning_curves(run_dir: str | Path, out: str | Path) -> Path:
    plt = _pyplot()
    s = read_csv_log(Path(run_dir))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key, label in (("train/loss", "train"), ("val/loss", "val")):
        if s.get(key):
            axes[0].plot(*zip(*s[key], strict=True), label=label)
    axes[0].set(title="loss", xlabel="epoch")
    for key, label in (("train/acc", "train"), ("val/acc", "val")):
        if s.get(key):
            axes[1].plot(*zip(*s[key], strict=True), label=label)
    if s.get("test/acc"):
        axes[1].axhline(s["test/acc"][-1][1], color="k", ls="--", lw=1, label=f"test {s['test/acc'][-1][1]:.4f}")
    axes[1].set(title="accuracy", xlabel="epoch")
    lr = next((k for k in sorted(s) if k.startswith("lr-")), None)
    if lr:
        axes[2].plot(*zip(*s[lr], strict=True))
    axes[2].set(title="learning rate", xlabel="step")
    for ax in axes[:2]:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


@torch.no_grad()
def plot_reconstructions(model, mae, images: torch.Tensor, mean, std, out: Path, seed: int = 0) -> Path:
    """MAE's figure: for each image (normalised, (B, C, H, W)) the original, what the encoder saw (masked patches
    grey), the decoder's prediction of every patch, and the prediction with the visible patches pasted back. With
    norm_pix_loss the decoder predicts each patch normalised by its own mean and variance: those two statistics are
    taken from the original patch to show it (as MAE's visualisations do)."""
    from vitlab.model.mae import patchify, unpatchify

    plt = _pyplot()
    cfg = model.cfg
    torch.manual_seed(seed)
    _, pred, mask = mae.reconstruct(model, images)
    target = patchify(images, cfg.patch_hw)
    if mae.cfg.norm_pix_loss:
        mu, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        pred = pred * (var + 1.0e-6) ** 0.5 + mu
    shape = (cfg.patch_hw, cfg.grid_size, cfg.in_chans)
    m = mask.unsqueeze(-1)
    panels = {
        "original": images,
        "masked": unpatchify(target * (1 - m), *shape),
        "prediction": unpatchify(pred, *shape),
        "prediction + visible": unpatchify(pred * m + target * (1 - m), *shape),
    }
    mean_t, std_t = (torch.tensor(v, dtype=images.dtype).view(1, -1, 1, 1) for v in (mean, std))
    n = images.shape[0]
    fig, axes = plt.subplots(n, len(panels), figsize=(1.6 * len(panels), 1.6 * n), squeeze=False)
    for j, (title, x) in enumerate(panels.items()):
        x = (x * std_t + mean_t).clamp(0, 1)
        if title == "masked":  # removed patches grey
            grey = unpatchify(m.expand_as(target) * 0.5, *shape)
            x = x + grey
        for i in range(n):
            ax = axes[i][j]
            img = x[i].permute(1, 2, 0).numpy()
            ax.imshow(
                img[..., 0] if cfg.in_chans == 1 else img, cmap="gray" if cfg.in_chans == 1 else None, vmin=0, vmax=1
            )
            ax.set(xticks=[], yticks=[])
            if i == 0:
                ax.set_title(title, fontsize=8)
    fig.suptitle(f"MAE reconstructions (mask ratio {mae.cfg.mask_ratio})", fontsize=9)
    return _save(fig, out)
