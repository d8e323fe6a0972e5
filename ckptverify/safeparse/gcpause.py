"""Pausing Python's cyclic garbage collector while a large, acyclic structure is built.

Reading the metadata of a checkpoint with 100 000 chunks builds millions of small objects (pickle stand-ins,
the plain tree, the validated layout, the items to check) and no reference cycles. The cyclic collector,
triggered every few hundred allocations, walks the ever-growing set of live objects again and again: it
took about half of such a run. Nothing here leaks: reference counting frees everything as usual, and the
collector runs again once the outermost pause ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector for the duration of the block, if it was enabled (nesting is harmless:
    only the outermost pause re-enables it)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
