"""python -m vitlab.export ckpt_path=<file.ckpt> [format=onnx|pt2|mae|ckpt|timm|peft] [output=<file>]: a checkpoint's
model as an ONNX file (for onnxruntime, TensorRT, ...) or a torch.export program (.pt2), with a dynamic batch, and a
dynamic height and width when the model was built with dynamic_img_size; an objective=mae checkpoint as MAE's own
`{'model': ...}` .pth (format=mae: MAE's key names, encoder and decoder; vitlab.convert.mae); format=ckpt makes one
checkpoint file of a directory of shards (trainer=fsdp's save_distributed_checkpoint=true), which every strategy and
tool reads; format=timm the folder `timm.create_model('local-dir:<folder>', pretrained=True)` reads
(vitlab.convert.timm_dir), with its model card (README.md), and with push_to_hub=<repo id> uploads it to the Hugging
Face Hub (vitlab.convert.publish).

The file is checked before it is put in place: run by onnxruntime (or reloaded) and compared with the
PyTorch model on several input shapes; over `atol` it is refused and nothing is written. What the model
expects of its input (size, mean, std, eval crop) and the class names go into the file's metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from vitlab.cli.entry import entry_point
from vitlab.utils.errors import UserError


def export(cfg: DictConfig) -> dict:
    from vitlab.cli.rundir import check_writable
    from vitlab.convert.programs import export
    from vitlab.training.run import inference

    if cfg.format in ("mae", "timm", "peft"):  # a checkpoint's networks in another library's own layout
        return {"mae": export_mae, "timm": export_timm, "peft": export_timm}[cfg.format](cfg)
    # (another format: refused before this by its schema's Literal, cli.schemas.ExportSettings)
    out = Path(cfg.output) if cfg.output else Path(cfg.paths.output_dir) / f"model.{cfg.format}"
    if out.suffix != f".{cfg.format}":
        raise UserError(f"output {str(out)!r} must end in .{cfg.format} for format={cfg.format}")
    if out.exists() and not cfg.overwrite:
        raise UserError(f"output {str(out)!r} exists; choose another output or set overwrite=true")
    check_writable(out.parent, "output", out)  # before the minutes of exporting and checking
    if cfg.format == "ckpt":
        return consolidate(cfg.ckpt_path, out)
    module = inference.load_for_inference(cfg.ckpt_path)
    model, data = module.model, inference.inference_datamodule(module, cfg.ckpt_path)
    preprocessing = data.preprocessing | {"dynamic_img_size": model.cfg.dynamic_img_size}  # as format=timm writes it
    metadata = {"preprocessing": preprocessing, "class_names": module.hparams.get("class_names")}
    report = export(model.float(), out, atol=cfg.atol, metadata=metadata)
    report["ckpt_path"] = str(cfg.ckpt_path)
    (Path(cfg.paths.output_dir) / "export.json").write_text(json.dumps(report, indent=2))
    shapes = ", ".join("x".join(map(str, c["input_shape"])) for c in report["checks"])
    print(f"wrote {out} ({cfg.format}); checked on inputs {shapes}: max |diff| {report['max_abs_diff']:.2g}")
    return report


def consolidate(ckpt_path: str, out: Path) -> dict:
    """One checkpoint file of a directory of shards (every tensor gathered in this host's memory), written
    atomically; its optimizer state keyed by parameter name as any vitlab checkpoint's."""
    import torch

    from vitlab.convert.weights import is_sharded_checkpoint, read_checkpoint
    from vitlab.utils.atomic import atomic_write

    if not is_sharded_checkpoint(ckpt_path):
        raise UserError(f"format=ckpt consolidates a directory of shards; ckpt_path {ckpt_path!r} is not one")
    checkpoint = read_checkpoint(ckpt_path)
    atomic_write(out, lambda f: torch.save(checkpoint, f), what="checkpoint")
    print(f"wrote {out} (one file of {ckpt_path}'s shards)")
    return {"ckpt_path": str(ckpt_path), "output": str(out)}


def export_mae(cfg: DictConfig) -> dict:
    """format=mae: the encoder and decoder of an objective=mae checkpoint in MAE's names, read back and compared."""
    from vitlab.convert.mae import export_mae as write_mae
    from vitlab.training.run import inference

    out = Path(cfg.output) if cfg.output else Path(cfg.paths.output_dir) / "mae_checkpoint.pth"
    if out.exists() and not cfg.overwrite:
        raise UserError(f"output {str(out)!r} exists; choose another output or set overwrite=true")
    module = inference.load_for_inference(cfg.ckpt_path)
    decoder = module.objective.extra_modules().get("decoder")
    if decoder is None:
        raise UserError(f"format=mae writes an MAE encoder and decoder; ckpt_path {cfg.ckpt_path!r} has no decoder")
    write_mae(module.model, decoder, out)
    print(f"wrote {out} (MAE's {{'model': ...}} format: encoder and decoder, MAE's key names)")
    return {"output": str(out), "ckpt_path": str(cfg.ckpt_path), "format": "mae"}


def export_timm(cfg: DictConfig) -> dict:
    """format=timm: the checkpoint's ViT as the folder timm's `local-dir:` reads (config.json, model.safetensors),
    checked by loading it with timm.create_model('local-dir:<folder>', pretrained=True) and comparing the logits to
    1e-5 (convert.timm_dir); its pretrained_cfg holds the class names and the eval transform of the checkpoint's data
    (input size, crop_mode, crop_pct, interpolation, mean, std), the one vitlab.predict applies, so that timm's
    resolve_data_config and create_transform prepare an image as vitlab does. An objective=mae checkpoint gives its
    encoder (the decoder is MAE's, not timm's: format=mae writes both); a peft=lora|dora one its merged weights.
    format=peft: such a checkpoint's adapters as peft's own folder (convert.peft_dir), which
    `PeftModel.from_pretrained(timm.create_model(<base>, ...), folder)` loads with the same logits."""
    from vitlab.cli.rundir import check_writable
    from vitlab.convert import peft_dir, publish, timm_dir
    from vitlab.training.run import inference

    out = Path(cfg.output) if cfg.output else Path(cfg.paths.output_dir) / cfg.format
    if out.exists() and not out.is_dir():
        raise UserError(f"output {str(out)!r} is a file and format={cfg.format} writes a folder: choose another output")
    if out.exists() and not cfg.overwrite:
        raise UserError(f"output {str(out)!r} exists; choose another output or set overwrite=true")
    check_writable(out.parent, "output", out)  # before the checkpoint is read
    card = publish.card_writer(cfg.ckpt_path, out, cfg.push_to_hub, cfg.license, cfg.datasets)  # (can it push? now)
    module = inference.load_for_inference(cfg.ckpt_path)
    if module.hparams.get("data"):
        module.model.pretrained_cfg.update(inference.inference_datamodule(module, cfg.ckpt_path).preprocessing)
    names, atol = module.hparams.get("class_names"), min(float(cfg.atol), 1e-5)
    write = timm_dir.save_timm_dir if cfg.format == "timm" else peft_dir.save_peft_dir  # (timm: adapters merged)
    report = write(module.model.float(), out, names, atol=atol, overwrite=cfg.overwrite, card=card)
    report |= {"ckpt_path": str(cfg.ckpt_path), "format": cfg.format}
    print(f"wrote {out}: {report['loads_with']}, |diff| {report['max_abs_diff']:.2g}")
    report["commit_url"] = publish.push_folder(out, cfg.push_to_hub, cfg.private, cfg.revision)  # (None: not pushed)
    return report


@entry_point("export")
def main(cfg: DictConfig) -> dict:
    return export(cfg)


if __name__ == "__main__":
    main()
