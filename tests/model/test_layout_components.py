"""Each component name is defined once (issue 21, point 1): choices.py keeps the names a config accepts (reading a
config must not import torch), the model's tables build them. Every accepted name has a builder, and every
builder a name, so the two cannot drift apart."""

import pytest

from vitlab.model import choices
from vitlab.model.attention import ATTENTIONS
from vitlab.model.blocks import BLOCKS
from vitlab.model.init import WEIGHT_INITS
from vitlab.model.layers import ACTIVATIONS, MLPS, NORMS, POOLS
from vitlab.model.posemb import POS_EMBEDS

# choices.py's name tuple -> the table that builds its names
TIES = {
    "ACT_LAYERS": ACTIVATIONS,
    "NORM_LAYERS": NORMS,
    "MLP_LAYERS": MLPS,
    "ATTN_LAYERS": ATTENTIONS,
    "BLOCK_FNS": BLOCKS,
    "POS_EMBEDS": POS_EMBEDS,
    "WEIGHT_INITS": WEIGHT_INITS,
}


@pytest.mark.parametrize("names", TIES)
def test_every_name_a_config_accepts_has_a_builder_and_back(names):
    accepted = getattr(choices, names)
    assert len(set(accepted)) == len(accepted)  # each name once
    assert set(accepted) == set(TIES[names])


def test_global_pools_are_the_pool_table_plus_the_models_own():
    # 'token' (the class token), 'map' (AttentionPool) and '' (every token) are handled by ViT.forward_head
    assert len(set(choices.GLOBAL_POOLS)) == len(choices.GLOBAL_POOLS)
    assert set(choices.GLOBAL_POOLS) == set(POOLS) | {"token", "map", ""}
    assert not set(POOLS) & {"token", "map", ""}


def test_each_block_kind_is_built_as_its_row_says():
    """choices.py's BLOCK_KINDS says which blocks are fused (ViT-22B's: their own attention and MLP); vit.py's
    build_block hands a block its arguments by its class's `fused`: the two agree."""
    assert {name: cls.fused for name, cls in BLOCKS.items()} == {n: k.fused for n, k in choices.BLOCK_KINDS.items()}
