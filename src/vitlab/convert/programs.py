"""A ViT as a program that runs without our code: torch.export's ExportedProgram (.pt2) or ONNX.

The batch is dynamic; so are height and width when the model takes any size (`dynamic_img_size`):
multiples of the patch, or any size with `dynamic_img_pad`. Every file is checked before it is put in
place: the .pt2 program reloaded, the ONNX file run by onnxruntime, each against the PyTorch model on
several shapes (a difference over `atol` refuses the file). Written through a temporary directory and
renamed, so a crash or a refused check leaves no file behind.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from vitlab.model import ViT
from vitlab.utils.atomic import atomic_files
from vitlab.utils.errors import UserError
from vitlab.utils.logs import dropped

FORMATS = {".onnx": "onnx", ".pt2": "pt2"}


def dynamic_shapes(model: ViT) -> dict[str, dict[int, Any]]:
    """torch.export's dynamic dimensions of the input `x` (B, C, H, W). A grid of one patch is left out:
    export specialises sizes of 1."""
    Dim, (ph, pw) = torch.export.Dim, model.cfg.patch_hw
    shapes: dict[int, Any] = {0: Dim("batch", min=1, max=4096)}
    if model.cfg.dynamic_img_pad:
        shapes.update({2: Dim("height", min=2 * ph, max=8192), 3: Dim("width", min=2 * pw, max=8192)})
    elif model.cfg.dynamic_img_size:
        shapes.update({2: ph * Dim("grid_h", min=2, max=8192 // ph), 3: pw * Dim("grid_w", min=2, max=8192 // pw)})
    return {"x": shapes}


def check_shapes(model: ViT) -> list[tuple[int, ...]]:
    """The input shapes an exported file is checked on: the model's own size at two batch sizes, and when
    the size is dynamic, a larger and a non-square one (and one that needs padding)."""
    c, (h, w), (ph, pw) = model.cfg.in_chans, model.cfg.img_hw, model.cfg.patch_hw
    shapes = [(2, c, h, w), (1, c, h, w)]
    if model.cfg.dynamic_img_size:
        shapes += [(3, c, h + 2 * ph, w), (2, c, 2 * ph, w + 4 * pw)]
    if model.cfg.dynamic_img_pad:
        shapes.append((2, c, h + ph // 2 + 1, w + 1))
    return shapes


def export_program(model: ViT) -> torch.export.ExportedProgram:
    model = model.eval()
    x = torch.randn(2, model.cfg.in_chans, *model.cfg.img_hw, device=next(model.parameters()).device)
    return torch.export.export(model, (x,), dynamic_shapes=dynamic_shapes(model))


def export(model: ViT, path: str | Path, atol: float = 1e-4, metadata: dict[str, Any] | None = None) -> dict:
    """Write `model` to `path` (.onnx or .pt2) and check it; returns what was checked (shapes, largest
    difference). `metadata` (e.g. the preprocessing) is stored in the ONNX file's metadata_props and
    the .pt2 file's extra files, as JSON."""
    path = Path(path)
    kind = FORMATS.get(path.suffix)
    if kind is None:
        raise UserError(f"export path {str(path)!r} must end in one of {sorted(FORMATS)}")
    meta = {"vitlab_config": json.dumps(model.cfg.to_dict())} | {k: json.dumps(v) for k, v in (metadata or {}).items()}
    model = model.eval()
    program = export_program(model)
    report: dict[str, Any] = {"path": str(path), "format": kind, "atol": atol}

    def write(tmp: Path) -> None:
        if kind == "onnx":
            onnx = _onnx_program(program, meta)
            onnx.save(str(tmp))
            run = _onnxruntime_runner(tmp)
        else:
            torch.export.save(program, str(tmp), extra_files=meta)
            run = torch.export.load(str(tmp)).module()
        report["checks"] = _check(model, run, atol)

    atomic_files(path, write, what=f"{kind} export", advice="free space, or export elsewhere with output=<file>")
    report["max_abs_diff"] = max(c["max_abs_diff"] for c in report["checks"])
    return report


def _check(model: ViT, run, atol: float) -> list[dict]:
    """Run the exported file and the model on each of `check_shapes`; refuse a difference over atol."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    checks = []
    for shape in check_shapes(model):
        x = torch.randn(shape, generator=g)
        with torch.no_grad():
            expected = model(x.to(device)).float().cpu()
            got = torch.as_tensor(run(x.to(device))).float().cpu()
        diff = (got - expected).abs().max().item() if got.shape == expected.shape else float("inf")
        checks.append({"input_shape": list(shape), "max_abs_diff": diff})
        if not diff <= atol:
            raise UserError(
                f"the exported program differs from the model by {diff:.3g} on input {shape}, more than atol={atol:g}: "
                "refused, nothing was written (a larger atol accepts it; the default is 1e-4)"
            )
    return checks


def _onnx_program(program: torch.export.ExportedProgram, meta: dict[str, str]):
    _require("onnx", "onnxscript")
    # onnxscript's optimizer warns of each constant computation it leaves to the runtime ("Skipping constant folding
    # for op Split with multiple outputs": a fixed RoPE table split into sin and cos, twice a block): the file is
    # right (checked below) and nobody exporting can act on it. Those lines alone, for this call alone, are dropped.
    with dropped("onnxscript.optimizer._constant_folding", "Skipping constant folding"):
        onnx = torch.onnx.export(program, dynamo=True, input_names=["images"], output_names=["logits"], verbose=False)
    onnx.model.metadata_props.update(meta)
    return onnx


def _onnxruntime_runner(path: Path):
    _require("onnxruntime")
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x.cpu().numpy()})[0]


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(
            f"ONNX export needs {', '.join(missing)}: pip install onnx onnxscript onnxruntime (vitlab's [export] extra)"
        )
