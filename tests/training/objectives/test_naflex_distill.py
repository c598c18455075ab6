"""objective=distill on NaFlex batches (issue 65, point 3): the teacher sees the student's padded patches,
re-normalised from the student's mean and std to its own, channel by channel; a teacher that takes square images only
is refused in one line."""

import pytest
import torch

from vitlab.data.naflex_batch import NaFlexBatch
from vitlab.model import ViT, ViTConfig
from vitlab.model.naflex import patchify
from vitlab.training.objectives.distillation import Teacher
from vitlab.utils.errors import UserError

CFG = dict(img_size=32, patch_size=8, depth=1, embed_dim=32, num_heads=2, num_classes=3, class_token=False,
           global_pool="avg", reg_tokens=1)  # fmt: skip


def test_the_teacher_reads_naflex_patches_in_its_own_normalisation():
    torch.manual_seed(0)
    model = ViT(ViTConfig(naflex=True, **CFG)).eval()
    model.pretrained_cfg.update(mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    teacher = Teacher(model, (32, 32))
    images = torch.rand(2, 3, 16, 24)  # in [0, 1]
    s_mean, s_std = torch.tensor([0.1, 0.2, 0.3]).view(1, 3, 1, 1), torch.tensor([0.9, 0.8, 0.7]).view(1, 3, 1, 1)
    patches, (h, w) = patchify((images - s_mean) / s_std, (8, 8))  # the student's batch
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    coord = torch.stack([y.flatten(), x.flatten()], -1).expand(2, -1, -1)
    batch = NaFlexBatch(patches=patches, patch_coord=coord, patch_valid=torch.ones(2, h * w, dtype=torch.bool),
                        loss_scale=torch.tensor(1.0))  # fmt: skip
    own = (images - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)
    torch.testing.assert_close(teacher(batch, s_mean, s_std), model(own), atol=1e-5, rtol=0)
    square = Teacher(ViT(ViTConfig(**CFG)).eval(), (32, 32))
    with pytest.raises(UserError, match="a teacher that takes them"):
        square(batch, s_mean, s_std)
