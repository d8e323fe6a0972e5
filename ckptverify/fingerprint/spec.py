"""The definition of the logical tensor fingerprint, in one place (``docs/fingerprint.md``): version, 64-bit
arithmetic, ``K``, the two lane mixers and :func:`mix`, dtype names and seeds, and :func:`numpy_lanes`. Every
implementation reads its constants here and runs :func:`mix`, except Triton (which cannot call Python; tests hold
it to it). No torch import."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["DTYPE_NAMES", "FINGERPRINT_VERSION", "INDEX_MULTIPLIER", "LANES", "MASK64", "Mixer", "add_lanes",
           "dtype_seed", "mix", "numpy_lanes", "signed"]

W = TypeVar("W")

#: Version of the tensor fingerprint algorithm; any change to its values bumps it.
FINGERPRINT_VERSION = 1

#: The fingerprint's arithmetic is modulo 2**64.
MASK64 = (1 << 64) - 1

#: K: the odd multiplier that spreads the global index over 64 bits before it meets the element's bits.
INDEX_MULTIPLIER = 0x9E3779B97F4A7C15


def signed(value: int) -> int:
    """The int64 (two's complement) reading of a value taken modulo 2**64."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def add_lanes(parts: Iterable[Sequence[int]]) -> tuple[int, int]:
    """The lane sums of disjoint parts (each ``(lane 0, lane 1, ...)``, any further items ignored): sums mod 2**64,
    in any order."""
    a = b = 0
    for part in parts:
        a += part[0]
        b += part[1]
    return a & MASK64, b & MASK64


@dataclass(frozen=True)
class Mixer:
    """``x ^= x >> s1; x *= m1; x ^= x >> s2; x *= m2; x ^= x >> s3`` (logical shifts, modulo 2**64)."""

    shifts: tuple[int, int, int]
    multipliers: tuple[int, int]


#: Lane 0 mixes with the MurmurHash3 ``fmix64`` finalizer, lane 1 with the SplitMix64 finalizer
#: (Stafford's "Mix13"). Both are bijections of 64-bit words.
LANES: tuple[Mixer, Mixer] = (
    Mixer((33, 33, 33), (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)),
    Mixer((30, 27, 31), (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)),
)


def _xorshift(x: Any, s: Any) -> Any:
    return x ^ (x >> s)


def _multiply(x: Any, m: Any) -> Any:
    return (x * m) & MASK64


def mix(x: W, mixer: Mixer, xorshift: Callable[[W, Any], W] = _xorshift,
        multiply: Callable[[W, Any], W] = _multiply) -> W:
    """The fingerprint's mixing step (the one definition): ``mixer`` applied to unsigned 64-bit words ``x``.
    ``xorshift(x, s)`` (logical shift) and ``multiply(x, m)`` (mod 2**64) default to Python ints and numpy
    ``uint64``; a backend needing other operations (torch's arithmetic shift) passes its own."""
    s1, s2, s3 = mixer.shifts
    m1, m2 = mixer.multipliers
    return xorshift(multiply(xorshift(multiply(xorshift(x, s1), m1), s2), m2), s3)


def numpy_lanes(words: Any, index: Any, seeds: Sequence[int], starts: Any = None) -> tuple[Any, Any]:
    """Lane sums in numpy: each lane sums ``mix(word ^ (index * K + seed))`` mod 2**64 over ``words`` (bits
    sign-extended
    to 64) and ``index`` (uint64). One ``uint64`` per lane, or with ``starts`` one per consecutive tensor."""
    import numpy as np

    w = words.view(np.uint64)
    p = index * np.uint64(INDEX_MULTIPLIER)
    lanes = []
    with np.errstate(over="ignore"):
        for seed, mixer in zip(seeds, LANES, strict=True):
            y = mix(w ^ (p + np.uint64(seed)), mixer)
            lanes.append(np.add.reduceat(y, starts, dtype=np.uint64) if starts is not None
                         else y.sum(dtype=np.uint64))
    return lanes[0], lanes[1]


#: Dtypes the fingerprint is defined for; complex via its real view, under its own name.
DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool",
    "complex32", "complex64", "complex128",
)  # fmt: skip


@functools.cache
def dtype_seed(name: str, lane: int) -> int:
    """S: the per-dtype, per-lane seed, as an unsigned 64-bit integer."""
    text = f"ckptverify/fingerprint/v{FINGERPRINT_VERSION}/lane{lane}/{name}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")
