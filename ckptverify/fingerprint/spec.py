"""The constants that define the logical tensor fingerprint (see ``docs/fingerprint.md``), in one place.

Every implementation (the eager torch path, the compiled and numpy paths, the Triton kernel) and the
:class:`~ckptverify.fingerprint.logical.TensorFingerprint` it produces read their constants here: the version,
the 64-bit arithmetic, the index multiplier ``K``, the two lane mixers, the dtype names and the per-dtype
seeds. Importing this module imports no torch.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

__all__ = ["DTYPE_NAMES", "FINGERPRINT_VERSION", "INDEX_MULTIPLIER", "LANES", "MASK64", "Mixer", "dtype_seed",
           "mix_python", "signed"]

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


def mix_python(x: int, lane: int) -> int:
    """The lane's mixer on one unsigned 64-bit word, in plain Python (the reference for docs and tests)."""
    mixer = LANES[lane]
    s1, s2, s3 = mixer.shifts
    m1, m2 = mixer.multipliers
    x &= MASK64
    x ^= x >> s1
    x = (x * m1) & MASK64
    x ^= x >> s2
    x = (x * m2) & MASK64
    x ^= x >> s3
    return x


#: Element dtypes the fingerprint is defined for, by the name torch gives them. Complex dtypes are
#: fingerprinted through their real view (pairs of the matching float), under the complex dtype's own name.
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
