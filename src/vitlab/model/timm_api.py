"""timm's model API, as a mixin the ViT core inherits: what timm.optim, timm.data, timm's feature extraction and
timm users call (pretrained_cfg, feature_info, no_weight_decay, group_matcher, the classifier, gradient
checkpointing, set_input_size, forward_intermediates, ...), plus vitlab's named intermediates.

The mixin reads the core's attributes (cfg, patch_embed, pos_embed, blocks, norm, fc_norm, attn_pool, head) and
calls its embed and _block; none of it is needed to compute logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vitlab.model.choices import GLOBAL_POOLS
from vitlab.model.config import ViTConfig, as_hw
from vitlab.model.posemb import POS_EMBEDS, resample_patch_embed, resample_pos_embed
from vitlab.utils.errors import UnsupportedRequestError, UserError

Size = int | Sequence[int]  # an int for squares, else (height, width)

# What timm's ViT weights expect of their inputs unless their pretrained config says otherwise (timm's `_cfg`).
DEFAULT_PRETRAINED_CFG = dict(
    mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=0.9, crop_mode="center", interpolation="bicubic"
)


class TimmAPI:
    """timm's VisionTransformer API for the ViT core (see the module docstring for what it reads)."""

    @property
    def num_classes(self) -> int:
        return self.cfg.num_classes

    @property
    def in_chans(self) -> int:  # timm reads it beside pretrained_cfg['input_size']
        return self.cfg.in_chans

    # What timm's code reads off a VisionTransformer (its checkpoint filter, feature wrappers, input config).
    global_pool = property(lambda self: self.cfg.global_pool)
    embed_dim = property(lambda self: self.cfg.embed_dim)
    has_class_token = property(lambda self: self.cfg.class_token)
    num_reg_tokens = property(lambda self: self.cfg.reg_tokens)
    dynamic_img_size = property(lambda self: self.cfg.dynamic_img_size)
    no_embed_class = property(lambda self: not self.cfg.embeds_prefix)  # pos_embed has no prefix rows

    @property
    def num_features(self) -> int:  # width of forward_features' tokens and of the pooled features
        return self.cfg.embed_dim

    head_hidden_size = num_features  # no pre-logits layer: the head sees the pooled features

    @staticmethod
    def _default_pretrained_cfg(cfg: ViTConfig) -> dict:
        d = dict(DEFAULT_PRETRAINED_CFG, num_classes=cfg.num_classes, input_size=(cfg.in_chans, *cfg.img_hw))
        if cfg.in_chans != 3:
            d.update(mean=(0.5,) * cfg.in_chans, std=(0.5,) * cfg.in_chans)
        return dict(d, pool_size=None, fixed_input_size=not cfg.dynamic_img_size, first_conv="patch_embed.proj",
                    classifier="head")  # fmt: skip

    @property
    def default_cfg(self) -> dict:  # timm's older name of pretrained_cfg (timm's factory assigns both)
        return self.pretrained_cfg

    @default_cfg.setter
    def default_cfg(self, cfg: dict) -> None:
        self.pretrained_cfg = cfg

    @property
    def feature_info(self) -> list[dict]:
        """Every block's output as timm describes it: module name, channels, stride in pixels."""
        return [
            dict(module=f"blocks.{i}", num_chs=self.cfg.embed_dim, reduction=max(self.cfg.patch_hw))
            for i in range(len(self.blocks))
        ]

    def __prepare_scriptable__(self):  # torch.jit.script calls it first: one line instead of an error deep inside
        raise UserError(
            "vitlab's ViT is not TorchScript-scriptable (torch.jit.script); export it with torch.export "
            "(torch.export.export, vitlab.export format=pt2) or ONNX (format=onnx) instead"
        )

    def no_weight_decay(self) -> set[str]:
        rope = {"rope.freqs"} if self.rope is not None and self.rope.per_block else set()  # (timm's Eva's)
        return {"pos_embed", "cls_token", "reg_token", "dist_token"} | rope

    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups by depth, as timm's: the embeddings, then each block, then the rest (timm.optim's
        layer-wise learning-rate decay reads this)."""
        return dict(
            stem=r"^cls_token|pos_embed|patch_embed|reg_token|dist_token",
            blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))],
        )

    def get_classifier(self) -> nn.Module | tuple[nn.Module, nn.Module]:
        return (self.head, self.head_dist) if self.cfg.distilled else self.head

    def set_distilled_training(self, enable: bool = True) -> None:
        """distilled: training returns (class, distillation) logits apart (timm's VisionTransformerDistilled)."""
        self.distilled_training = enable

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new head for `num_classes` (0: none, forward returns pooled features) on the model's device and in
        its dtype, and optionally another pooling ('' keeps every token); the attention pool can be removed, not
        added. A distilled model reads its two tokens whatever the pooling ('' or 'token', as timm's). The rest of
        the model is kept, and the config follows, so checkpoints record the change; the new heads are in the
        model's mode (eval stays eval). What timm refuses with an assertion is an UnsupportedRequestError (an
        AssertionError too)."""
        changes: dict = {"num_classes": num_classes}
        if self.cfg.distilled and global_pool not in (None, "", "token"):
            raise UnsupportedRequestError(
                f"global_pool {global_pool!r}: the distilled head reads the class and distillation tokens"
            )
        if global_pool is not None and not self.cfg.distilled:
            if global_pool not in GLOBAL_POOLS:
                raise UnsupportedRequestError(f"global_pool {global_pool!r} is not one of {list(GLOBAL_POOLS)}")
            if global_pool == "map" and self.attn_pool is None:
                raise UnsupportedRequestError("reset_classifier cannot add an attention pool ('map'); build a model")
            if global_pool == "token" and not self.cfg.class_token:
                raise UnsupportedRequestError("global_pool 'token' needs the class token")
            if global_pool != "map":
                self.attn_pool = None
            changes["global_pool"] = global_pool
        self.cfg = self.cfg.replace(**changes, **self._built_norms())
        p = next(self.parameters())
        factory = dict(device=p.device, dtype=p.dtype)  # the model's, as timm's get_device_dtype
        self.head = nn.Linear(self.cfg.embed_dim, num_classes, **factory) if num_classes > 0 else nn.Identity()
        if self.cfg.distilled:
            self.head_dist = nn.Linear(self.cfg.embed_dim, num_classes, **factory) if num_classes else nn.Identity()
        for head in (self.head, getattr(self, "head_dist", None)):  # in the model's mode, as timm's heads
            if head is not None:
                head.train(self.training)

    def _built_norms(self) -> dict:
        """The config fields that describe the norms as built (the pooling no longer decides them)."""
        has_norm, has_fc_norm = not isinstance(self.norm, nn.Identity), not isinstance(self.fc_norm, nn.Identity)
        return dict(final_norm=has_norm or has_fc_norm, fc_norm=has_fc_norm)

    def set_grad_checkpointing(self, enable: bool | int | str = True) -> None:
        """Recompute each block's activations in the backward pass instead of storing them (timm's switch; also N:
        every N-th block, or "selective": model.grad_checkpointing's values)."""
        self.grad_checkpointing = enable

    def set_input_size(self, img_size: Size | None = None, patch_size: Size | None = None):
        """Another input resolution and/or patch size, as timm's: a learned pos_embed is resampled to the new
        grid, a fixed one recomputed; the patch filters are resampled to the new patch size (FlexiViT)."""
        sizes = dict(img_size=img_size, patch_size=patch_size)  # an int stays one in the config, a pair is (h, w)
        old = self.cfg
        new = old.replace(**{k: v if isinstance(v, int) else as_hw(v, k) for k, v in sizes.items() if v is not None})
        if new.patch_hw != old.patch_hw:
            conv, P = self.patch_embed.proj, new.patch_hw
            proj = nn.Conv2d(new.in_chans, new.embed_dim, P, P, bias=conv.bias is not None, device=conv.weight.device,
                             dtype=conv.weight.dtype)  # fmt: skip
            with torch.no_grad():
                proj.weight.copy_(resample_patch_embed(conv.weight, P))
                if conv.bias is not None:
                    proj.bias.copy_(conv.bias)
            self.patch_embed.proj, self.patch_embed.patch_size = proj, P
        if self.pos_embed is not None and new.grid_size != old.grid_size:
            if isinstance(self.pos_embed, nn.Parameter):
                pe = resample_pos_embed(
                    self.pos_embed.detach(), new.grid_size, old.grid_size, new.pos_prefix_rows, new.pos_embed_resample
                )
                self.pos_embed = nn.Parameter(pe, requires_grad=self.pos_embed.requires_grad)
            else:  # fixed: recomputed for the new grid
                pe = POS_EMBEDS[new.pos_embed](new.grid_size, new.pos_prefix_rows, new.embed_dim, self.pos_embed.device)
                self.pos_embed = pe.to(self.pos_embed.dtype)
        self.cfg = new
        if self.rope is not None:  # its table follows the grid
            self.rope.set_grid(new.grid_size)
        self.patch_embed.img_size, self.patch_embed.grid_size = new.img_hw, new.grid_size
        self.pretrained_cfg["input_size"] = (new.in_chans, *new.img_hw)

    # ---- looking inside --------------------------------------------------------------------------
    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | Sequence[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
        attn_mask: torch.Tensor | None = None,
    ):
        """timm's contract: block outputs at `indices` (an int n: the last n blocks; a list: those blocks,
        negative from the end; None: all), patch tokens as (B, D, h, w) ('NCHW') or (B, h*w, D) ('NLC'), with
        their prefix tokens as (tokens, prefix) pairs when `return_prefix_tokens`, each through the final norm
        when `norm`. Returns (final features, intermediates), the intermediates alone, or timm's dict.
        Checkpointed like forward_features when gradient checkpointing is on."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt {output_fmt!r} is not one of ['NCHW', 'NLC']")
        take, last = take_indices(len(self.blocks), indices)
        B, H, W = x.shape[0], x.shape[-2], x.shape[-1]
        blocks = self.blocks[: last + 1] if stop_early else self.blocks
        (x, rope), feats = self.embed_with_rope(x), []
        for i, blk in enumerate(blocks):
            x = self._block(blk, x, None, attn_mask, i, rope)
            if i in take:
                feats.append(self.norm(x) if norm else x)
        n = self.num_prefix_tokens
        prefix, feats = [y[:, :n] for y in feats], [y[:, n:] for y in feats]
        if output_fmt == "NCHW":
            (ph, pw) = self.cfg.patch_hw
            h, w = (H + ph - 1) // ph, (W + pw - 1) // pw  # the padded grid with dynamic_img_pad
            feats = [y.reshape(B, h, w, -1).permute(0, 3, 1, 2).contiguous() for y in feats]
        if output_dict:
            out = {"image_intermediates": feats}
            if n and return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix
            if not intermediates_only:
                out["image_features"] = self.norm(x)
            return out
        if n and return_prefix_tokens:
            feats = list(zip(feats, prefix, strict=True))
        return feats if intermediates_only else (self.norm(x), feats)

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop the blocks after the last of `indices` (and the final norm, the head), as timm's: a backbone
        for forward_intermediates. The config follows. Returns the kept indices."""
        take, last = take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: last + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.fc_norm = nn.Identity()
            self.reset_classifier(0, "")
        kv = self.cfg.num_kv_heads  # (one per block: the kept blocks')
        kv = kv[: last + 1] if isinstance(kv, tuple) else kv
        self.cfg = self.cfg.replace(depth=last + 1, num_kv_heads=kv, **self._built_norms())
        return take

    def intermediates_by_name(self, x: torch.Tensor, layers: Sequence[int | str] = (-1,)) -> dict[str, torch.Tensor]:
        """Named intermediate outputs, for layer-by-layer comparisons (convert/compare.py). `layers` holds block
        indices (negative count from the end) or names: 'patch_embed' (B, h*w, D) before prefix tokens and
        position embedding, 'embed' (B, N, D) the blocks' input, 'blocks.<i>', 'norm' (the final features)."""
        depth = len(self.blocks)
        valid = {"patch_embed", "embed", "norm"} | {f"blocks.{i}" for i in range(depth)}
        wanted = [f"blocks.{take_indices(depth, [n])[0][0]}" if isinstance(n, int) else n for n in layers]
        unknown = [n for n in wanted if n not in valid]
        if unknown:
            raise ValueError(f"unknown layer {unknown[0]!r}; use 'patch_embed', 'embed', 'blocks.<i>' or 'norm'")
        out = {"patch_embed": self.patch_embed(x).flatten(1, 2)} if "patch_embed" in wanted else {}
        x, rope = self.embed_with_rope(x)
        out["embed"] = x
        for i, blk in enumerate(self.blocks):
            out[f"blocks.{i}"] = x = self._block(blk, x, i=i, rope=rope)
        out["norm"] = self.norm(x)
        return {name: out[name] for name in wanted}


def take_indices(depth: int, indices: int | Sequence[int] | None) -> tuple[list[int], int]:
    """timm's `feature_take_indices`: None -> every block, an int n -> the last n, a list -> those (negative
    from the end); returns the absolute indices and the largest."""
    if indices is None:
        indices = depth
    if isinstance(indices, int):
        if not 0 < indices <= depth:
            raise ValueError(f"last-n {indices} is out of range (1 to {depth})")
        take = list(range(depth - indices, depth))
    else:
        take = [depth + i if i < 0 else i for i in indices]
        bad = [i for i, t in zip(indices, take, strict=True) if not 0 <= t < depth]
        if bad:
            raise ValueError(f"block index {bad[0]} out of range for depth {depth}")
    return take, max(take)
