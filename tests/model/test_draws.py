"""model/draws.py: within drawn_by_rows, dropout (elementwise and attention's) draws by a sample's row of the global
batch, so two processes' halves of a batch are dropped as one process drops the whole (issue 78)."""

import copy

import pytest
import torch

from tests.training.test_compile import eager_backend  # noqa: F401 (a fixture)
from vitlab.model.attention import Attention
from vitlab.model.draws import Dropout, Rows, drawn_by_rows, keep_mask, random_order


def _split(net, x, processes: int, seed: int = 5):
    """`net` on the whole batch `x` in one process, and on each of `processes` contiguous shares."""
    n = x.shape[0]
    with drawn_by_rows(net, seed, 0, n, n):
        whole = net(x)
    count, shares = n // processes, []
    for r in range(processes):
        with drawn_by_rows(net, seed, r * count, count, n):
            shares.append(net(x[r * count : (r + 1) * count]))
    return whole, torch.cat(shares)


@pytest.mark.parametrize("processes", [2, 4])
def test_dropout_draws_a_samples_mask_by_its_row_of_the_global_batch(processes):
    net = torch.nn.Sequential(Dropout(0.3), torch.nn.Linear(6, 6), Dropout(0.3)).train()
    x = torch.randn(8, 5, 6, generator=torch.Generator().manual_seed(0))
    state = torch.get_rng_state()
    whole, shares = _split(net, x, processes)
    assert torch.equal(torch.get_rng_state(), state)  # torch's generator untouched
    torch.testing.assert_close(whole, shares, rtol=0, atol=0)
    with drawn_by_rows(net, 6, 0, 8, 8):  # another step's seed: another mask
        assert not torch.equal(net(x) == 0, whole == 0)
    net.eval()
    assert torch.equal(net[0](x), x)


def test_attention_dropout_within_rows_is_the_rows_and_is_sdpa_without_dropout():
    torch.manual_seed(0)
    attn = Attention(16, 4, attn_drop=0.25, proj_drop=0.1).train()
    x = torch.randn(4, 7, 16)
    whole, shares = _split(attn, x, 2)
    torch.testing.assert_close(whole, shares, rtol=1e-6, atol=1e-6)  # (matmuls over another batch size)
    # the materialised path is SDPA's: with nothing dropped the two agree, masks included
    attn.attn_drop, attn.proj_drop.p = 1e-9, 0.0
    mask = torch.rand(4, 1, 7, 7) > 0.3
    mask[..., 0] = True
    with drawn_by_rows(attn, 5, 0, 4, 4):
        ours = attn._attend(*attn._rotated(x, None), None, mask)
    attn.eval()
    torch.testing.assert_close(ours, attn._attend(*attn._rotated(x, None), None, mask), rtol=1e-5, atol=1e-6)


def test_keep_masks_keep_at_their_rate_and_differ_by_row_and_place():
    rows = Rows.of(3, 0, 64, 64)
    mask = keep_mask(torch.empty(64, 50, 40), 0.7, rows, 1)
    assert abs(mask.float().mean().item() - 0.7) < 0.01
    per_row, per_place = mask.float().mean((1, 2)), mask.float().mean(0)
    assert per_row.std() < 0.02 and per_place.std() < 0.1  # no row or place favoured
    assert not torch.equal(mask[0], mask[1]) and not torch.equal(mask, keep_mask(torch.empty(64, 50, 40), 0.7, rows, 2))
    # neighbouring elements are unrelated: the correlation of a place with the next is noise
    flat = mask.float().flatten()
    assert abs(torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1]) < 0.01


