"""Seeds made of several numbers (the run's seed, an epoch, an image, a layer): `mix`."""

from __future__ import annotations


def mix(*numbers: int) -> int:
    """A 63-bit seed from `numbers` (splitmix64 steps): neighbouring inputs give unrelated seeds."""
    h = 0
    for n in numbers:
        h = (h ^ n) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ h >> 30) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ h >> 27) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h >> 1
