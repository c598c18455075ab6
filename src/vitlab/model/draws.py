"""Random draws that belong to a sample's row of the global batch, not to the process that holds it (issue 78).

Within `drawn_by_rows` (a training step of a run whose data order is global: data/seeded.py), each layer that
draws (a "site": stochastic depth, dropout, attention dropout) draws a sample's randomness from (the step's seed,
the site, the sample's row of the global batch): the same whichever process holds the sample and however many
share the batch, so a run resumed on another number of processes goes on exactly. Elsewhere (evaluation, a
compiled graph, a batch that is not whole rows) the layers draw from torch's generator as usual.

Dropout's keep masks are counter-based: a hash of (site, row, element) computed on the tensor's device, so no
process draws more than its own rows (a mask drawn for the global batch would cost every process the whole batch).
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
    """This process's rows of a global batch: `count` rows from `start` of `total`; `seed`: the step's."""

    seed: int
    start: int
    count: int
    total: int


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


def number_draw_sites(model: nn.Module) -> None:
    """Number `model`'s draw sites (the modules with a `site`) in order: each draws with its own key."""
    sites = [m for m in model.modules() if hasattr(m, "site")]
    for site, layer in enumerate(sites):
        layer.site = site
    model.draw_sites = len(sites)


def rows_for(x: torch.Tensor) -> Rows | None:
    """The rows `x` (a batch, or m views of it stacked) draws by, or None: draw from torch's generator."""
    if torch.compiler.is_compiling():  # (a compiled graph draws from torch's generator)
        return None
    rows = _ROWS.get()
    return None if rows is None or x.shape[0] % rows.count else rows


def row_numbers(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The global row of each of `x`'s rows (int64, on the CPU): view j's rows count from j x total."""
    m = x.shape[0] // rows.count
    return (torch.arange(m)[:, None] * rows.total + rows.start + torch.arange(rows.count)).reshape(-1)


_LOW16, _LOW17 = 0xFFFF, 0x1FFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)  # lowbias32's multipliers, as int32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons' integer hash) on int32 tensors: wrapping products, logical shifts by masking."""
    x = x ^ (x >> 16) & _LOW16
    x = x * _M1
    x = x ^ (x >> 15) & _LOW17
    x = x * _M2
    return x ^ (x >> 16) & _LOW16


def keep_mask(x: torch.Tensor, keep: float, rows: Rows, *key: int) -> torch.Tensor:
    """A keep mask shaped like `x` (bool, on its device), each element kept with probability `keep`: a hash of
    (`rows.seed`, `key`, x's shape, the element's row of the global batch, its place in the row)."""
    k = mix(rows.seed, *key, *x.shape[1:])
    a, b = (torch.tensor(k >> s & 0x7FFFFFFF, dtype=torch.int32) for s in (0, 31))
    global_rows = row_numbers(x, rows).to(torch.int32)
    ka, kb = _hash32(global_rows ^ a), _hash32(_hash32(global_rows ^ b) ^ a)  # two keys a row
    places = torch.arange(math.prod(x.shape[1:]), dtype=torch.int32, device=x.device)
    ka, kb = ka.to(x.device)[:, None], kb.to(x.device)[:, None]
    bits = _hash32(_hash32(places ^ ka) ^ kb) & 0xFFFFFF
    return (bits < round(keep * (1 << 24))).view(x.shape)


class Dropout(nn.Dropout):
    """nn.Dropout (elementwise, scaled by 1/(1-p)), a draw site: within `drawn_by_rows` by the sample's row."""

    def __init__(self, p: float = 0.5):
        super().__init__(p)
        self.site = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = rows_for(x) if self.training and self.p > 0 else None
        if rows is None:
            return super().forward(x)
        return x * keep_mask(x, 1.0 - self.p, rows, self.site).to(x.dtype) / (1.0 - self.p)


def sdpa(q, k, v, attn_mask: torch.Tensor | None, p: float, site: int, part: int = 0) -> torch.Tensor:
    """F.scaled_dot_product_attention with attention dropout `p` (0 outside training); within `drawn_by_rows` the
    dropout's mask is the rows' (`site`, `part`: which of a layer's attentions), the probabilities materialised."""
    rows = rows_for(q) if p > 0 else None
    if rows is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = scores.softmax(dim=-1)
    return (probs * keep_mask(probs, 1.0 - p, rows, site, part).to(probs.dtype) / (1.0 - p)) @ v
