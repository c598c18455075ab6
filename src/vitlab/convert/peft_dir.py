"""format=peft: a ViT's LoRA/DoRA adapters as Hugging Face peft's own folder (adapter_config.json,
adapter_model.safetensors, README.md), the one `PeftModel.from_pretrained(timm.create_model(name, ...), folder)`
loads: peft's key names (`base_model.model.<timm's module>.lora_A.weight`), checked by loading it so onto timm's model
of the same architecture and base weights, and comparing the logits, before it is put in place."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitlab.convert.timm_args import create_timm_model
from vitlab.convert.weights import check_state_dict
from vitlab.model import ViT
from vitlab.utils.atomic import atomic_dir
from vitlab.utils.errors import UserError

PREFIX = "base_model.model."  # what PeftModel puts before the model's own names


def base_state(model: ViT) -> dict[str, torch.Tensor]:
    """The base weights under `model`'s adapters, in timm's names: peft's `base_layer` and `original_module` taken."""
    state = {}
    for key, value in model.state_dict().items():
        if "lora_" in key or ".modules_to_save." in key:
            continue
        state[key.replace(".base_layer.", ".").replace(".original_module.", ".")] = value
    return check_state_dict(state, model.cfg)


def save_peft_dir(
    model: ViT,
    out: str | os.PathLike,
    label_names: list[str] | None = None,
    atol: float = 1e-5,
    overwrite: bool = False,
    card: Any = None,
) -> dict[str, Any]:
    """The adapters peft injected into `model` (peft=lora|dora: training.adapters.attach, which names their base in
    `model.adapter_base`) as peft's folder at `out`, checked against timm's model of the base under PeftModel (<= atol)
    before it is put in place. (`label_names`, `card`: save_timm_dir's, which the adapters' own card replaces.)"""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out = Path(out)
    configs = getattr(model, "peft_config", None)
    if not configs or not _adapted(model):
        raise UserError("format=peft writes LoRA/DoRA adapters, and this checkpoint was trained without them "
                        "(peft=none, bitfit or partial): export it with format=timm")  # fmt: skip
    if out.exists() and not overwrite:
        raise UserError(f"output {str(out)!r} exists; choose another output or set overwrite=true")
    state = {PREFIX + k: v.detach().float().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    base = getattr(model, "adapter_base", None) or {"source": "unknown", "sha256": "unknown"}
    config = copy.deepcopy(configs["default"])
    config.base_model_name_or_path = model.pretrained_cfg.get("architecture") or base["source"]
    config.inference_mode = True
    measured: dict[str, float] = {}

    def write(folder: Path) -> None:
        config.save_pretrained(str(folder))
        save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "README.md").write_text(_card(config, base))
        measured["diff"] = diff = _peft_reads_it_back(model, folder)
        if not diff <= atol:
            raise UserError(
                f"peft's model of the folder is {diff:.3g} from ours (over {atol}): refused, nothing written"
            )

    atomic_dir(out, write, "peft folder")
    loads = f"PeftModel.from_pretrained(timm's model of the base, '{out}')"
    return {"output": str(out), "max_abs_diff": measured["diff"], "tensors": len(state), "loads_with": loads}


def merged(model: nn.Module) -> nn.Module:
    """A copy of `model` with peft's adapters merged into its layers and its modules_to_save copies in place of the
    originals: plain timm names and layers again (format=timm). A model without adapters: itself."""
    if not _adapted(model, saved_copies=True):
        return model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    model = copy.deepcopy(model)
    for name, m in list(model.named_modules()):
        if isinstance(m, BaseTunerLayer):
            m.merge()
            plain = m.get_base_layer()
        elif isinstance(m, ModulesToSaveWrapper):
            plain = m.modules_to_save["default"]
        else:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, plain)
    for attribute in ("peft_config", "adapter_base"):
        model.__dict__.pop(attribute, None)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def timm_base(model: ViT) -> nn.Module:
    """timm's model of `model`'s architecture holding its base weights (the adapters' base)."""
    timm_model = create_timm_model(model.cfg)
    timm_model.load_state_dict(base_state(model))
    return timm_model.eval()


def _peft_reads_it_back(model: ViT, folder: Path) -> float:
    from peft import PeftModel

    theirs = PeftModel.from_pretrained(timm_base(model.float().cpu()), str(folder)).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, model.cfg.in_chans, *model.cfg.img_hw, generator=g)
    with torch.no_grad():
        return (theirs(x) - model.eval().cpu()(x)).abs().max().item()


def _card(config: Any, base: dict[str, Any]) -> str:
    settings = {k: v for k, v in config.to_dict().items() if k in ("r", "lora_alpha", "use_dora", "use_rslora",
                                                                    "target_modules", "modules_to_save")}  # fmt: skip
    return (
        "---\nlibrary_name: peft\ntags: [vitlab, timm, lora]\n---\n# Adapters of a vitlab run\n\n"
        f"- base weights: `{base['source']}` (sha256 `{base['sha256']}`)\n"
        f"- adapter: {'DoRA' if config.use_dora else 'LoRA'} {json.dumps(settings, default=list)}\n\n"
        "```python\nimport timm\nfrom peft import PeftModel\n"
        "model = PeftModel.from_pretrained(timm.create_model(<the base's architecture>, ...), <this folder>)\n```\n"
    )


def _adapted(model: nn.Module, saved_copies: bool = False) -> bool:
    """Whether `model` holds peft's adapter layers (`saved_copies`: or its modules_to_save copies). Only a process
    that imported peft can hold them: a plain model is answered without importing peft (and torchao with it)."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    kinds = (BaseTunerLayer, ModulesToSaveWrapper) if saved_copies else BaseTunerLayer
    return any(isinstance(m, kinds) for m in model.modules())
