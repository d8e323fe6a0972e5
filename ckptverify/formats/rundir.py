"""Run directories: find every checkpoint under a training run, with its step and format.

Layouts differ by framework (torchtitan ``step-N/``, Lightning ``.ckpt`` and DCP folders, transformers
``checkpoint-N/``, Megatron ``iter_N/``, ckptverify ``step_N/``). A checkpoint is recognised by content, its step
read from its name. The walk never follows links, never opens a file, is bounded in depth and count, and does not
descend into a checkpoint found. What it could not see it says (:class:`WalkNote`), so ``scan`` fails, ``latest``
refuses to pick, and ``prune`` deletes nothing rather than act on a partial view.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import stat
from dataclasses import dataclass

from ckptverify.ownfiles.names import SAVE_MARKER
from ckptverify.safeparse import paths
from ckptverify.safeparse.paths import WalkNote

__all__ = [
    "DCP_FORMATS",
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "MAX_FOLDER_ENTRIES",
    "MAX_NAMES",
    "Candidate",
    "dir_format",
    "file_format",
    "find_checkpoints",
    "is_dcp",
    "step_of",
]

#: How deep below the run directory checkpoints are looked for.
MAX_DEPTH = 4
#: Entries examined at most: subfolders searched, files announcing a checkpoint, everything inside checkpoints.
MAX_ENTRIES = 200_000
#: Names read from one folder at most (a folder of a million log files is read by name, up to this).
MAX_FOLDER_ENTRIES = 1_000_000
#: Names read in all, at most (listing costs time even when nothing is examined).
MAX_NAMES = 4_000_000

_DCP_METADATA = re.compile(r"^(?:__\d+)?\.metadata$")
_DCP_SHARD = re.compile(r"^__\d+_\d+\.distcp$")
_FILE_FORMATS = {".safetensors": "safetensors", ".pt": "torch.save", ".pth": "torch.save", ".bin": "torch.save",
                 ".ckpt": "torch.save"}
_HF_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "pytorch_model.bin.index.json")
# Step patterns, most specific first; the first that matches the name wins.
_STEP_PATTERNS = tuple(re.compile(p) for p in (
    r"(?:^|[^a-z])step[-_=]?(\d+)", r"^checkpoint[-_](\d+)", r"^iter_(\d+)", r"^global_step(\d+)",
    r"^(\d+)$",
))


@dataclass(frozen=True)
class Candidate:
    """One checkpoint found: ``path`` relative to the run directory; ``kind`` ``"dir"``/``"file"``; ``format`` ``dcp``,
    ``dcp-uncommitted``, ``hf``, ``accelerate``, ``composite`` (a folder of DCP checkpoints; ``parts`` lists them),
    ``torch.save`` or ``safetensors``."""

    path: str
    kind: str
    format: str
    step: int | None
    size: int
    mtime_ns: int
    parts: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "kind": self.kind, "format": self.format, "step": self.step,
                "size": self.size, "parts": list(self.parts)}


def step_of(name: str) -> int | None:
    """The training step a checkpoint's name carries (``step-100``, ``checkpoint-100``, ``iter_0000100``,
    ``epoch=0-step=100.ckpt``), or ``None``."""
    base = name.rsplit("/", 1)[-1]
    stem = base.rsplit(".", 1)[0] if "." in base and not base.startswith(".") else base
    for pattern in _STEP_PATTERNS:
        m = pattern.search(stem.lower())
        if m:
            return int(m.group(1))
    return None


def file_format(name: str) -> str | None:
    """The format a file's name announces (``torch.save`` or ``safetensors``), or ``None``."""
    return _FILE_FORMATS.get(os.path.splitext(name)[1].lower())


def _marker(name: str) -> int | None:
    """The rank (lower is stronger) of the format a directory entry named ``name`` announces, or ``None``."""
    if _DCP_METADATA.match(name):
        return 0
    # ``.metadata.tmp`` left alone: DCP renames it at commit, so this is an uncommitted save.
    if name == SAVE_MARKER or _DCP_SHARD.match(name) or name == ".metadata.tmp":
        return 1
    if name.startswith("random_states_") and name.endswith(".pkl"):
        return 2
    if name in _HF_FILES or (name.startswith("model-") and name.endswith(".safetensors")):
        return 3
    return None


