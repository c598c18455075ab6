"""DINO's and DINOv2's arithmetic against the references' code: dino's vision_transformer.py DINOHead and utils.py
cosine_scheduler and clip_gradients, and main_dino.py's DINOLoss, imported from tests/reference/ (vendored verbatim);
DINOv2's loss/ (DINOLoss, iBOTPatchLoss, KoLeoLoss) too; written out here from facebookresearch/dino (the EMA step
of train_one_epoch) and facebookresearch/dinov2 (data/masking.py, data/collate.py: their package's data/__init__
imports its datasets and loaders). Same weights, same inputs: equal to 1e-6 (the schedules to 1e-12,
the masks exactly)."""

import copy
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.references import reference
from vitlab.data.multicrop import block_mask, collate_masks
from vitlab.model.dino_head import DINOHead
from vitlab.training.objectives import dino_losses as L
from vitlab.training.optim import dino_cosine

pytestmark = pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning", "ignore:.*weight_norm.*:UserWarning")


# ---- the references, as written there ------------------------------------------------------------------------
@pytest.fixture
def one_process(tmp_path):
    """A process group of one (gloo), so main_dino.py's DINOLoss runs unmodified: its all_reduce and world size are
    the identity and 1, as in a one-GPU run of DINO."""
    import torch.distributed as dist

    if dist.is_initialized():  # another test's group: leave it
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dinov2_losses():
    """dinov2/loss/ (vendored, unmodified; one process: their all_reduce calls are skipped when no group is set)."""
    return reference("dinov2", "dinov2.loss")


class RefMaskingGenerator:
    """dinov2 data/masking.py MaskingGenerator (numpy mask), its draws from the module-level `random`."""

    def __init__(self, input_size, num_masking_patches=None, min_num_patches=4, max_num_patches=None,
                 min_aspect=0.3, max_aspect=None):  # fmt: skip
        self.height, self.width = input_size
        self.min_num_patches = min_num_patches
        self.max_num_patches = num_masking_patches if max_num_patches is None else max_num_patches
        max_aspect = max_aspect or 1 / min_aspect
        self.log_aspect_ratio = (math.log(min_aspect), math.log(max_aspect))

    def _mask(self, mask, max_mask_patches):
        delta = 0
        for _ in range(10):
            target_area = random.uniform(self.min_num_patches, max_mask_patches)
            aspect_ratio = math.exp(random.uniform(*self.log_aspect_ratio))
            h = int(round(math.sqrt(target_area * aspect_ratio)))
            w = int(round(math.sqrt(target_area / aspect_ratio)))
            if w < self.width and h < self.height:
                top = random.randint(0, self.height - h)
                left = random.randint(0, self.width - w)
                num_masked = mask[top : top + h, left : left + w].sum()
                if 0 < h * w - num_masked <= max_mask_patches:
                    for i in range(top, top + h):
                        for j in range(left, left + w):
                            if mask[i, j] == 0:
                                mask[i, j] = 1
                                delta += 1
                if delta > 0:
                    break
        return delta

    def __call__(self, num_masking_patches=0):
        mask = np.zeros(shape=(self.height, self.width), dtype=bool)
        mask_count = 0
        while mask_count < num_masking_patches:
            max_mask_patches = min(num_masking_patches - mask_count, self.max_num_patches)
            delta = self._mask(mask, max_mask_patches)
            if delta == 0:
                break
            mask_count += delta
        return mask


def ref_collate_masks(B, N, mask_ratio_tuple, mask_probability, mask_generator):
    """dinov2 collate_data_and_cast's masks."""
    n_samples_masked = int(B * mask_probability)
    probs = torch.linspace(*mask_ratio_tuple, n_samples_masked + 1)
    masks_list = []
    for i in range(0, n_samples_masked):
        prob_min, prob_max = probs[i], probs[i + 1]
        masks_list.append(torch.BoolTensor(mask_generator(int(N * random.uniform(prob_min, prob_max)))))
    for _ in range(n_samples_masked, B):
        masks_list.append(torch.BoolTensor(mask_generator(0)))
    random.shuffle(masks_list)
    return torch.stack(masks_list).flatten(1)


