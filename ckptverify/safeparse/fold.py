"""``fold`` and ``crc32`` shared by the local and remote readers, kept apart so neither imports the other."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from isal.isal_zlib import crc32

__all__ = ["Folding", "fold_crc32"]


def fold_crc32(fold: Callable[..., None], start: int, end: int,
               progress: Callable[[int], None] | None = None) -> int:
    """CRC-32 (zip's) of bytes ``[start, end)`` through a reader's ``fold``."""
    value = 0

    def step(view: memoryview) -> None:
        nonlocal value
        value = crc32(view, value)

    fold(start, end, step, progress)
    return value


class Folding(ABC):
    """``fold`` and ``crc32`` in terms of ``fold_at`` (calls ``fn(view, offset)`` on views covering
    ``[start, end)``; a view is valid only during its call)."""

    @abstractmethod
    def fold_at(self, start: int, end: int, fn: Callable[[memoryview, int], None],
                progress: Callable[[int], None] | None = None) -> None: ...

    def fold(self, start: int, end: int, fn: Callable[[memoryview], None],
             progress: Callable[[int], None] | None = None) -> None:
        """Call ``fn`` on consecutive views covering ``[start, end)``; a view is valid only during its call."""
        self.fold_at(start, end, lambda view, _at: fn(view), progress)

    def crc32(self, start: int, end: int, progress: Callable[[int], None] | None = None) -> int:
        """CRC-32 (zip's) of bytes ``[start, end)``."""
        return fold_crc32(self.fold, start, end, progress)