def test_patch_orders_and_mae_masks_are_the_rows_own_and_permutations():
    from vitlab.model.mae import random_masking

    net = torch.nn.Identity()
    n, length = 8, 49
    whole = {}
    with drawn_by_rows(net, 5, 0, n, n):
        whole["order"], whole["mask"] = random_order(n, length, key=3), random_masking(n, length, 12)
    for r in range(2):
        with drawn_by_rows(net, 5, 4 * r, 4, n):
            assert torch.equal(random_order(4, length, key=3), whole["order"][4 * r : 4 * r + 4])
            kept, restore = random_masking(4, length, 12)
            assert torch.equal(kept, whole["mask"][0][4 * r : 4 * r + 4])
            assert torch.equal(restore, whole["mask"][1][4 * r : 4 * r + 4])
    assert torch.equal(whole["order"].sort(dim=1).values, torch.arange(length).expand(n, -1))  # permutations
    assert len({tuple(row.tolist()) for row in whole["order"]}) == n  # each image its own
    assert not torch.equal(whole["order"][:, :12].sort(1).values, whole["mask"][0].sort(1).values)  # keys apart


def _dropping_vit(depth: int):
    from tests.helpers.configs import tiny
    from vitlab.model.vit import ViT

    rates = dict(drop_path_rate=0.4, drop_path_uniform=True, proj_drop_rate=0.2, attn_drop_rate=0.2, drop_rate=0.2)
    return ViT(tiny(depth=depth, patch_drop_rate=0.25, **rates)).train()


@pytest.mark.usefixtures("eager_backend")
@pytest.mark.parametrize("regional, depths", [(False, [2]), (True, [2, 4])], ids=["compile", "regional"])
def test_a_compiled_model_draws_by_rows_as_the_eager_one_in_the_same_graphs_at_every_step(regional, depths):
    """Issue 78: compiled (the whole model, or each block as compile=regional), stochastic depth, every dropout and
    patch dropout draw each sample's randomness by its row of the global batch as the eager model does: the same
    outputs, on one process or two processes' halves, torch's generator untouched. The step's seed is an input of
    the graphs (another step draws anew with the graphs it has), and so is a block's site (compile=regional: as many
    graphs at depth 4 as at 2)."""
    from torch._dynamo.utils import counters

    graphs = []
    for depth in depths:
        torch.manual_seed(0)
        eager = _dropping_vit(depth)
        compiled = copy.deepcopy(eager)
        for region in compiled.blocks if regional else [compiled]:
            region.compile()
        x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        torch._dynamo.reset()
        counters.clear()
        state, made = torch.get_rng_state(), []
        for seed in (5, 6):
            whole, shares = _split(eager, x, 2, seed)
            torch.testing.assert_close(whole, shares, rtol=1e-6, atol=1e-6)
            ours, halves = _split(compiled, x, 2, seed)
            torch.testing.assert_close(ours, whole, rtol=0, atol=0)
            torch.testing.assert_close(halves, shares, rtol=0, atol=0)
            made.append(counters["stats"]["unique_graphs"])
        assert torch.equal(torch.get_rng_state(), state)
        assert made[0] == made[1]  # (one per shape of batch and process: 4 rows from 0, 2 from 0, 2 from 2)
        graphs.append(made[0])
    assert len(set(graphs)) == 1


def test_compiled_by_inductor_dropout_keeps_what_the_eager_one_keeps():
    """The hash is int32 arithmetic that wraps: inductor's generated code keeps the same elements."""
    drop = Dropout(0.3).train()
    x = torch.randn(4, 33, 8, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(drop)
    for seed in (5, 6):
        with drawn_by_rows(drop, seed, 4, 4, 12):
            assert torch.equal(compiled(x), drop(x))
    torch._dynamo.reset()


def test_a_draw_moves_nothing_from_the_host_to_the_models_device():
    """A tensor copied from the host to a GPU makes the host wait for the GPU's queue: every tensor a draw makes
    (the step's keys, the rows' numbers, the hash) is made on the model's device. Checked on the meta device: no
    operation of a step's stochastic depth, dropout or patch order takes a host tensor and gives a meta one."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from vitlab.model.layers import DropPath

    crossings = []

    class Crossings(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            devices = {t.device.type for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
            if {"cpu", "meta"} <= devices:
                crossings.append(func)
            return out

    net = torch.nn.Sequential(DropPath(0.5), Dropout(0.3)).to("meta").train()
    x = torch.empty(8, 5, 6, device="meta")
    with drawn_by_rows(net, 5, 4, 4, 12), Crossings():
        net(x[:4])
        random_order(4, 7, x.device, key=1)
    assert crossings == []
