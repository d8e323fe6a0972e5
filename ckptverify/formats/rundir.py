"""Run directories: find every checkpoint under a training run's output, with its step and format.

Frameworks lay out their runs differently: torchtitan ``checkpoint/step-N/``, Lightning ``checkpoints/`` (DCP
folders or ``.ckpt`` files named ``epoch=E-step=N``), transformers ``output_dir/checkpoint-N/``, Megatron
``iter_0000N/``, ckptverify's own ``step_N/``. A checkpoint is recognized by its contents, never by its name
alone; its step is read from its name. The walk never follows symbolic links, never opens a file (names and
``lstat`` only), stops at a bounded depth and count, and does not descend into a checkpoint it found.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from ckptverify.own_files import SAVE_MARKER

__all__ = [
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "Candidate",
    "dir_format",
    "file_format",
    "find_checkpoints",
    "step_of",
    "walk_files",
]

#: How deep below the run directory checkpoints are looked for.
MAX_DEPTH = 4
#: Directory entries examined at most (a run directory is not a file system to crawl).
MAX_ENTRIES = 200_000

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
    """One checkpoint found under a run directory.

    ``path`` is relative to the run directory; ``kind`` is ``"dir"`` or ``"file"``; ``format`` is ``dcp``,
    ``dcp-uncommitted`` (shards or an in-progress marker but no metadata), ``hf``, ``accelerate``,
    ``composite`` (a directory holding DCP checkpoints, as transformers' and accelerate's FSDP saves do),
    ``torch.save`` or ``safetensors``. ``parts`` lists the DCP folders inside a composite checkpoint.
    """

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


def dir_format(names: list[str]) -> str | None:
    """The format of a directory holding the entries ``names`` (its own files only), or ``None``."""
    if any(_DCP_METADATA.match(n) for n in names):
        return "dcp"
    if SAVE_MARKER in names or any(_DCP_SHARD.match(n) for n in names):
        return "dcp-uncommitted"
    if any(n.startswith("random_states_") and n.endswith(".pkl") for n in names):
        return "accelerate"
    if any(n in _HF_FILES for n in names) or any(n.startswith("model-") and n.endswith(".safetensors")
                                                  for n in names):
        return "hf"
    return None


def _scandir(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        return []


def walk_files(root: str, budget: list[int] | None = None) -> Iterator[tuple[os.DirEntry[str], os.stat_result]]:
    """Every entry under ``root`` that is not a directory, with its ``lstat``: links are not followed, nothing is
    opened. ``budget`` (a one-element list) counts entries down and stops the walk at zero."""
    stack = [root]
    while stack and (budget is None or budget[0] > 0):
        for entry in _scandir(stack.pop()):
            if budget is not None:
                budget[0] -= 1
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
            else:
                yield entry, st


def _size(path: str, budget: list[int]) -> tuple[int, int]:
    """Bytes of the regular files under ``path`` (links not followed) and the newest mtime."""
    total, newest = 0, 0
    for _, st in walk_files(path, budget):
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
            newest = max(newest, st.st_mtime_ns)
    return total, newest


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def find_checkpoints(run_dir: str | os.PathLike[str], *, max_depth: int = MAX_DEPTH) -> list[Candidate]:
    """Every checkpoint under ``run_dir``, ordered by step (unknown steps first, by modification time), then
    path.

    ``run_dir`` itself is one when its own files make a checkpoint (a DCP folder, a Hugging Face or accelerate
    folder given directly): it is listed as ``"."``, with the DCP folders directly inside it whose names carry
    no step as its parts (FSDP saves: ``pytorch_model_fsdp_0/``); the folders below it are still searched (a
    transformers ``output_dir`` holds the final model and its ``checkpoint-N/`` folders)."""
    root = os.fspath(run_dir)
    budget = [MAX_ENTRIES]
    found: list[Candidate] = []
    own = _scandir(root)
    budget[0] -= len(own)
    root_fmt = dir_format([e.name for e in own])
    own_parts: set[str] = set()
    if root_fmt is not None:
        if root_fmt not in ("dcp", "dcp-uncommitted"):
            own_parts = {e.name for e in own if _is_dir(e) and step_of(e.name) is None
                         and dir_format([c.name for c in _scandir(e.path)]) in ("dcp", "dcp-uncommitted")}
        size, mtime = 0, 0
        for e in own:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                size, mtime = size + st.st_size, max(mtime, st.st_mtime_ns)
        for part in sorted(own_parts):
            part_size, part_mtime = _size(os.path.join(root, part), budget)
            size, mtime = size + part_size, max(mtime, part_mtime)
        found.append(Candidate(".", "dir", root_fmt, step_of(os.path.basename(os.path.abspath(root))), size, mtime,
                               tuple(sorted(own_parts))))
    stack: list[tuple[str, int]] = [(root, 0)]
    while stack and budget[0] > 0:
        path, depth = stack.pop()
        entries = _scandir(path)
        budget[0] -= len(entries)
        subdirs = [e for e in entries if _is_dir(e) and not (path == root and e.name in own_parts)]
        for e in subdirs:
            names = [c.name for c in _scandir(e.path)]
            fmt = dir_format(names)
            rel = os.path.relpath(e.path, root).replace(os.sep, "/")
            if fmt is None:
                parts = tuple(c.name for c in _scandir(e.path)
                              if _is_dir(c) and dir_format([g.name for g in _scandir(c.path)]) in ("dcp",
                                                                                                  "dcp-uncommitted"))
                if parts and step_of(e.name) is not None:
                    fmt = "composite"
                elif depth + 1 < max_depth:
                    stack.append((e.path, depth + 1))
                    continue
                else:
                    continue
            else:
                parts = ()
            size, mtime = _size(e.path, budget)
            found.append(Candidate(rel, "dir", fmt, step_of(e.name), size, mtime, parts))
        if path == root and dir_format([e.name for e in entries]) is not None:
            continue  # files of a checkpoint given as the run directory are not checkpoints of their own
        for e in entries:
            fmt = file_format(e.name)
            if fmt is None:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                rel = os.path.relpath(e.path, root).replace(os.sep, "/")
                found.append(Candidate(rel, "file", fmt, step_of(e.name), st.st_size, st.st_mtime_ns))
    return sorted(found, key=lambda c: (c.step is not None, c.step or 0, c.mtime_ns, c.path))
