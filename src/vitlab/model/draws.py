"""Random draws that belong to a sample's row of the global batch, not to the process that holds it (issue 78).

Within `drawn_by_rows` (a training step of a run whose data order is global: data/seeded.py), each layer that
draws (a "site": stochastic depth, dropout, attention dropout, patch dropout) and MAE's masking draw a sample's
randomness from (the step's seed, the site, the sample's row of the global batch): the same whichever process holds
the sample and however many share the batch, so a run resumed on another number of processes goes on exactly.
Within `drawn_by_images` (an evaluated batch) MAE's masks are keyed by each image's index in its split instead.
Elsewhere (a compiled graph, a batch that is not whole rows, no global order) they draw from torch's generator.

Dropout's keep masks and the patch orders are counter-based: a hash of (site, row, element) computed on the
tensor's device, so no process draws more than its own rows (a mask drawn for the global batch would cost every
process the whole batch).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from vitlab.utils.seeds import mix


class Rows(NamedTuple):
    """This process's rows of a global batch: `count` rows from `start` of `total`; `seed`: the step's. Or, with
    `numbers`, the rows those numbers (of `total`: an evaluated image's index in its split)."""

    seed: int
    start: int
    count: int
    total: int
    numbers: torch.Tensor | None = None


_ROWS: ContextVar[Rows | None] = ContextVar("vitlab_drawn_by_rows", default=None)


@contextmanager
def drawn_by_rows(model: nn.Module, seed: int, start: int, count: int, total: int) -> Iterator[None]:
    """Within it, `model`'s draw sites draw by (`seed`, site, row of a global batch of `total`), this process holding
    `count` rows from `start`. A batch of m x `count` rows is m views of the batch one after the other (multi-crop's),
    each drawn as its own global batch (keyed by m and the shape, so global and local crops draw apart)."""
    if not hasattr(model, "draw_sites"):  # (a ViT numbers its sites when built: copies keep them)
        number_draw_sites(model)
    token = _ROWS.set(Rows(seed, start, count, total))
    try:
        yield
    finally:
        _ROWS.reset(token)


@contextmanager
def drawn_by_images(seed: int, numbers: torch.Tensor, total: int) -> Iterator[None]:
    """Within it, a batch's draws (objective=mae's masks in evaluation) are by each image's number (`numbers`, its
    index in a split of `total`): the same whichever process evaluates the image."""
    token = _ROWS.set(Rows(seed, 0, len(numbers), total, numbers.to("cpu", torch.int64)))
    try:
        yield
    finally:
        _ROWS.reset(token)


def number_draw_sites(model: nn.Module) -> None:
    """Number `model`'s draw sites (the modules with a `site`) in order: each draws with its own key."""
    sites = [m for m in model.modules() if hasattr(m, "site")]
    for site, layer in enumerate(sites):
        layer.site = site
    model.draw_sites = len(sites)


def rows_for(n: int) -> Rows | None:
    """The rows a batch of `n` (a batch, or m views of it stacked) draws by, or None: draw from torch's generator."""
    if torch.compiler.is_compiling():  # (a compiled graph draws from torch's generator)
        return None
    rows = _ROWS.get()
    return None if rows is None or n % rows.count else rows


def row_numbers(n: int, rows: Rows) -> torch.Tensor:
    """The global row of each of a batch's `n` rows (int64, on the CPU): view j's rows count from j x total."""
    m = n // rows.count
    numbers = rows.numbers if rows.numbers is not None else rows.start + torch.arange(rows.count)
    return (torch.arange(m)[:, None] * rows.total + numbers).reshape(-1)


_LOW16, _LOW17 = 0xFFFF, 0x1FFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)  # lowbias32's multipliers, as int32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons' integer hash) on int32 tensors: wrapping products, logical shifts by masking."""
    x = x ^ (x >> 16) & _LOW16
    x = x * _M1
    x = x ^ (x >> 15) & _LOW17
    x = x * _M2
    return x ^ (x >> 16) & _LOW16


def hashed(shape: tuple[int, ...], rows: Rows, key: tuple[int, ...], device=None) -> torch.Tensor:
    """31 random bits for each element of a tensor of `shape` (int32 >= 0, on `device`): a hash of (`rows.seed`,
    `key`, the shape, the element's row of the global batch, its place in the row)."""
    k = mix(rows.seed, *key, *shape[1:])
    a, b = (torch.tensor(k >> s & 0x7FFFFFFF, dtype=torch.int32) for s in (0, 31))
    global_rows = row_numbers(shape[0], rows).to(torch.int32)
    ka, kb = _hash32(global_rows ^ a), _hash32(_hash32(global_rows ^ b) ^ a)  # two keys a row
    places = torch.arange(math.prod(shape[1:]), dtype=torch.int32, device=device)
    ka, kb = ka.to(device)[:, None], kb.to(device)[:, None]
    return (_hash32(_hash32(places ^ ka) ^ kb) & 0x7FFFFFFF).view(shape)


def keep_mask(x: torch.Tensor, keep: float, rows: Rows, *key: int) -> torch.Tensor:
    """A keep mask shaped like `x` (bool, on its device), each element kept with probability `keep`: `hashed`'s."""
    return (hashed(tuple(x.shape), rows, key, x.device) & 0xFFFFFF) < round(keep * (1 << 24))


def random_order(n: int, length: int, device=None, key: int = 0) -> torch.Tensor:
    """A random permutation of range(length) per row (n, length): from torch's generator (as timm draws it), or
    within `drawn_by_rows` the row's own (`hashed`'s numbers, sorted stably; `key`: the draw's)."""
    rows = rows_for(n)
    if rows is None:
        return torch.randn(n, length, device=device).argsort(dim=-1)
    return hashed((n, length), rows, (key,), device).argsort(dim=-1, stable=True)


class Dropout(nn.Dropout):
    """nn.Dropout (elementwise, scaled by 1/(1-p)), a draw site: within `drawn_by_rows` by the sample's row."""

    def __init__(self, p: float = 0.5):
        super().__init__(p)
        self.site = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = rows_for(x.shape[0]) if self.training and self.p > 0 else None
        if rows is None:
            return super().forward(x)
        return x * keep_mask(x, 1.0 - self.p, rows, self.site).to(x.dtype) / (1.0 - self.p)


def sdpa(q, k, v, attn_mask: torch.Tensor | None, p: float, site: int, part: int = 0) -> torch.Tensor:
    """F.scaled_dot_product_attention with attention dropout `p` (0 outside training); within `drawn_by_rows` the
    dropout's mask is the rows' (`site`, `part`: which of a layer's attentions), the probabilities materialised."""
    rows = rows_for(q.shape[0]) if p > 0 else None
    if rows is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = scores.softmax(dim=-1)
    return (probs * keep_mask(probs, 1.0 - p, rows, site, part).to(probs.dtype) / (1.0 - p)) @ v
