"""Undoing DCP's stream transforms (``_extension``, e.g. ``stream.zstd/1``) to read an item's bytes.

Stored bytes have no checksum of their own; the decoded archive has CRC-32s, so an item is decoded (in memory,
bounded by :data:`MAX_DECODED_BYTES`: a bomb is an error, not a hang) and judged like any other. ZStandard is
decoded by :mod:`ckptverify.safeparse.zstd`; any other descriptor only via a caller's ``ExtensionRegistry``: the
(untrusted) descriptor merely selects a registered class, and nothing is imported because a checkpoint names it.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ckptverify.dcp.layout import Item
from ckptverify.errors import TransformError
from ckptverify.safeparse import zstd
from ckptverify.safeparse.fold import Folding
from ckptverify.safeparse.readers import ReadOnlyFile

__all__ = ["MAX_DECODED_BYTES", "DecodedItem", "decode", "decoded_item"]

#: Largest decoded item (bytes). An item decoding to more is refused (a bomb, or not worth holding in memory).
MAX_DECODED_BYTES = 4 << 30
#: Compressed bytes read per step while decoding.
_STEP = 4 << 20
ZSTD = "stream.zstd"


def _bounded_read(stream: Any, limit: int) -> bytes:
    out = bytearray()
    while True:
        chunk = stream.read(min(_STEP, limit + 1 - len(out)))
        if not chunk:
            return bytes(out)
        out += chunk
        if len(out) > limit:
            raise TransformError(f"the stream decodes to more than {limit} bytes; refused (a decompression bomb, "
                                 "or an item too large to check in memory)")


def _zstd(raw: bytes, limit: int) -> bytes:
    try:
        return zstd.decompress(raw, limit)
    except ValueError as exc:
        raise TransformError(str(exc)) from None


def decode(raw: bytes, descriptors: Sequence[str], *, registry: Any = None,
           limit: int = MAX_DECODED_BYTES) -> bytes:
    """``raw`` with ``descriptors`` undone, in DCP's reader order; ``registry`` for non-zstd descriptors. Raises
    :class:`TransformError`."""
    data = raw
    for desc in descriptors:
        name, _, version = desc.partition("/")
        if name == ZSTD and version.partition(".")[0] == "1" and registry is None:
            data = _zstd(data, limit)
            continue
        if registry is None:
            raise TransformError(f"no decoder for the stream transform {desc[:80]!r} (only stream.zstd/1 is known; "
                                 "the library API takes an extension registry for others)", unavailable=True)
        try:
            (ext,) = registry.from_descriptor_list([desc])
            with ext.transform_from(io.BytesIO(data)) as stream:
                data = _bounded_read(stream, limit)
        except TransformError:
            raise
        except Exception as exc:  # a registered decoder's own error: damage or an unusable decoder
            raise TransformError(f"the {desc[:80]!r} stream does not decode: {type(exc).__name__}: {exc}"[:300]) \
                from None
    return data


class DecodedItem(Folding):
    """A transformed item's decoded bytes, read like a file; :meth:`drop` frees them (a later read decodes again).
    ``item``: as the decoded bytes see it (offset 0, no transforms)."""

    def __init__(self, f: ReadOnlyFile, stored: Item, data: bytes, registry: Any = None) -> None:
        self.path = f"{stored.file}[{stored.offset}:{stored.end}] (decoded)"
        self.stored = stored
        self.size = len(data)
        self.item = replace(stored, offset=0, length=len(data), transforms=())
        self._f = f
        self._registry = registry
        _held.owner, _held.data = self, data

    @property
    def data(self) -> bytes:
        """The decoded bytes; each thread holds at most one decoded item (memory bounded per thread)."""
        if getattr(_held, "owner", None) is self:
            return _held.data  # type: ignore[no-any-return]
        data = decode(self._f.pread(self.stored.offset, self.stored.length), self.stored.transforms,
                      registry=self._registry)
        if len(data) != self.size:
            raise TransformError("the item decodes differently from when it was first read")
        _held.owner, _held.data = self, data
        return data

    def drop(self) -> None:
        if getattr(_held, "owner", None) is self:
            _held.owner = _held.data = None

    def pread(self, offset: int, n: int) -> bytes:
        if n <= 0 or offset < 0 or offset >= self.size:
            return b""
        return self.data[offset:offset + n]

    def fold_at(self, start: int, end: int, fn: Any) -> None:
        with memoryview(self.data)[start:end] as view:
            fn(view, start)

    def changed(self) -> str | None:
        return self._f.changed()

    def close(self) -> None:
        self.drop()


#: The decoded item each thread holds (``owner``) and its bytes (``data``).
_held = threading.local()


def decoded_item(f: ReadOnlyFile, item: Item, *, registry: Any = None) -> DecodedItem:
    """Read and decode ``item`` (which has transforms). Raises :class:`TransformError`."""
    return DecodedItem(f, item, decode(f.pread(item.offset, item.length), item.transforms, registry=registry),
                       registry)
