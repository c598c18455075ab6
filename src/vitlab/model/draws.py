"""Random draws that belong to a sample's row of the global batch, not to the process that holds it (issue 78).

Within `drawn_by_rows` (a training step of a run whose data order is global: data/seeded.py), each layer that
draws (a "site": stochastic depth, dropout, attention dropout, patch dropout) and MAE's masking draw a sample's
randomness from (the step's seed, the site, the sample's row of the global batch): the same whichever process holds
the sample and however many share the batch, so a run resumed on another number of processes goes on exactly.
Within `drawn_by_images` (an evaluated batch) MAE's masks are keyed by each image's index in its split instead.
Elsewhere (a batch that is not whole rows, no global order) they draw from torch's generator.

Every draw is counter-based: a hash of (step, site, row, element) computed on the tensor's device, so no process
draws more than its own rows (a mask drawn for the global batch would cost every process the whole batch). Compiled
(compile=true|regional) a model draws the same: the step's seed enters the graph as a tensor (`Rows.keys`) and each
site's number as a buffer (`DrawSite.site_key`), inputs rather than constants, so one graph serves every step and
compile=regional's blocks share one graph as before.
"""

from __future__ import annotations

import itertools
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
    """This process's rows of a global batch: `count` rows from `start` of `total`; `seed`: the step's, and `keys` the
    same as two 31-bit int32 numbers (a tensor, which a compiled graph takes as an input). Or, with `numbers`, the rows
    those numbers (of `total`: an evaluated image's index in its split)."""

    seed: int
    start: int
    count: int
    total: int
    numbers: torch.Tensor | None = None
    keys: torch.Tensor | None = None

    @classmethod
    def of(cls, seed: int, start: int, count: int, total: int, numbers=None, device=None) -> Rows:
        """The rows with their `keys` on `device` (filled there: no copy from the host, which would wait for a GPU)."""
        keys = torch.empty(2, dtype=torch.int32, device=device)
        keys[0], keys[1] = seed & 0x7FFFFFFF, seed >> 31 & 0x7FFFFFFF
        return cls(seed, start, count, total, numbers, keys)


_ROWS: ContextVar[Rows | None] = ContextVar("vitlab_drawn_by_rows", default=None)


@contextmanager
def drawn_by_rows(model: nn.Module, seed: int, start: int, count: int, total: int) -> Iterator[None]:
    """Within it, `model`'s draw sites draw by (`seed`, site, row of a global batch of `total`), this process holding
    `count` rows from `start`. A batch of m x `count` rows is m views of the batch one after the other (multi-crop's),
    each drawn as its own global batch (keyed by m and the shape, so global and local crops draw apart)."""
    if not hasattr(model, "draw_sites"):  # (a ViT numbers its sites when built: copies keep them)
        number_draw_sites(model)
    held = next(itertools.chain(model.parameters(), model.buffers()), None)  # (the device the model draws on)
    token = _ROWS.set(Rows.of(mix(seed), start, count, total, device=held.device if held is not None else None))
    try:
        yield
    finally:
        _ROWS.reset(token)


@contextmanager
def drawn_by_images(seed: int, numbers: torch.Tensor, total: int) -> Iterator[None]:
    """Within it, a batch's draws (objective=mae's masks in evaluation) are by each image's number (`numbers`, its
    index in a split of `total`): the same whichever process evaluates the image."""
    token = _ROWS.set(Rows.of(mix(seed), 0, len(numbers), total, numbers.to("cpu", torch.int64)))
    try:
        yield
    finally:
        _ROWS.reset(token)


class DrawSite(nn.Module):
    """A module that draws: its number among the model's sites, `site`, and the same as `site_key`, an int32
    buffer (not saved; made again after every move, so a model built on the meta device or moved has it): a compiled
    block's input rather than a constant, so compile=regional's blocks share one graph."""

    def __init__(self, *args, **kwargs) -> None:  # (cooperative: a block's classes pass their arguments on)
        super().__init__(*args, **kwargs)
        self.site = 0
        self.register_buffer("site_key", torch.zeros((), dtype=torch.int32), persistent=False)

    def number(self, site: int) -> None:
        self.site = site
        self.site_key = torch.full((), site, dtype=torch.int32, device=self.site_key.device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.number(self.site)
        return self


def number_draw_sites(model: nn.Module) -> None:
    """Number `model`'s draw sites (DrawSite modules) in order: each draws with its own key."""
    sites = [m for m in model.modules() if isinstance(m, DrawSite)]
    for site, layer in enumerate(sites):
        layer.number(site)
    model.draw_sites = len(sites)


def rows_for(n: int) -> Rows | None:
    """The rows a batch of `n` (a batch, or m views of it stacked) draws by, or None: draw from torch's generator.
    (Read in a compiled graph too: Dynamo reads the context variable, and guards on the rows being there and on
    their count.)"""
    rows = _ROWS.get()
    return None if rows is None or n % rows.count else rows


def row_numbers(n: int, rows: Rows, device=None) -> torch.Tensor:
    """The global row of each of a batch's `n` rows (int64, on `device`): view j's rows count from j x total."""
    m = n // rows.count
    if rows.numbers is not None:
        numbers = rows.numbers.to(device)
    else:  # (made on the device: no copy from the host)
        numbers = rows.start + torch.arange(rows.count, device=device)
    return (torch.arange(m, device=device)[:, None] * rows.total + numbers).reshape(-1)


_LOW16, _LOW17 = 0xFFFF, 0x1FFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)  # lowbias32's multipliers, as int32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons' integer hash) on int32 tensors: wrapping products, logical shifts by masking."""
    x = x ^ (x >> 16) & _LOW16
    x = x * _M1
    x = x ^ (x >> 15) & _LOW17
    x = x * _M2
    return x ^ (x >> 16) & _LOW16


