"""CRC-32 over a reader's ``fold``: the one definition the local and the remote readers' ``crc32`` share.

Apart from both readers so that neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable

from isal.isal_zlib import crc32

__all__ = ["fold_crc32"]


def fold_crc32(fold: Callable[..., None], start: int, end: int,
               progress: Callable[[int], None] | None = None) -> int:
    """CRC-32 (zip's) of bytes ``[start, end)`` of a reader, through its ``fold`` (the one definition every
    reader's ``crc32`` uses)."""
    value = 0

    def step(view: memoryview) -> None:
        nonlocal value
        value = crc32(view, value)

    fold(start, end, step, progress)
    return value
