"""``os``/``os.path`` stand-ins that also accept URLs (``s3://bucket/prefix``, any fsspec URL).

Each function has the name and contract of the ``os`` function it stands for. A local path goes to that very
function unchanged; a URL goes to :mod:`ckptverify.safeparse.remote` (fsspec imported only then), where prefixes
are directories, objects regular files, and nothing is a link. Also the bounded folder walk, and
:func:`safe_relative_path`, the one test that a name read from a checkpoint stays inside it.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptverify.errors import StorageError

__all__ = ["MAX_WALK_DEPTH", "MAX_WALK_ENTRIES", "FolderWalk", "WalkNote", "abspath", "exists", "is_url", "isdir",
           "isfile", "islink", "lexists", "listdir", "lstat", "normpath", "safe_relative_path", "scandir", "stat"]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(path: object) -> bool:
    """True when ``path`` is a URL (``scheme://...``), read through fsspec rather than the local file system."""
    return isinstance(path, str) and "://" in path and _URL.match(path) is not None


def safe_relative_path(value: object) -> str | None:
    """``value`` if it is a plain relative path naming a file inside the folder (no empty, ``.`` or ``..`` segment,
    no leading ``/``, backslash or NUL, at most 4096 characters), else ``None``."""
    if type(value) is not str or not value or "\x00" in value or "\\" in value or len(value) > 4096:
        return None
    if value.startswith("/") or any(p in ("", ".", "..") for p in value.split("/")):
        return None
    return value


def _remote() -> Any:
    from ckptverify.safeparse import remote  # fsspec is imported only for a URL

    return remote


def listdir(path: str) -> list[str]:
    """``os.listdir``; for a URL, the names directly under its prefix (read afresh, never from a cache)."""
    return _remote().listdir(path) if is_url(path) else os.listdir(path)


def scandir(path: str) -> Any:
    """``os.scandir``; for a URL, the entries of one fresh listing, their ``stat`` taken from it."""
    return _remote().scandir(path) if is_url(path) else os.scandir(path)


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
    """``os.stat``; for a URL, an object as a read-only regular file (its ETag folded into ``st_ino``, so a replaced
    object reads as another file) or a prefix as a directory."""
    return _remote().stat(path) if is_url(path) else os.stat(path, follow_symlinks=follow_symlinks)


def lstat(path: str) -> os.stat_result:
    """``os.lstat`` (an object store has no links: as :func:`stat` for a URL)."""
    return stat(path) if is_url(path) else os.lstat(path)


def isdir(path: str) -> bool:
    """``os.path.isdir``."""
    return _remote().probe(path, "isdir") if is_url(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
    """``os.path.isfile``."""
    return _remote().probe(path, "isfile") if is_url(path) else os.path.isfile(path)


def islink(path: str) -> bool:
    """``os.path.islink`` (never, for a URL)."""
    return False if is_url(path) else os.path.islink(path)


def lexists(path: str) -> bool:
    """``os.path.lexists``."""
    return _remote().probe(path, "exists") if is_url(path) else os.path.lexists(path)


def exists(path: str) -> bool:
    """``os.path.exists``."""
    return lexists(path) if is_url(path) else os.path.exists(path)


#: Folders below the top a :class:`FolderWalk` descends at most (a checkpoint is a few levels deep).
MAX_WALK_DEPTH = 32
#: Entries (files, folders, unaddressable keys) a :class:`FolderWalk` looks at, at most.
MAX_WALK_ENTRIES = 1_000_000


@dataclass(frozen=True)
class WalkNote:
    """What a walk did not see at ``path`` (relative to the top; ``"."`` for it). A :class:`FolderWalk`'s kinds:
    ``unaddressable`` (an object key with a ``.``, ``..`` or empty segment; ``path`` is the key as stored),
    ``unlisted`` (``detail``: the OS error), ``depth`` (beyond the depth bound), ``entries`` (the entry bound stopped
    the walk). The run walk's (:func:`~ckptverify.formats.rundir.find_checkpoints`) add ``folder-cap`` (only the
    first ``entries`` of a folder were read) and ``budget`` (spent; ``entries``: the folders not looked into)."""

    kind: str
    path: str
    detail: str
    entries: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "path": self.path, "detail": self.detail, "entries": self.entries}

    def describe(self) -> str:
        """One line: what was not seen."""
        if self.kind == "unlisted":
            return f"{self.path}: could not be listed ({self.detail}): a checkpoint in it was not seen"
        if self.kind == "folder-cap":
            return (f"{self.path}: holds more than {self.entries} entries; only the first {self.entries} were looked "
                    "at: a checkpoint among the others was not seen")
        return f"the walk's budget was spent: {self.detail}"


class FolderWalk:
    """A bounded top-down walk of ``top`` (a folder, or a URL's prefix listed afresh).

    Yields ``(rel, dirs, files)`` per folder (``rel`` ``""`` for the top, entries sorted; ``dirs`` may be pruned in
    place). Links are never followed, no folder is entered twice (bind-mount loops), :data:`MAX_WALK_DEPTH` and
    ``max_entries`` bound the walk. What was not seen is in :attr:`problems`: a caller judging it must report them.
    """

    def __init__(self, top: str, *, max_entries: int | None = None) -> None:
        self.top = top
        self.max_entries = MAX_WALK_ENTRIES if max_entries is None else max_entries
        self.problems: list[WalkNote] = []
        self.seen = 0

    def files(self) -> Iterator[tuple[Any, os.stat_result]]:
        """Every entry that is not a folder, with its ``lstat`` (one that vanished since it was listed is skipped)."""
        for _, _, files in self:
            for entry in files:
                try:
                    yield entry, entry.stat(follow_symlinks=False)
                except OSError:
                    continue

    def __iter__(self) -> Iterator[tuple[str, list[Any], list[Any]]]:
        visited: set[object] = set()
        stack: list[tuple[str, str, int]] = [(self.top, "", 0)]
        while stack:
            path, rel, depth = stack.pop()
            key = self._identity(path)
            if key is None or key in visited:
                continue  # gone since its parent was listed, or entered already by another name
            visited.add(key)
            listed = self._list(path, rel)
            if listed is None:
                return  # the entry bound: noted
            dirs, files = listed
            yield rel, dirs, files
            if dirs and depth >= MAX_WALK_DEPTH:
                self._note("depth", rel, f"{len(dirs)} folder(s) in it, {depth} levels down, were not entered "
                           f"(at most {MAX_WALK_DEPTH} levels are)")
                continue
            stack.extend((d.path, f"{rel}/{d.name}" if rel else d.name, depth + 1) for d in reversed(dirs))

    def _identity(self, path: str) -> object:
        if is_url(path):
            return normpath(path)
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError:
            return path  # listing it says why
        return (st.st_dev, st.st_ino)

    def _list(self, path: str, rel: str) -> tuple[list[Any], list[Any]] | None:
        """(folders, other entries) of ``path``; ``([], [])`` if unlistable, ``None`` once the entry bound is reached.
        """
        dirs: list[Any] = []
        files: list[Any] = []
        try:
            with scandir(path) as it:
                for e in it:
                    if self.seen >= self.max_entries:
                        self._note("entries", rel, f"the walk stopped at its bound of {self.max_entries} entries")
                        return None
                    self.seen += 1
                    try:
                        (dirs if e.is_dir(follow_symlinks=False) else files).append(e)
                    except OSError:
                        files.append(e)
                odd = getattr(it, "unaddressable", None)
                if odd is not None:
                    keys, more = odd(self.max_entries - self.seen)
                    self.seen += len(keys)
                    for k in keys:
                        self._note("unaddressable", f"{rel}/{k}" if rel else k, "")
                    if more:
                        self._note("entries", rel, f"the walk stopped at its bound of {self.max_entries} entries")
                        return None
        except (FileNotFoundError, NotADirectoryError):
            pass  # gone since its parent was listed
        except StorageError:
            raise  # the store failed, not the checkpoint: the command cannot run
        except OSError as exc:
            self._note("unlisted", rel, f"{type(exc).__name__}: {exc.strerror or exc}")
        dirs.sort(key=lambda e: e.name)
        files.sort(key=lambda e: e.name)
        return dirs, files

    def _note(self, kind: str, rel: str, detail: str) -> None:
        self.problems.append(WalkNote(kind, rel or ".", detail))
