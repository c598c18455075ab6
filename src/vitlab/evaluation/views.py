"""What training shows the model (`python -m vitlab.visualize what=views`): the views a data module and an objective
make of a few training images, as a picture (each image with its crops' boxes, then the views) and as `views.json`
(every crop's box in the source image's pixels, x0, y0, x1, y1, and the size it is resized to), so that a user can
see them and a test can check them.

- objective=dino: its multi-crop views, cut from each whole image in the loader's workers (photos) or from the image's
  square on the device (data held at one size: the boxes mapped back to the image through the resize and centre crop)
  (data/image_views.py, data/multicrop.py);
- objective=classify | distill: the training transform's random resized crop (the whole image where there is none);
- objective=mae: that crop, and the patches MAE's random masking removes from it (model/mae.py `random_masking`, the
  draw its encoder makes: `mask_ratio` of the patches), greyed in the picture and listed in `masked_patches`.

`draws`: each image's views drawn that many times (the picture shows the first). No Hydra here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from torchvision.transforms import v2 as T

from vitlab.data.image_views import ImageViews, square_box
from vitlab.model.mae import random_masking
from vitlab.training.module import OBJECTIVES
from vitlab.utils.errors import UserError

# How an objective makes its training views (its class's `views`), in the order what=views names the objectives.
VIEW_KINDS = ("multicrop", "crop", "masked")


def view_kind(objective: str) -> str:
    """How objective=`objective` makes its training views (training.objectives.objective.Objective.views), or a
    UserError naming the objectives whose views are drawn."""
    if objective not in OBJECTIVES:
        drawn = sorted(OBJECTIVES, key=lambda name: VIEW_KINDS.index(OBJECTIVES[name].views))
        raise UserError(f"what=views draws the views of objective={'|'.join(drawn)}, not objective={objective}")
    return OBJECTIVES[objective].views


def training_views(
    dm: Any, objective: str, index: int, seed: int, mae: tuple[int, float] | None = None
) -> list[dict[str, Any]]:
    """The views of training image `index` of `dm` (set up) under `objective`, drawn from `seed`: each a dict of
    `image` (float (C, h, w) in [0, 1]), `box` [x0, y0, x1, y1] in the source image's pixels and `size` [h, w];
    objective=mae (`mae`: the model's patch size and the objective's mask_ratio) adds `masked_patches`."""
    kind = view_kind(objective)
    split = dm.train_set
    img, _ = split.base[split.indices[index]]
    img = T.ToImage()(img).as_subclass(torch.Tensor)
    torch.manual_seed(seed)
    random.seed(seed)
    if isinstance(dm.train_tf, ImageViews):  # photos: cut from the whole image in the workers
        return [
            {"image": v.float() / 255, "box": info["box"], "size": info["size"], "flip": info["flip"]}
            for v, info in dm.train_tf.cut(img)
        ]
    if kind == "multicrop":  # on the device, from the image's square
        return _device_views(dm, img, seed)
    if dm.size_schedule is not None and (view := dm.size_schedule.training_view(img)) is not None:
        return [view]  # a schedule that crops each image its own way (NaFlex's, at a drawn sequence length)
    view = _classifier_view(dm.train_tf, img)
    return [_masked(view, *mae) if kind == "masked" else view]


def _masked(view: dict[str, Any], patch: tuple[int, int], mask_ratio: float) -> dict[str, Any]:
    """The crop with the patches (`patch`: height, width) MAE's encoder does not see greyed (its random_masking,
    `mask_ratio` of them)."""
    (h, w), image, (ph, pw) = view["size"], view["image"].clone(), patch
    gw, n = w // pw, (h // ph) * (w // pw)
    kept, _ = random_masking(1, n, int(n * (1 - mask_ratio)))  # as encode_visible keeps them
    masked = sorted(set(range(n)) - set(kept[0].tolist()))
    for k in masked:
        r, c = divmod(k, gw)
        image[:, r * ph : (r + 1) * ph, c * pw : (c + 1) * pw] = 0.5
    return view | {"image": image, "masked_patches": masked, "patch": ph if ph == pw else [ph, pw]}


def _device_views(dm: Any, img: torch.Tensor, seed: int) -> list[dict[str, Any]]:
    crop, square = dm.views.crop, dm.train_tf(img).as_subclass(torch.Tensor)
    x, g = square[None].float() / 255, torch.Generator().manual_seed(seed)
    out = []
    for size, scale, which in crop.views():
        d = crop.draw(1, x.shape[-2:], scale, which, g)
        top, left, h, w = d["boxes"][0].tolist()
        box = square_box(tuple(img.shape[-2:]), crop.source_size, [left, top, left + w, top + h])
        view = crop.apply(x, size, which, d)[0]
        out.append({"image": view, "box": [round(v, 2) for v in box], "size": [size, size], "flip": bool(d["flip"])})
    return out


def _classifier_view(pipeline: T.Compose, img: torch.Tensor) -> dict[str, Any]:
    """The training pipeline op by op, its RandomResizedCrop's box recorded (torchvision's make_params)."""
    H, W = img.shape[-2:]
    box, x = [0, 0, W, H], img
    for op in pipeline.transforms:
        if isinstance(op, T.RandomResizedCrop):
            p = op.make_params([x])
            box = [p["left"], p["top"], p["left"] + p["width"], p["top"] + p["height"]]
            x = op.transform(x, p)
        else:
            x = op(x)
    x = x.as_subclass(torch.Tensor)
    return {"image": x.float() / 255, "box": box, "size": list(x.shape[-2:])}


# views.json's own word on its numbers: sizes are [height, width] as torch's shapes, boxes x first as PIL's.
LAYOUT = "source_size and each view's size: [height, width]; box: [x0, y0, x1, y1] in the source image's pixels"


def draw_views(
    dm: Any, objective: str, num_images: int, draws: int, out_dir: Path, seed: int = 0, mae: tuple | None = None
) -> list[Path]:
    """views.png and views.json of the first `num_images` training images of `dm`, each drawn `draws` times
    (`mae`: objective=mae's patch size and mask ratio)."""
    dm.setup("fit")
    n = min(num_images, len(dm.train_set))
    record, first = [], []
    for i in range(n):
        split = dm.train_set
        img, _ = split.base[split.indices[i]]
        h, w = T.ToImage()(img).shape[-2:]
        runs = [training_views(dm, objective, i, seed * 1_000_003 + i * 1_000 + k, mae) for k in range(draws)]
        first.append((T.ToImage()(img).as_subclass(torch.Tensor), runs[0]))
        strip = [[{k: v for k, v in view.items() if k != "image"} for view in run] for run in runs]
        record.append({"index": i, "source_size": [int(h), int(w)], "draws": strip})
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {"objective": objective, "data": type(dm).__name__, "path": _path(dm, objective), "layout": LAYOUT,
            "images": record}  # fmt: skip
    (out_dir / "views.json").write_text(json.dumps(info, indent=1))
    return [_plot(first, out_dir / "views.png"), out_dir / "views.json"]


def _path(dm: Any, objective: str) -> str:
    if isinstance(dm.train_tf, ImageViews):
        return "workers: cut from each whole image"
    kind = view_kind(objective)
    if kind == "masked":
        return "workers: the training transform; the encoder's patch mask drawn as model/mae.py random_masking"
    return "device: cut from each image's square" if kind == "multicrop" else "workers: the training transform"


def _plot(first: list, path: Path) -> Path:
    from vitlab.evaluation.figures import _pyplot, _save

    plt = _pyplot()
    cols = 1 + max(len(views) for _, views in first)
    fig, axes = plt.subplots(len(first), cols, figsize=(2 * cols, 2 * len(first)), squeeze=False)
    for row, (img, views) in zip(axes, first, strict=True):
        row[0].imshow(_hwc(img.float() / 255), cmap="gray")
        for k, view in enumerate(views):
            x0, y0, x1, y1 = view["box"]
            colour = "red" if k < 2 else "yellow"
            row[0].add_patch(plt.Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, color=colour, linewidth=1))
            row[k + 1].imshow(_hwc(view["image"]), cmap="gray")
        for ax in row:
            ax.axis("off")
    return _save(fig, path)


def _hwc(x: torch.Tensor):
    x = x.clamp(0, 1).permute(1, 2, 0).numpy()
    return x[..., 0] if x.shape[-1] == 1 else x