# ---- the head ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_last_layer", [True, False])
def test_the_head_is_dinos_with_its_keys_and_outputs(norm_last_layer):
    torch.manual_seed(0)
    ours = DINOHead(24, 50, hidden_dim=32, bottleneck_dim=16, nlayers=3, norm_last_layer=norm_last_layer)
    ref = reference("dino", "vision_transformer").DINOHead(
        24, 50, norm_last_layer=norm_last_layer, hidden_dim=32, bottleneck_dim=16
    )
    assert list(ours.state_dict()) == list(ref.state_dict())
    with torch.no_grad():
        ours.last_layer.weight_g.mul_(torch.rand(50, 1) + 0.5)  # a trained g, not all ones
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(7, 24)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-6)
    trained = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trained == {n for n, p in ref.named_parameters() if p.requires_grad}
    assert ("last_layer.weight_g" in trained) is not norm_last_layer


# ---- the losses -------------------------------------------------------------------------------------------------
def test_the_dino_loss_and_its_centre_are_main_dinos_over_epochs_of_warming_temperature(one_process):
    torch.manual_seed(0)
    K, B, ncrops, epochs = 40, 6, 5, 6
    ref = reference("dino", "main_dino").DINOLoss(K, ncrops, 0.04, 0.07, 3, epochs)
    ours = L.DINOLoss(K)
    for epoch in range(epochs):
        student, teacher = torch.randn(ncrops * B, K) * 3, torch.randn(2 * B, K) * 3
        temp = L.teacher_temperature(epoch, 0.04, 0.07, 3)
        assert temp == pytest.approx(ref.teacher_temp_schedule[epoch], abs=1e-15)
        expected = ref(student, teacher, epoch)
        targets = ours.targets(teacher, temp, "center").chunk(2)
        got = ours(student.chunk(ncrops), targets)
        ours.update_center(teacher)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours.center, ref.center, atol=1e-7, rtol=1e-6)


def test_dinov2s_global_and_local_terms_add_up_to_the_same_loss():
    """ssl_meta_arch.forward_backward: local crops against both teacher views, the global crops against the other
    one (teacher views swapped), scaled by 1 / (2 + 2 x locals) and x 2: DINO's mean over pairs."""
    torch.manual_seed(1)
    K, B, n_local = 30, 4, 3
    teacher = torch.softmax(torch.randn(2 * B, K) / 0.07, -1)
    s_global, s_local = torch.randn(2 * B, K), torch.randn(n_local * B, K)
    t = teacher.view(2, B, K)
    swapped = torch.cat((t[1], t[0]))
    terms = 2 * n_local + 2
    local = dinov2_losses().DINOLoss(K)(s_local.chunk(n_local), t) / terms
    glob = dinov2_losses().DINOLoss(K)([s_global], [swapped]) * 2 / terms
    ours = L.DINOLoss(K)(list(s_global.chunk(2)) + list(s_local.chunk(n_local)), list(teacher.chunk(2)))
    torch.testing.assert_close(ours, local + glob, atol=1e-6, rtol=1e-6)


