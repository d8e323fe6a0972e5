"""Bounded zstd decoding: numcodecs (zarr's codec, installed with zarr) after a scan of the frames (RFC 8878).

The scan bounds what the bytes can decode to before anything is inflated: a frame's declared content size, or
for a frame that declares none (a streaming writer's, e.g. DCP's ``stream.zstd``) its blocks' most (128 KiB a
compressed block, the stated size of a raw or RLE block). Only whole frames without dictionaries are accepted.
"""

from __future__ import annotations

import numpy as np

__all__ = ["decompress"]

_BLOCK_MAX = 128 << 10


def decompress(raw: bytes, limit: int, *, exact: bool = False) -> bytes:
    """``raw`` decoded, refused unbounded: at most ``limit`` bytes, or with ``exact`` exactly ``limit`` bytes that
    every frame declares (decoded into a buffer of that size). Raises :class:`ValueError` saying why."""
    from numcodecs import zstd

    most, declared = _scan(raw)
    if exact and (not declared or most != limit):
        raise ValueError(f"the zstd frames do not declare {limit} bytes")
    if most > limit:
        raise ValueError(f"the zstd stream {'decodes' if declared else 'may decode'} to more than {limit} bytes; "
                         "refused (a decompression bomb, or too large to check in memory)")
    try:
        if declared:
            out = np.empty(most, dtype=np.uint8)
            zstd.decompress(raw, out)
            return out.tobytes()
        return bytes(zstd.decompress(raw))
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"the zstd stream is corrupt: {exc}") from None


def _scan(raw: bytes) -> tuple[int, bool]:
    """(the most ``raw``'s frames decode to, whether that is exact: every frame declares its size)."""
    at, total, declared = 0, 0, True
    bad = ValueError("the zstd stream is corrupt or cut short (not whole frames, or uses a dictionary)")
    while at < len(raw):
        if len(raw) - at < 6:
            raise bad
        magic = int.from_bytes(raw[at:at + 4], "little")
        if 0x184D2A50 <= magic <= 0x184D2A5F:  # a skippable frame
            at += 8 + int.from_bytes(raw[at + 4:at + 8], "little")
            continue
        if magic != 0xFD2FB528:
            raise bad
        fhd = raw[at + 4]
        fcs_flag, single, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
        if dict_flag or fhd & 0x08:
            raise bad
        at += 5 + (0 if single else 1)
        fcs_size = (1 if single else 0) if fcs_flag == 0 else (2, 4, 8)[fcs_flag - 1]
        if at + fcs_size > len(raw):
            raise bad
        fcs = int.from_bytes(raw[at:at + fcs_size], "little") + (256 if fcs_size == 2 else 0)
        at += fcs_size
        blocks = 0
        while True:
            if at + 3 > len(raw):
                raise bad
            head = int.from_bytes(raw[at:at + 3], "little")
            last, kind, length = head & 1, (head >> 1) & 3, head >> 3
            if kind == 3:
                raise bad
            blocks += _BLOCK_MAX if kind == 2 else length
            at += 3 + (1 if kind == 1 else length)
            if last:
                break
        if fcs_size:
            total += fcs
        else:
            total, declared = total + blocks, False
        at += 4 if checksum else 0
    if at != len(raw):
        raise bad
    return total, declared
