"""The cost model of a ViTConfig: forward FLOPs per image and per block, as `ViT.forward` computes them (MFU and the
memory estimate divide by these; config.py's `flops_per_image` and `block_flops` call them). No torch."""

from __future__ import annotations

from typing import Any

from vitlab.model.choices import BLOCK_KINDS

ViTConfig = Any  # (config.py imports this module: a ViTConfig, not imported here)


def flops_per_image(self: ViTConfig) -> int:
    """Forward FLOPs (multiply-add = 2) of one image as `ViT.forward` computes them: every block but the last on
    all N tokens; the last, under a class-token head, on the rows the head reads (`block_flops`); the patch
    embedding 2*Np*P^2*C*D; the pool and head (norms, adds and activations ignored). MFU divides by this: counting
    the whole last block overstated a DeiT-Ti's work by 7% (torch's FlopCounterMode agrees with this count,
    tests/model/test_config.py)."""
    n, d, k = self.num_tokens(), self.embed_dim, self.num_classes
    rows = 1 + int(self.distilled) if self.global_pool == "token" else n  # ViT.forward's last_rows
    blocks = (self.depth - 1) * self.block_flops(n, n) + self.block_flops(n, rows)
    embed = 2 * self.num_patches * self.patch_hw[0] * self.patch_hw[1] * self.in_chans * d
    pooled = self.num_tokens() if self.pool_include_prefix else self.num_patches
    head = {"token": 2 * d * k * (1 + int(self.distilled)), "": 2 * n * d * k}.get(self.global_pool, 2 * d * k)
    if self.global_pool == "map":  # attention pool: keys and values of the pooled tokens, one query, its MLP
        hidden = int(d * (self.attn_pool_mlp_ratio or self.mlp_ratio))
        head += 2 * pooled * 2 * d * d + 4 * pooled * d + 2 * (2 * d * d + 2 * d * hidden)
    return blocks + embed + head


def block_flops(self: ViTConfig, n: int, rows: int) -> int:
    """Forward FLOPs of one block on n tokens of which the first `rows` are updated (blocks.py): keys and values
    of every token, queries, output projection and MLP of the rows; attention 4*rows*N*D (q k^T, then a v).
    The fused blocks (ViT-22B's) project every token into the MLP's hidden features with q, k and v."""
    d, hidden = self.embed_dim, self.mlp_hidden
    # attention: q k^T and (attention) v, 2 rows N D each; differential attention: two half-width q k^T, v twice
    attend = (6 if self.differential else 4) * rows * n * d
    if BLOCK_KINDS[self.block_fn].fused:
        return 2 * n * d * (hidden + 3 * d) + 2 * rows * (d * d + hidden * d) + attend
    # MLP weights: mlp D->Dm->D; swiglu two D->Dm and Dm->D; swiglu_packed D->Dm and Dm/2->D
    mlp = {"mlp": 2 * d * hidden, "swiglu": 3 * d * hidden, "swiglu_packed": d * hidden + hidden // 2 * d}
    per_branch = 2 * (3 * n * d * d + rows * d * d + rows * mlp[self.mlp_layer]) + attend
    return per_branch * BLOCK_KINDS[self.block_fn].branches  # (parallel_things: two of each branch)


def activation_values(self: ViTConfig) -> float:
    """Values per token and width that one block keeps for the backward pass (training.devices.memory's estimate
    multiplies by tokens, width and bytes; measured with saved-tensor hooks, tests/training/devices/test_memory.py):
    8 for the norms, qkv, attention and projection; the MLP's hidden features twice (fc1's output and its
    activation; swiglu four times: both branches, the activation and the product), once more under scale_mlp_norm;
    2 for LayerScale (each branch's output before its scale); RoPE's rotated queries and keys, which attention keeps
    beside the projection (3; mixed RoPE 5.5: its learned table and the rotated copies its gradient needs)."""
    d, hidden = self.embed_dim, self.mlp_hidden
    inner = hidden / 2 if self.mlp_layer == "swiglu_packed" else hidden  # the features the MLP's fc2 reads
    mlp = (4 * hidden if self.mlp_layer == "swiglu" else 2 * hidden) + (inner if self.scale_mlp_norm else 0)
    rope = {"": 0.0, "mixed": 5.5}.get(self.rope, 3.0)
    return 8 + mlp / d + (2 if self.init_values is not None else 0) + rope
