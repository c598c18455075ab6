"""Frozen features of a NaFlex model (issue 65, point 3): the pooled features read NaFlex's dict (masked pooling);
blocks' tokens (`layers`) are refused in one line."""

import pytest
import torch

from vitlab.evaluation.features import POOLED, layers_of
from vitlab.model import ViT, ViTConfig
from vitlab.utils.errors import UserError


def test_pooled_features_of_a_naflex_batch_and_layers_refused():
    model = ViT(ViTConfig(img_size=16, patch_size=8, depth=1, embed_dim=32, num_heads=2, naflex=True)).eval()
    coord = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]]).expand(2, -1, -1)
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    batch = dict(patches=torch.randn(2, 4, 8 * 8 * 3), patch_coord=coord, patch_valid=valid)
    with torch.no_grad():
        assert POOLED.extract(model, batch).shape == (2, 32)
    with pytest.raises(UserError, match="a NaFlex model: set layers=null"):
        layers_of(model, [-1])
