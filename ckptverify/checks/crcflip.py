"""Locate a single flipped bit from a CRC-32 mismatch alone.

CRC-32 is linear: flipping bit ``k`` of an ``L``-byte message changes the CRC by ``T^(8L - k)(1)`` (``T``: one
reflected register step), so the syndrome gives ``8L - k`` as a discrete log, found by baby-step giant-step in
``O(sqrt(8L))``; unique below period ``2^32 - 1``. The converse fails: a multi-bit error matches *some* single
bit with probability about ``8L / 2^32``, so callers must say "consistent with one flipped bit", never certain.
"""

from __future__ import annotations

import functools
import math
import operator

_POLY = 0xEDB88320
_MASK = 0xFFFFFFFF
#: Messages longer than this many bits are not searched: the chance of a false match grows too large.
MAX_BITS = 1 << 28


def _step(r: int) -> int:
    return (r >> 1) ^ (_POLY if r & 1 else 0)


def _unstep(y: int) -> int:
    # T(r) sets bit 31 exactly when r was odd (the polynomial has bit 31 set), so T is invertible.
    if y & 0x80000000:
        return (((y ^ _POLY) << 1) | 1) & _MASK
    return (y << 1) & _MASK


@functools.lru_cache(maxsize=16)
def _steps(m: int) -> tuple[dict[int, int], list[list[int]]]:
    """Baby steps ``T^j(1) -> j`` (``j < m``) and the tables of ``T^-m``; cached per message length (a damaged
    checkpoint has many damaged records of one length), read-only once built."""
    baby: dict[int, int] = {}
    v = 1
    for j in range(m):
        baby.setdefault(v, j)
        v = _step(v)
    return baby, _power_tables(m)


def _power_tables(m: int) -> list[list[int]]:
    """Byte tables of the linear map T^-m, so applying it costs four lookups."""
    columns = []
    for b in range(32):
        v = 1 << b
        for _ in range(m):
            v = _unstep(v)
        columns.append(v)
    # Entry ``byte`` of table ``t``: the XOR of the columns of the bits set in byte ``t`` of the input.
    return [[functools.reduce(operator.xor, (columns[8 * t + bit] for bit in range(8) if byte >> bit & 1), 0)
             for byte in range(256)] for t in range(4)]


def false_match_probability(nbytes: int) -> float:
    """Chance that a random multi-bit error is mistaken for a single flipped bit in ``nbytes`` bytes."""
    return min(1.0, 8 * nbytes / float(1 << 32))


def locate_single_bit(recorded: int, computed: int, nbytes: int) -> tuple[int, int] | None:
    """``(byte, bit)`` (bit 0 = LSB) of the one flipped bit that explains the mismatch, or ``None`` (CRCs agree,
    message over :data:`MAX_BITS`, or no single flip fits)."""
    syndrome = (recorded ^ computed) & _MASK
    n_bits = 8 * nbytes
    if syndrome == 0 or n_bits == 0 or n_bits > MAX_BITS:
        return None
    m = math.isqrt(n_bits) + 1
    baby, (t0, t1, t2, t3) = _steps(m)
    y = syndrome
    for i in range(n_bits // m + 2):
        j = baby.get(y)
        if j is not None:
            d = i * m + j
            if 1 <= d <= n_bits:
                k = n_bits - d
                return k // 8, k % 8
        y = t0[y & 255] ^ t1[(y >> 8) & 255] ^ t2[(y >> 16) & 255] ^ t3[y >> 24]
    return None
