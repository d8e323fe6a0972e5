"""Checks: each takes what it needs and returns findings; none of them prints."""

from __future__ import annotations

from ckptverify.dcp.layout import Item
from ckptverify.findings import Finding, Location, error


def item_label(item: Item) -> str:
    """How findings name an item: its FQN, and its chunk offsets for a tensor chunk."""
    if item.chunk is not None:
        return f"{item.fqn!r} chunk {list(item.chunk.offsets)}"
    return repr(item.fqn)


def item_location(item: Item, **kw: object) -> Location:
    """A location naming ``item`` (file, FQN, chunk, rank) plus any narrower fields in ``kw``."""
    return Location(
        file=item.file,
        fqn=item.fqn,
        chunk_offsets=item.chunk.offsets if item.chunk else None,
        chunk_sizes=item.chunk.sizes if item.chunk else None,
        rank=item.rank,
        **kw,  # type: ignore[arg-type]
    )


def unopened(name: str, exc: OSError) -> Finding:
    """The ``file-missing`` error for the file ``name``, which could not be opened."""
    return error("file-missing", f"{name} cannot be opened for reading: {exc}", location=Location(file=name))


def plain_name(name: str) -> bool:
    """``name`` names a file directly inside a folder: no separator, NUL, ``.`` or ``..``, not empty."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name
