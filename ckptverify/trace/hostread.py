"""The one place the trace reads device values back to the host. Every read waits for the device; a traced step makes
one (its row's) plus the few a caller asks for, and routing them through :func:`to_host` lets tests count them."""

from __future__ import annotations

from typing import Any

__all__ = ["to_host"]


def to_host(t: Any) -> list[Any]:
    """``t.tolist()``. Callers look it up on this module at each call (``hostread.to_host``) so a test can replace
    it."""
    return t.tolist()