_MARKER_FORMATS = ("dcp", "dcp-uncommitted", "accelerate", "hf")
#: What :func:`dir_format` calls a DCP checkpoint's folder: committed, or not (yet, or never).
DCP_FORMATS = _MARKER_FORMATS[:2]


def dir_format(names: list[str]) -> str | None:
    """The format of a directory holding the entries ``names`` (its own files only), or ``None``."""
    ranks = [r for r in map(_marker, names) if r is not None]
    return _MARKER_FORMATS[min(ranks)] if ranks else None


def is_dcp(path: str) -> bool:
    """Whether ``path`` is a folder holding a DCP checkpoint, committed or not (its own names say so: one of
    :data:`DCP_FORMATS`); ``False`` for anything else, or a folder that cannot be listed. The committed ones a
    save's verification is shared out by: :func:`~ckptverify.ownfiles.partsplan.dcp_folders`."""
    if not paths.isdir(path):
        return False
    try:
        return dir_format(paths.listdir(path)) in DCP_FORMATS
    except OSError:
        return False


@dataclass
class _Listing:
    """One folder's entries as the walk needs them: its format, subfolders and checkpoint-named files, sorted."""

    fmt: str | None
    dirs: list[os.DirEntry[str]]
    files: list[os.DirEntry[str]]


