"""Pausing the cyclic garbage collector while a large, acyclic structure is built.

Metadata of 100 000 chunks builds millions of small objects and no cycles; the collector re-walking them took
about half the run. Nothing leaks: refcounting frees as usual, and the collector resumes after the outermost pause.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector for the block if enabled; nesting is harmless (the outermost re-enables)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
