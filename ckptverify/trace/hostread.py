"""The one place the trace reads values on a device back to the host.

Every such read waits for the device. A traced step makes at most one (its row's, :mod:`ckptverify.trace.readback`)
plus the few a caller asks for at once (the cross-replica check's ``check``, a subclass tensor's parts): routing
them all through :func:`to_host` lets the tests count them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["to_host"]


def to_host(t: Any) -> list[Any]:
    """``t.tolist()`` (waiting for the device when ``t`` is on one). Callers look it up on this module at each
    call (``hostread.to_host(...)``), so that a test can replace it."""
    return t.tolist()
