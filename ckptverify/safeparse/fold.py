"""``fold`` and ``crc32`` shared by the readers (local, remote, a decoded item), kept apart so none imports another."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Self

from isal.isal_zlib import crc32

__all__ = ["Folding"]


class Folding(ABC):
    """``fold`` and ``crc32`` in terms of ``fold_at`` (calls ``fn(view, offset)`` on views covering
    ``[start, end)``; a view is valid only during its call), and the context manager closing the reader."""

    #: Bytes of the file held in memory since open (reads inside them use no descriptor or request).
    kept = 0

    def release_kept(self) -> None:  # noqa: B027 - a reader keeping nothing has nothing to forget
        """Forget the bytes read at open; later reads go to the file (a change after open is found by ``changed``)."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def fold_at(self, start: int, end: int, fn: Callable[[memoryview, int], None]) -> None: ...

    def fold(self, start: int, end: int, fn: Callable[[memoryview], None]) -> None:
        """Call ``fn`` on consecutive views covering ``[start, end)``; a view is valid only during its call."""
        self.fold_at(start, end, lambda view, _at: fn(view))

    def crc32(self, start: int, end: int) -> int:
        """CRC-32 (zip's) of bytes ``[start, end)``."""
        value = 0

        def step(view: memoryview, _at: int) -> None:
            nonlocal value
            value = crc32(view, value)

        self.fold_at(start, end, step)
        return value
