"""``verify`` never writes: not a byte, not a timestamp, not a directory entry.

Two independent proofs: the checkpoint (files made read-only) is identical before and after verifying
it, through the library and the command line; and, in process, every attempt to open, create, rename or
remove anything under the checkpoint other than for reading fails the test.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers import faults as inj

from ckptverify.audit.verify import verify_checkpoint
from ckptverify.cli import main as cli_main

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _state(root: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every entry under ``root``: mode, size, mtime (ns) and content digest."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath, name)
            st = os.lstat(p)
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    st = os.lstat(root)
    out["."] = (st.st_mode, st.st_size, st.st_mtime_ns, "")
    return out


def _make_read_only(root: Path) -> None:
    for p in root.iterdir():
        p.chmod(0o444)
    root.chmod(0o555)


def _make_writable(root: Path) -> None:
    root.chmod(0o755)
    for p in root.iterdir():
        p.chmod(0o644)


@pytest.mark.parametrize("layout", ["single", "per_item", "fsdp2", "nocoll", "safetensors"])
@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupt"])
def test_verify_changes_nothing(layout: str, corrupt: bool, fresh_ckpt: Any) -> None:
    path = fresh_ckpt(layout)
    if corrupt:
        if layout == "safetensors":
            inj.flip_in_bytes_item(path)
        else:
            inj.flip_in_tensor_payload(path)
    _make_read_only(path)
    try:
        before = _state(path)
        listing = sorted(os.listdir(path))
        report = verify_checkpoint(path)
        assert report.exit_code == (1 if corrupt else 0)
        for args in (["--json"], ["--jobs", "1"], ["--jobs", "3", "--json"]):
            result = CliRunner().invoke(cli_main, ["verify", str(path), "--no-progress", *args])
            assert result.exit_code == report.exit_code, result.output
        assert sorted(os.listdir(path)) == listing
        assert _state(path) == before
    finally:
        _make_writable(path)


class _WriteGuard:
    """Records (and refuses) every write-capable file operation on a path under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self.violations: list[str] = []

    def under(self, path: Any) -> bool:
        if isinstance(path, int):
            return False
        try:
            real = os.path.realpath(os.fsdecode(os.fspath(path)))
        except TypeError:
            return False
        return real == self.root or real.startswith(self.root + os.sep)

    def refuse(self, what: str, path: Any) -> None:
        self.violations.append(f"{what}: {path}")
        raise PermissionError(f"verify tried to {what} {path}")

    def wrap_open(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            mode = kwargs.get("mode", mode)
            if self.under(file) and any(c in mode for c in "wax+"):
                self.refuse(f"open(mode={mode!r})", file)
            return real(file, mode, *args, **kwargs)

        return guarded

    def wrap_os_open(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(path: Any, flags: int, *args: Any, **kwargs: Any) -> Any:
            if self.under(path) and flags & _WRITE_FLAGS:
                self.refuse(f"os.open(flags={flags:#o})", path)
            return real(path, flags, *args, **kwargs)

        return guarded

    def wrap_path_op(self, name: str, real: Callable[..., Any], nargs: int = 1) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if any(self.under(a) for a in args[:nargs]):
                self.refuse(name, args[:nargs])
            return real(*args, **kwargs)

        return guarded


@pytest.mark.parametrize("layout", ["single", "threads", "nocoll"])
@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupt"])
def test_verify_opens_nothing_for_writing(layout: str, corrupt: bool, fresh_ckpt: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = fresh_ckpt(layout)
    if corrupt:
        inj.truncate(path)
        inj.add_extra_file(path)
    guard = _WriteGuard(path)
    guarded_open = guard.wrap_open(builtins.open)
    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)
    monkeypatch.setattr(os, "open", guard.wrap_os_open(os.open))
    for name in ("remove", "unlink", "rmdir", "mkdir", "makedirs", "truncate", "chmod", "utime"):
        monkeypatch.setattr(os, name, guard.wrap_path_op(f"os.{name}", getattr(os, name)))
    for name in ("rename", "replace", "link", "symlink"):
        monkeypatch.setattr(os, name, guard.wrap_path_op(f"os.{name}", getattr(os, name), nargs=2))
    try:
        report = verify_checkpoint(path, jobs=1)
        report_parallel = verify_checkpoint(path, jobs=4)
    finally:
        monkeypatch.undo()
    assert not guard.violations, guard.violations
    assert report.exit_code == report_parallel.exit_code == (1 if corrupt else 0)


def test_guard_catches_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard itself works: writes under the root are refused, reads and writes elsewhere are not."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "f").write_bytes(b"x")
    guard = _WriteGuard(root)
    guarded_open = guard.wrap_open(builtins.open)
    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)
    monkeypatch.setattr(os, "open", guard.wrap_os_open(os.open))
    assert (root / "f").read_bytes() == b"x"
    with pytest.raises(PermissionError):
        (root / "f").write_bytes(b"y")
    with pytest.raises(PermissionError):
        os.open(root / "g", os.O_CREAT | os.O_WRONLY)
    with open(tmp_path / "elsewhere", "w") as fh:
        fh.write("fine")
    monkeypatch.undo()
    assert len(guard.violations) == 2
    assert (root / "f").read_bytes() == b"x" and not (root / "g").exists()


def test_verify_opens_only_regular_files_inside_the_checkpoint_without_blocking(
        fresh_ckpt: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``os.open`` verify makes is non-blocking and inside the checkpoint, even when a shard links out
    of it and the manifest names a file outside."""
    import json

    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.ownfiles.manifest import MANIFEST_FILE, _self_digest

    path = fresh_ckpt("threads")
    _, manifest = fingerprint_checkpoint(path, block_bytes=4096)
    assert manifest is not None
    data = json.loads((path / MANIFEST_FILE).read_text())
    data["metadata_files"]["/etc/hostname"] = {"size": 1, "digest": "0" * 32}
    data["self_digest"] = _self_digest({k: v for k, v in data.items() if k != "self_digest"})
    (path / MANIFEST_FILE).write_text(json.dumps(data))
    elsewhere = tmp_path / "elsewhere.distcp"
    victim = sorted(p for p in path.iterdir() if p.suffix == ".distcp")[-1]
    os.replace(victim, elsewhere)
    victim.symlink_to(elsewhere)

    root = os.path.realpath(path)
    opened: list[tuple[str, int]] = []
    real_open = os.open

    def recording_open(p: Any, flags: int, *args: Any, **kwargs: Any) -> Any:
        opened.append((os.path.realpath(os.fsdecode(os.fspath(p))), flags))
        return real_open(p, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    report = verify_checkpoint(path, jobs=2)
    monkeypatch.undo()
    assert {"file-unsafe", "manifest-invalid"} <= {f.check for f in report.errors}, report.findings
    under_root = [(p, fl) for p, fl in opened if p.startswith(root + os.sep)]
    assert under_root, "verify opened nothing: the test checked nothing"
    assert [p for p, _ in opened if not p.startswith(root + os.sep)] == []
    assert all(fl & os.O_NONBLOCK for _, fl in under_root)