def hashed(
    shape: tuple[int, ...], rows: Rows, key: tuple[int, ...], device=None, site: torch.Tensor | int = 0
) -> torch.Tensor:
    """31 random bits for each element of a tensor of `shape` (int32 >= 0, on `device`): a hash of (the step's
    `rows.keys`, the draw's `site` (a DrawSite's key), `key` and the shape, the element's row of the global batch, its
    place in the row). Integer tensor arithmetic only: compiled, it draws what it draws eagerly."""
    k = mix(*key, *shape[1:])  # (the draw's constants)
    keys = rows.keys.to(device)
    a = _hash32(_hash32(keys[0] ^ (k & 0x7FFFFFFF)) ^ site)
    b = _hash32(_hash32(keys[1] ^ (k >> 31 & 0x7FFFFFFF)) ^ site)
    global_rows = row_numbers(shape[0], rows, device).to(torch.int32)
    ka, kb = _hash32(global_rows ^ a)[:, None], _hash32(_hash32(global_rows ^ b) ^ a)[:, None]  # two keys a row
    places = torch.arange(math.prod(shape[1:]), dtype=torch.int32, device=device)
    return (_hash32(_hash32(places ^ ka) ^ kb) & 0x7FFFFFFF).view(shape)


def uniform(shape: tuple[int, ...], rows: Rows, key: tuple[int, ...], device=None, site=0) -> torch.Tensor:
    """`hashed`'s numbers as float64 uniform in [0, 1) on 2^-24 steps (each element's; a row's in a draw per row)."""
    return (hashed(shape, rows, key, device, site) & 0xFFFFFF).to(torch.float64) / (1 << 24)


def keep_mask(x: torch.Tensor, keep: float, rows: Rows, *key: int, site: torch.Tensor | int = 0) -> torch.Tensor:
    """A keep mask shaped like `x` (bool, on its device), each element kept with probability `keep`: `hashed`'s."""
    return (hashed(tuple(x.shape), rows, key, x.device, site) & 0xFFFFFF) < round(keep * (1 << 24))


def random_order(n: int, length: int, device=None, key: int = 0, site: torch.Tensor | int = 0) -> torch.Tensor:
    """A random permutation of range(length) per row (n, length): from torch's generator (as timm draws it), or
    within `drawn_by_rows` the row's own (`hashed`'s numbers, sorted stably; `key`, `site`: the draw's)."""
    rows = rows_for(n)
    if rows is None:
        return torch.randn(n, length, device=device).argsort(dim=-1)
    return hashed((n, length), rows, (key,), device, site).argsort(dim=-1, stable=True)


class Dropout(nn.Dropout, DrawSite):
    """nn.Dropout (elementwise, scaled by 1/(1-p)), a draw site: within `drawn_by_rows` by the sample's row."""

    def __init__(self, p: float = 0.5):
        super().__init__(p)  # (nn.Dropout's, then DrawSite's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = rows_for(x.shape[0]) if self.training and self.p > 0 else None
        if rows is None:
            return super().forward(x)
        return x * keep_mask(x, 1.0 - self.p, rows, site=self.site_key).to(x.dtype) / (1.0 - self.p)


def sdpa(q, k, v, attn_mask: torch.Tensor | None, p: float, site: torch.Tensor | int, part: int = 0) -> torch.Tensor:
    """F.scaled_dot_product_attention with attention dropout `p` (0 outside training); within `drawn_by_rows` the
    dropout's mask is the rows' (`site`, `part`: which of a layer's attentions), the probabilities materialised."""
    rows = rows_for(q.shape[0]) if p > 0 else None
    if rows is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = scores.softmax(dim=-1)
    return (probs * keep_mask(probs, 1.0 - p, rows, part, site=site).to(probs.dtype) / (1.0 - p)) @ v