def test_sinkhorn_knopp_is_dinov2s_for_class_tokens_and_masked_patches(one_process):
    torch.manual_seed(2)
    teacher = torch.randn(12, 20) * 2
    torch.testing.assert_close(
        L.sinkhorn_knopp(teacher, 0.07), dinov2_losses().DINOLoss(20).sinkhorn_knopp_teacher(teacher, 0.07)
    )
    patches, count = teacher[:9] * 0.5, torch.tensor(9.0)  # (its exp overflows float32 past ~88: the reference's too)
    expected = dinov2_losses().iBOTPatchLoss(20).sinkhorn_knopp_teacher(patches, 0.04, n_masked_patches_tensor=count)
    torch.testing.assert_close(L.sinkhorn_knopp(patches, 0.04, count=count), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(L.DINOLoss(20).targets(teacher, 0.07, "sinkhorn_knopp"), L.sinkhorn_knopp(teacher, 0.07))


def test_the_ibot_loss_and_its_patch_centre_are_dinov2s():
    torch.manual_seed(3)
    masks = torch.zeros(4, 9, dtype=torch.bool)
    masks[0, [1, 2, 5]] = True
    masks[2, [0, 8]] = True  # images 1 and 3 unmasked
    M, K = int(masks.sum()), 16
    student, teacher_logits = torch.randn(M, K), torch.randn(M, K)
    loss = L.DINOLoss(K, patch=True)
    targets = loss.targets(teacher_logits, 0.07, "center")
    torch.testing.assert_close(targets, F.softmax(teacher_logits / 0.07, -1))
    expected = dinov2_losses().iBOTPatchLoss(K).forward_masked(student, targets, masks)
    torch.testing.assert_close(L.ibot_loss(student, targets, masks, 0.1), expected, atol=1e-6, rtol=1e-6)
    loss.update_center(teacher_logits.unsqueeze(0))  # iBOTPatchLoss.reduce_center_update / apply_center_update
    center = torch.zeros(1, 1, K) * 0.9 + torch.sum(teacher_logits.unsqueeze(0).mean(1), dim=0, keepdim=True) * 0.1
    torch.testing.assert_close(loss.center, center, atol=1e-7, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:.*torch.cuda.amp.autocast.*:FutureWarning")  # theirs, as written
def test_koleo_is_dinov2s():
    torch.manual_seed(4)
    x = torch.randn(10, 8)
    torch.testing.assert_close(L.koleo_loss(x), dinov2_losses().KoLeoLoss()(x), atol=1e-6, rtol=1e-6)


# ---- schedules, the EMA step, clipping -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "base, final, epochs, niter, warmup, start",
    [(0.996, 1.0, 7, 5, 0, 0), (0.04, 0.4, 4, 3, 0, 0), (5e-4, 1e-6, 12, 4, 3, 0), (0.07, 0.07, 6, 2, 2, 0.04)],
)
def test_every_schedule_is_cosine_scheduler_step_by_step(base, final, epochs, niter, warmup, start):
    expected = reference("dino", "utils").cosine_scheduler(base, final, epochs, niter, warmup, start)
    total = epochs * niter
    ours = [L.cosine_schedule(i, base, final, total, warmup * niter, start) for i in range(total)]
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=1e-15)
    if start == 0:  # the learning rate's LambdaLR factor, x lr
        lr = [base * dino_cosine(i, warmup * niter, total, final / base) for i in range(total)]
        np.testing.assert_allclose(lr, expected, rtol=1e-12, atol=1e-15)


def test_the_ema_step_is_main_dinos():
    torch.manual_seed(5)
    student, teacher = nn.Linear(5, 3), nn.Linear(5, 3)
    ref = [p.detach().clone() for p in teacher.parameters()]
    m = 0.9961
    for param_q, param_k in zip(student.parameters(), ref, strict=True):  # main_dino.py train_one_epoch
        param_k.mul_(m).add_((1 - m) * param_q.detach().data)
    L.ema_update(list(teacher.parameters()), list(student.parameters()), m)
    for ours, expected in zip(teacher.parameters(), ref, strict=True):
        torch.testing.assert_close(ours.detach(), expected, atol=1e-7, rtol=1e-6)


def test_clipping_is_dinos_per_parameter():
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2))
    for p in net.parameters():
        p.grad = torch.randn_like(p) * torch.rand(()) * 5
    theirs = copy.deepcopy(net)
    for mine, their in zip(net.parameters(), theirs.parameters(), strict=True):
        their.grad = mine.grad.clone()  # (deepcopy leaves gradients out)
    reference("dino", "utils").clip_gradients(theirs, 3.0)
    expected = [p.grad for p in theirs.parameters()]
    L.clip_per_parameter(net.parameters(), 3.0)
    for p, e in zip(net.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e, atol=1e-6, rtol=1e-6)
    assert any(e.norm() < 3.0 for e in expected) and any(p.grad.norm() == pytest.approx(3.0) for p in net.parameters())


# ---- iBOT's masks -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hw, count", [((8, 8), 20), ((14, 14), 90), ((4, 4), 7), ((6, 6), 0)])
def test_block_masks_are_dinov2s_draw_for_draw(hw, count):
    n = hw[0] * hw[1]
    random.seed(7)
    expected = RefMaskingGenerator(hw, max_num_patches=0.5 * n)(count)
    ours = block_mask(hw, count, random.Random(7), max_patches=0.5 * n)
    assert ours.numpy().tolist() == expected.tolist()


def test_a_batchs_masks_are_dinov2s_collate():
    random.seed(8)
    hw = (6, 6)
    expected = ref_collate_masks(10, 36, (0.1, 0.5), 0.5, RefMaskingGenerator(hw, max_num_patches=0.5 * 36))
    ours = collate_masks(10, hw, 0.5, (0.1, 0.5), random.Random(8))
    assert torch.equal(ours, expected)
    assert (ours.sum(1) > 0).sum() == 5