class _Walker:
    """One walk's state: each folder listed at most once; ``budget`` and ``names`` counters; ``notes``."""

    def __init__(self, root: str, notes: list[WalkNote]) -> None:
        self.root = root
        self.budget = MAX_ENTRIES
        self.names = MAX_NAMES
        self.notes = notes
        self.unvisited: dict[str, None] = {}  # ordered set
        self._cache: dict[str, _Listing | None] = {}

    def rel(self, path: str) -> str:
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def spent(self) -> bool:
        return self.budget <= 0 or self.names <= 0

    def listing(self, path: str) -> _Listing | None:
        """``path``'s listing (read once), or ``None`` if unreadable (noted; a folder skipped for budget is remembered).
        """
        if path in self._cache:
            return self._cache[path]
        if self.spent():
            self.unvisited[self.rel(path)] = None
            return None  # not cached: the note counts each folder once, at the end
        ranks: list[int] = []
        dirs: list[os.DirEntry[str]] = []
        files: list[os.DirEntry[str]] = []
        cap = min(MAX_FOLDER_ENTRIES, self.names)
        read = 0
        try:
            with paths.scandir(path) as it:
                for entry in it:
                    if read >= cap:
                        self._cut(path, read)
                        break
                    read += 1
                    if (r := _marker(entry.name)) is not None:
                        ranks.append(r)
                    if _is_dir(entry):
                        dirs.append(entry)
                    elif file_format(entry.name) is not None:
                        files.append(entry)
        except (FileNotFoundError, NotADirectoryError):
            self._cache[path] = None  # gone since its parent was listed (retention): nothing hidden
            return None
        except OSError as exc:
            self.notes.append(WalkNote("unlisted", self.rel(path), f"{type(exc).__name__}: {exc.strerror or exc}"))
            if read == 0:
                self._cache[path] = None
                return None
        self.names -= read
        dirs.sort(key=lambda e: e.name)
        files.sort(key=lambda e: e.name)
        result = self._cache[path] = _Listing(_MARKER_FORMATS[min(ranks)] if ranks else None, dirs, files)
        return result

    def _cut(self, path: str, read: int) -> None:
        if read >= MAX_FOLDER_ENTRIES:
            self.notes.append(WalkNote("folder-cap", self.rel(path), f"more than {read} entries", read))
        else:  # the names budget ran out inside this folder
            self.notes.append(WalkNote("folder-cap", self.rel(path), f"the walk had read {MAX_NAMES} names in all "
                                       f"when it reached it; {read} of its entries were looked at", read))

    def size(self, path: str) -> tuple[int, int]:
        """Bytes of regular files under checkpoint ``path`` (no links) and newest mtime; every entry charged to the
        budget."""
        total, newest = 0, 0
        walk = paths.FolderWalk(path, max_entries=max(self.budget, 0))
        for _, st in walk.files():
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
                newest = max(newest, st.st_mtime_ns)
        self.budget -= walk.seen
        if any(p.kind == "entries" for p in walk.problems):
            self.notes.append(WalkNote("budget", self.rel(path), f"it ran out while measuring {self.rel(path)}, "
                                       "whose size and time are partial"))
        return total, newest

    def finish(self) -> None:
        if self.unvisited:
            names = list(self.unvisited)
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            self.notes.append(WalkNote(
                "budget", names[0],
                f"{MAX_ENTRIES} entries examined; {len(self.unvisited)} folder(s) not looked into, nor anything "
                f"below them: {shown}", len(self.unvisited)))


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def find_checkpoints(run_dir: str | os.PathLike[str], *, notes: list[WalkNote] | None = None) -> list[Candidate]:
    """Every checkpoint under ``run_dir``, ordered by step (unknown first, by mtime), then path.

    ``run_dir`` itself is listed as ``"."`` when its own files make a checkpoint (with step-less DCP sub-folders as
    parts); folders below are still searched. Breadth-first and bounded (:data:`MAX_DEPTH`, :data:`MAX_ENTRIES`,
    :data:`MAX_FOLDER_ENTRIES`, :data:`MAX_NAMES`); other files are read by name only; ``lost+found`` is skipped.
    ``notes`` receives a :class:`WalkNote` per unseen part: a caller acting on the whole run (verdict, pick, deletion)
    must pass it.
    """
    root = os.fspath(run_dir)
    walker = _Walker(root, [] if notes is None else notes)
    found: list[Candidate] = []
    own = walker.listing(root)
    if own is None:
        return []  # unlistable or gone: the walk's first listing, so nothing can be left unvisited yet
    root_fmt = own.fmt
    own_parts: set[str] = set()
    if root_fmt is not None:
        if root_fmt not in DCP_FORMATS:
            own_parts = {e.name for e in own.dirs if step_of(e.name) is None and _is_dcp(walker, e.path)}
        size, mtime = 0, 0
        with contextlib.suppress(OSError), paths.scandir(root) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    size, mtime = size + st.st_size, max(mtime, st.st_mtime_ns)
        for part in sorted(own_parts):
            part_size, part_mtime = walker.size(os.path.join(root, part))
            size, mtime = size + part_size, max(mtime, part_mtime)
        found.append(Candidate(".", "dir", root_fmt, step_of(os.path.basename(os.path.abspath(root))), size, mtime,
                               tuple(sorted(own_parts))))
    queue: collections.deque[tuple[str, int, _Listing]] = collections.deque([(root, 0, own)])
    while queue:
        path, depth, entries = queue.popleft()
        # Charged when searched, not when only listed for markers: a sibling full of files does not eat the budget.
        walker.budget -= len(entries.dirs) + len(entries.files)
        for e in entries.dirs:
            if (path == root and e.name in own_parts) or e.name == "lost+found":
                continue
            child = walker.listing(e.path)
            if child is None:
                continue
            fmt = child.fmt
            parts: tuple[str, ...] = ()
            if fmt is None:
                parts = tuple(c.name for c in child.dirs if _is_dcp(walker, c.path))
                if parts and step_of(e.name) is not None:
                    fmt = "composite"
                else:
                    if depth + 1 < MAX_DEPTH:
                        queue.append((e.path, depth + 1, child))
                    continue
            size, mtime = walker.size(e.path)
            found.append(Candidate(walker.rel(e.path), "dir", fmt, step_of(e.name), size, mtime, parts))
        if path == root and root_fmt is not None:
            continue  # files of a checkpoint given as the run directory are not checkpoints of their own
        for e in entries.files:
            fmt = file_format(e.name)
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if fmt is not None and stat.S_ISREG(st.st_mode):
                found.append(Candidate(walker.rel(e.path), "file", fmt, step_of(e.name), st.st_size,
                                       st.st_mtime_ns))
    walker.finish()
    return sorted(found, key=lambda c: (c.step is not None, c.step or 0, c.mtime_ns, c.path))


def _is_dcp(walker: _Walker, path: str) -> bool:
    """:func:`is_dcp` from the walk's own listing (each folder listed once, against its budget)."""
    listing = walker.listing(path)
    return listing is not None and listing.fmt in DCP_FORMATS
