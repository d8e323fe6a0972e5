"""Listing and examining checkpoint paths that may be URLs (``s3://bucket/prefix``, any fsspec URL).

Each function here has the name and contract of the ``os`` / ``os.path`` function it stands for. A local path
goes to that very function, unchanged (its behaviour, its errors, its safety rules); a URL goes to
:mod:`ckptverify.safeparse.remote` (fsspec, imported only then), where an object store's prefixes are
directories, its objects regular files, and nothing is a link. So a caller written for local paths serves
URLs by calling these instead of ``os``, and a local-path user imports nothing more.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["abspath", "exists", "is_url", "isdir", "isfile", "islink", "lexists", "listdir", "lstat", "normpath",
           "scandir", "stat", "walk"]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(path: object) -> bool:
    """True when ``path`` is a URL (``scheme://...``), read through fsspec rather than the local file system."""
    return isinstance(path, str) and "://" in path and _URL.match(path) is not None


def listdir(path: str) -> list[str]:
    """``os.listdir``; for a URL, the names directly under its prefix (read afresh, never from a cache)."""
    if is_url(path):
        from ckptverify.safeparse import remote

        return remote.listdir(path)
    return os.listdir(path)


def scandir(path: str) -> Any:
    """``os.scandir`` (a context manager iterating entries with ``name``, ``path``, ``is_dir``, ``is_file``,
    ``is_symlink`` and ``stat``); for a URL, the entries of one fresh listing, their ``stat`` taken from it."""
    if is_url(path):
        from ckptverify.safeparse import remote

        return remote.scandir(path)
    return os.scandir(path)


def normpath(path: str) -> str:
    """``os.path.normpath``; for a URL, of the part after ``scheme://`` (which stays as it is)."""
    if is_url(path):
        scheme, rest = path.split("://", 1)
        return f"{scheme}://{posixpath.normpath(rest) if rest else rest}"
    return os.path.normpath(path)


def abspath(path: str) -> str:
    """``os.path.abspath``; a URL is absolute already (normalized as :func:`normpath` does)."""
    return normpath(path) if is_url(path) else os.path.abspath(path)


def stat(path: str, *, follow_symlinks: bool = True) -> os.stat_result:
    """``os.stat``; for a URL, an object as a read-only regular file (size, modification time, and its ETag
    folded into ``st_ino``, so a replaced object reads as another file) or a prefix as a directory."""
    if is_url(path):
        from ckptverify.safeparse import remote

        return remote.stat(path)
    return os.stat(path, follow_symlinks=follow_symlinks)


def lstat(path: str) -> os.stat_result:
    """``os.lstat`` (an object store has no links: as :func:`stat` for a URL)."""
    return stat(path) if is_url(path) else os.lstat(path)


def isdir(path: str) -> bool:
    """``os.path.isdir``."""
    if is_url(path):
        from ckptverify.safeparse import remote

        return remote.isdir(path)
    return os.path.isdir(path)


def isfile(path: str) -> bool:
    """``os.path.isfile``."""
    if is_url(path):
        from ckptverify.safeparse import remote

        return remote.isfile(path)
    return os.path.isfile(path)


def islink(path: str) -> bool:
    """``os.path.islink`` (never, for a URL)."""
    return False if is_url(path) else os.path.islink(path)


def lexists(path: str) -> bool:
    """``os.path.lexists``."""
    if is_url(path):
        from ckptverify.safeparse import remote

        return remote.exists(path)
    return os.path.lexists(path)


def exists(path: str) -> bool:
    """``os.path.exists``."""
    return lexists(path) if is_url(path) else os.path.exists(path)


def walk(top: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk`` (top down; the caller may prune ``dirnames`` in place)."""
    if not is_url(top):
        yield from os.walk(top)
        return
    from ckptverify.safeparse import remote

    try:
        dirs, files = remote.listdir_split(top)
    except OSError:
        return
    yield top, dirs, files
    for name in dirs:
        yield from walk(top.rstrip("/") + "/" + name)
