"""Gradient checkpointing of the blocks (ViTConfig.grad_checkpointing, timm's set_grad_checkpointing): a block whose
activations are recomputed in the backward pass instead of kept, whole or (selective) all but its costly ops'.
ViT._block (model/vit.py) decides which blocks; compile=regional compiles each block's region (training/objectives,
benchmark/models.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

# grad_checkpointing=selective: what a block keeps for the backward pass, its matmuls' and attention's outputs (the
# costly ops); everything else (norms, GELU, dropout, residual adds) is recomputed from them (torch's selective
# activation checkpointing, as torchtitan's "op" mode).
_aten = torch.ops.aten
SAVED_BY_SELECTIVE = [
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )  # fmt: skip
    if hasattr(_aten, name)
]


def _selective_contexts():
    return create_selective_checkpoint_contexts(SAVED_BY_SELECTIVE)


class Recompute(nn.Module):
    """A block under gradient checkpointing, as one module: its activations are recomputed in the backward pass (with
    `selective`, only its cheap ops'). compile=regional compiles this whole (recompute_region), so the checkpoint and
    torch's selective policy are traced into the block's graph, as torchtitan compiles its checkpoint-wrapped
    blocks: eager, the selective policy is a dispatch mode that runs every op of the block through Python twice
    (ViT-L/16 on an H100: 2.33x the step). The block is not registered here: state-dict keys stay timm's."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.__dict__["block"] = block

    def forward(self, x: torch.Tensor, rows: int | None, attn_mask: torch.Tensor | None, selective: bool, rope=None):
        if selective:  # (dynamo traces a context_fn only when it is named in the call)
            return checkpoint(self.block, x, rows, attn_mask, rope, use_reentrant=False, context_fn=_selective_contexts)
        return checkpoint(self.block, x, rows, attn_mask, rope, use_reentrant=False)


def recompute_region(block: nn.Module) -> Recompute:
    """The block's Recompute, made once and kept beside it (not as a submodule)."""
    region = block.__dict__.get("_recompute_region")
    if region is None:
        region = block.__dict__["_recompute_region"] = Recompute(block)
    return region
