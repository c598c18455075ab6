"""`trainer.precision=float8` (tensorwise scaling) and `float8-rowwise`: the Linear layers of the ViT's blocks compute
their matmuls in float8 with torchao's float8 training (`torchao.float8.convert_to_float8_training`), everything else
under bf16 autocast as `bf16-mixed` runs it. Lightning has no float8 precision of its own: `Float8Precision` is its
bf16-mixed plugin plus the conversion, which the LightningModule's `configure_model` asks for before the network is
sharded (training/devices/sharding.py) and before torch.compile first traces it, the order torchtitan keeps
(torchtitan/components/quantization/float8.py: convert, then parallelise, then compile).

Which layers: the blocks' Linears (attention qkv and proj, the MLP's) whose both sizes are multiples of 16 (the
float8 matmul's requirement) and at least `min_features` (1024 by default: below it the casts cost more than the
float8 matmul saves; torchao's own thresholds, `_auto_filter_for_recipe`, are measured on Llama's shapes). The patch
embedding and the head stay in bf16, as the first and last layers of float8 recipes do. A state dict keeps its keys and
plain weights: a Float8Linear holds the same `weight` and `bias` in the same dtype as the Linear it replaced.

Under FSDP2 across several processes the tensorwise recipe gathers the weights in float8 (torchao's
`enable_fsdp_float8_all_gather`, half the bytes of bf16) and computes every weight's scale in one all-reduce after the
optimizer step (`precompute_float8_dynamic_scale_for_fsdp`), as torchtitan does; rowwise gathers in bf16.

float8 matmuls need a CUDA GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell): anything else is refused in
one line before the run starts (`check_float8`). torchao's emulation (`emulate=True`, the matmul in high precision on
float8-rounded values) runs the same conversion on the CPU for the tests; it does not compose with torch.compile.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from vitlab.training.devices.float8_request import FLOAT8_PRECISIONS, is_float8
from vitlab.utils.errors import UserError

log = logging.getLogger(__name__)

MIN_FEATURES = 1024


def trainer_arguments(trainer_cfg: Any) -> dict[str, Any]:
    """The Trainer's arguments that `trainer.precision=float8` (or float8-rowwise) replaces, none for another
    precision: Lightning has no float8, so no precision, and the config's plugins with Float8Precision beside them."""
    from hydra.utils import instantiate

    if not is_float8(precision := trainer_cfg.get("precision")):
        return {}
    plugins = [instantiate(p) for p in trainer_cfg.get("plugins") or []]
    return {"precision": None, "plugins": [*plugins, Float8Precision(FLOAT8_PRECISIONS[str(precision)])]}


def converts(module: nn.Module, name: str, min_features: int = MIN_FEATURES) -> bool:
    """Whether the Linear `module` at `name` in the ViT computes in float8: a block's, both sizes multiples of 16
    and at least `min_features`."""
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, nn.Linear) or isinstance(module, Float8Linear) or not name.startswith("blocks."):
        return False
    sizes = (module.in_features, module.out_features)
    return all(n % 16 == 0 and n >= min_features for n in sizes)


class Float8Precision(MixedPrecision):
    """Lightning's bf16-mixed (autocast on `device`) with the ViT's large block Linears in float8 (`recipe`:
    tensorwise or rowwise); `emulate`: torchao's emulated float8 matmul (the CPU tests). Its `precision` stays
    bf16-mixed: what the rest of the run (FSDP2's parameter dtype, memory estimates) reads."""

    def __init__(
        self, recipe: str = "tensorwise", device: str = "cuda", min_features: int = MIN_FEATURES, emulate: bool = False
    ):
        if recipe not in FLOAT8_PRECISIONS.values():
            raise UserError(f"float8 recipe {recipe!r} is not one of {list(FLOAT8_PRECISIONS.values())}")
        super().__init__("bf16-mixed", device)
        self.recipe, self.min_features, self.emulate = recipe, min_features, emulate
        self.float8_all_gather = False  # set by convert under sharding

    def convert(self, vit: nn.Module, sharded: bool = False) -> list[str]:
        """Swap the ViT's eligible Linears for torchao's Float8Linear in place (before it is sharded and compiled);
        `sharded`: FSDP2 splits it across processes (tensorwise then gathers in float8). Returns the converted
        layers' names; none is a UserError (float8 would change nothing). Once: a converted ViT is left as it is."""
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        done = [n for n, m in vit.named_modules() if isinstance(m, Float8Linear)]
        if done:
            return done
        names = [n for n, m in vit.named_modules() if converts(m, n, self.min_features)]
        if not names:
            raise UserError(
                f"float8 converts the Linears of the ViT's blocks whose sizes are multiples of 16 and at least "
                f"{self.min_features}; this ViT (width {getattr(getattr(vit, 'cfg', None), 'embed_dim', '?')}) has "
                "none, so float8 would change nothing: use trainer.precision=bf16-mixed"
            )
        self.float8_all_gather = sharded and self.recipe == "tensorwise"
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(self.recipe),
            emulate=self.emulate,
            enable_fsdp_float8_all_gather=self.float8_all_gather,
        )
        if self.recipe == "rowwise":  # torchtitan's workaround for pytorch/pytorch#150859 (rowwise under compile)
            torch._inductor.config.emulate_precision_casts = True
        convert_to_float8_training(vit, config=config, module_filter_fn=lambda m, n: n in names)
        log.info(
            "float8 (%s scaling%s): %d of the ViT's Linear layers, the rest in bf16",
            self.recipe,
            ", weights gathered in float8" if self.float8_all_gather else "",
            len(names),
        )
        return names

    def optimizer_step(self, optimizer, model, closure, **kwargs: Any) -> Any:
        """The step; then, where weights are gathered in float8, every weight's float8 scale in one all-reduce
        (torchao's precompute_float8_dynamic_scale_for_fsdp, after each optimizer step as torchtitan calls it)."""
        output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self.refresh_scales(model)
        return output

    def refresh_scales(self, model: nn.Module) -> None:
        """Where weights are gathered in float8: their scales for the next gathers, after the weights changed."""
        if self.float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)


def plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict with torchao's float8 weight wrappers (FSDP2's float8 all-gather) as the plain tensors they
    hold: what a checkpoint stores, readable without torchao."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return {k: v._tensor if isinstance(v, WeightWithDynamicFloat8CastTensor) else v for k, v in state.items()}
