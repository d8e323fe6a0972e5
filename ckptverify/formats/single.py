"""Single checkpoint files, recognised by their first bytes (never by name alone): a zip (``torch.save``), an
8-byte length plus JSON (safetensors), or a pickle protocol byte (legacy ``torch.save``). Checks are in
:mod:`ckptverify.checks.single`."""

from __future__ import annotations

import struct

from ckptverify.dcp import safetensors
from ckptverify.safeparse.zipwalk import looks_like_zip

__all__ = ["JSON_MAX_BYTES", "sniff"]

#: Largest JSON side file (config, index, trainer state) that is parsed.
JSON_MAX_BYTES = 64 << 20


def sniff(head: bytes) -> str | None:
    """``torch.save``, ``safetensors``, ``pickle`` or ``None`` from a file's first 16 bytes. Safetensors is tried first:
    its first byte is ``0x80`` for one header length in 256, while a pickle never has ``{`` at byte 8 (legacy
    ``torch.save`` has its magic number there)."""
    if looks_like_zip(head):
        return "torch.save"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if 2 <= n <= safetensors.MAX_HEADER_BYTES and head[8:9] == b"{":
            return "safetensors"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "pickle"
    return None
