"""Special files in every role a checkpoint file can play: no command hangs, reads forever, runs out of memory,
follows a link out of the checkpoint or prints a traceback; each case ends in findings.

Roles: the metadata (``.metadata``), the manifest, a shard the metadata references, and a file nobody
references. Kinds: a FIFO (``open`` would block for a writer), links to ``/dev/zero`` and ``/dev/urandom``
(endless), a UNIX socket, a directory, and a link to a regular file outside the checkpoint (a perfect copy of
the shard, so only containment can tell). Every command runs in a child process under a timeout: a hang fails
the test instead of hanging it (a child forked from a server that imported ckptverify and torch once; see
:mod:`helpers.preloaded_children`).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.preloaded_children import PreloadedServer

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.ownfiles.manifest import MANIFEST_FILE

TIMEOUT = 120
KINDS = ("fifo", "dev-zero", "dev-urandom", "socket", "directory", "link-outside")
SHARD = "__0_0.distcp"


def _make(kind: str, path: Path, outside: Path) -> Any:
    """Put a special file of ``kind`` at ``path``; returns what must stay alive while it is used."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "dev-urandom":
        path.symlink_to("/dev/urandom")
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.listen(1)  # a live listener: a blocking reader would wait for it forever
        return sock
    elif kind == "directory":
        path.mkdir()
    elif kind == "link-outside":
        path.symlink_to(outside)
    else:  # pragma: no cover
        raise ValueError(kind)
    return None


#: What the commands import; the server imports it once, every command runs in a child forked from it.
_PRELOAD = ("ckptverify", "ckptverify.cli", "ckptverify.audit.verify", "torch", "ckptverify.state.train_state")


@pytest.fixture(scope="module")
def children() -> Iterator[PreloadedServer]:
    """Each command's process: a child forked from a server that imported :data:`_PRELOAD` once, not a fresh
    interpreter (an import of torch per command). Still a process of its own: a hang is killed at the timeout and
    fails the test, a death by signal shows as one. ``test_a_tuple_nested_a_million_deep_in_a_torch_save_file_...``
    keeps fresh ``python -m ckptverify`` processes."""
    with PreloadedServer(_PRELOAD) as server:
        yield server


def _run(children: PreloadedServer, *args: str) -> tuple[int, str, str]:
    """``python ARGS`` (``-m ckptverify ...`` or ``-c CODE``) in a child process under :data:`TIMEOUT`; it must end
    by itself, not by a signal."""
    if args[:2] == ("-m", "ckptverify"):
        proc = children.cli(*args[2:], timeout=TIMEOUT)
    else:
        assert args[0] == "-c", args
        proc = children.run(args[1], *args[2:], timeout=TIMEOUT)
    if proc.timed_out:  # pragma: no cover - the failure this file exists to catch
        pytest.fail(f"{args} did not finish within {TIMEOUT} s")
    assert proc.returncode is not None
    assert proc.returncode >= 0, f"{args} died by signal {-proc.returncode}: {proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-4000:]
    return proc.returncode, proc.stdout, proc.stderr


def _verify_json(children: PreloadedServer, path: Path) -> dict[str, Any]:
    code, out, err = _run(children, "-m", "ckptverify", "verify", "--no-progress", "--json", str(path))
    assert code in (0, 1), (code, out[-2000:], err[-2000:])
    report = json.loads(out)
    assert report["exit_code"] == code
    return report


def _checks(report: dict[str, Any], severity: str = "error") -> set[str]:
    return {f["check"] for f in report["findings"] if f["severity"] == severity}


@pytest.fixture
def outside(tmp_path: Path) -> Callable[[Path, str], Path]:
    """``outside(ckpt, name)``: a copy of ``ckpt/name`` in a directory beside the checkpoint."""
    def copy(ckpt: Path, name: str) -> Path:
        where = tmp_path / "elsewhere"
        where.mkdir(exist_ok=True)
        src = ckpt / name
        dst = where / name
        if src.exists() and not src.is_symlink() and src.is_file():
            shutil.copyfile(src, dst)
        else:
            dst.write_bytes(b"x" * 100)
        return dst
    return copy


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_as_special_file_is_a_finding(kind: str, fresh_ckpt: Any, outside: Any,
                                               children: PreloadedServer) -> None:
    path = fresh_ckpt("single")
    keep = _make(kind, path / ".metadata", outside(path, ".metadata"))
    try:
        report = _verify_json(children, path)
    finally:
        if keep is not None:
            keep.close()
    assert report["exit_code"] == 1
    assert "metadata-unreadable" in _checks(report)


@pytest.mark.parametrize("kind", KINDS)
def test_manifest_as_special_file_is_a_finding(kind: str, fresh_ckpt: Any, outside: Any,
                                               children: PreloadedServer) -> None:
    path = fresh_ckpt("single")
    _, manifest = fingerprint_checkpoint(path, block_bytes=4096)
    assert manifest is not None
    keep = _make(kind, path / MANIFEST_FILE, outside(path, MANIFEST_FILE))
    try:
        got = _verify_json(children, path)
    finally:
        if keep is not None:
            keep.close()
    assert got["exit_code"] == 1
    assert "manifest-invalid" in _checks(got)


@pytest.mark.parametrize("kind", KINDS)
def test_shard_as_special_file_is_a_finding(kind: str, fresh_ckpt: Any, outside: Any,
                                            children: PreloadedServer) -> None:
    path = fresh_ckpt("single")
    keep = _make(kind, path / SHARD, outside(path, SHARD))
    try:
        report = _verify_json(children, path)
    finally:
        if keep is not None:
            keep.close()
    assert report["exit_code"] == 1
    unsafe = [f for f in report["findings"] if f["check"] == "file-unsafe"]
    assert unsafe and unsafe[0]["location"]["file"] == SHARD, report["findings"]
    if kind == "link-outside":
        assert "outside the checkpoint" in unsafe[0]["message"]


def test_shard_link_inside_the_checkpoint_is_followed(fresh_ckpt: Any, children: PreloadedServer) -> None:
    path = fresh_ckpt("single")
    (path / "store").mkdir()
    os.replace(path / SHARD, path / "store" / SHARD)
    (path / SHARD).symlink_to(Path("store") / SHARD)
    report = _verify_json(children, path)
    assert report["exit_code"] == 0, report["findings"]
    # The real file is listed where it is, as no item names it there.
    assert "file-unreferenced" in _checks(report, "warning")


@pytest.mark.parametrize("kind", KINDS)
def test_unreferenced_special_file_is_listed_without_being_opened(kind: str, fresh_ckpt: Any, outside: Any,
                                                                  children: PreloadedServer) -> None:
    path = fresh_ckpt("single")
    keep = _make(kind, path / "planted.bin", outside(path, SHARD))
    try:
        report = _verify_json(children, path)
    finally:
        if keep is not None:
            keep.close()
    assert report["exit_code"] == 0, report["findings"]
    if kind != "directory":  # an empty directory holds no file to list
        assert "file-unreferenced" in _checks(report, "warning")


@pytest.mark.parametrize("role", [".metadata", SHARD])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_fingerprint_diff_and_load_finish(role: str, kind: str, fresh_ckpt: Any, outside: Any,
                                          children: PreloadedServer) -> None:
    clean = fresh_ckpt("single")
    path = fresh_ckpt("single")
    _make(kind, path / role, outside(path, role))
    code, out, _ = _run(children, "-m", "ckptverify", "fingerprint", "--no-progress", "--json", str(path))
    assert code == 1 and "fingerprint-refused" in out
    assert not (path / MANIFEST_FILE).exists()
    for a, b in ((clean, path), (path, clean)):
        code, out, _ = _run(children, "-m", "ckptverify", "diff", "--no-progress", "--json", str(a), str(b))
        assert code == 1, out[-2000:]
        json.loads(out)
    code, out, _ = _run(children, "-c", (
        "import ckptverify\n"
        "from ckptverify.errors import CheckpointRefusedError\n"
        "from ckptverify.state.train_state import TrainState\n"
        "try:\n"
        f"    ckptverify.load(TrainState(), {str(path)!r})\n"
        "except CheckpointRefusedError as exc:\n"
        "    print('refused:', exc)\n"
    ))
    assert code == 0 and out.startswith("refused:"), out[-2000:]


def test_metadata_link_outside_is_not_read(fresh_ckpt: Any, tmp_path: Path, children: PreloadedServer) -> None:
    """A metadata file that is a link to a valid ``.metadata`` elsewhere is refused: never read outside."""
    src = fresh_ckpt("single", "source")
    path = fresh_ckpt("single", "victim")
    (path / ".metadata").unlink()
    (path / ".metadata").symlink_to(src / ".metadata")
    report = _verify_json(children, path)
    assert "metadata-unreadable" in _checks(report)
    assert any("outside the checkpoint" in f["message"] for f in report["findings"])


def test_oversized_manifest_is_refused_unread(fresh_ckpt: Any) -> None:
    from ckptverify.errors import ManifestError
    from ckptverify.ownfiles.manifest import read_manifest

    path = fresh_ckpt("single")
    with open(path / MANIFEST_FILE, "wb") as f:
        f.truncate(1 << 20)  # sparse: costs no disk
    with pytest.raises(ManifestError, match="more than"):
        read_manifest(str(path), max_bytes=1 << 19)


def test_checkpoint_reached_through_a_linked_root_passes(fresh_ckpt: Any, tmp_path: Path) -> None:
    """Containment is judged against the resolved root: ``latest -> step_1000`` is not "outside"."""
    from ckptverify.audit.verify import verify_checkpoint

    path = fresh_ckpt("threads")
    fingerprint_checkpoint(path, block_bytes=4096)
    link = tmp_path / "latest"
    link.symlink_to(path)
    report = verify_checkpoint(link)
    assert report.exit_code == 0, [f.message for f in report.findings]
    assert report.stats["files"] > 1 and report.stats["manifest"]


def test_a_tuple_nested_a_million_deep_in_a_torch_save_file_is_refused_not_a_crash(tmp_path: Path) -> None:
    """Hashing a tuple recurses in C without a limit: a dict key nested a million deep would kill the process."""
    import torch

    def archive(path: Path, pkl: bytes) -> Path:
        writer = torch._C.PyTorchFileWriter(str(path))  # torch's own zip writer: a well-formed archive
        for name, data in (("data.pkl", pkl), ("byteorder", b"little"), ("version", b"3\n")):
            writer.write_record(name, data, len(data))
        writer.write_end_of_file()
        return path

    path = archive(tmp_path / "deep.pt", b"\x80\x02}" + b"K\x01" + b"\x85" * 1_000_000 + b"K\x02s.")
    ok = archive(tmp_path / "shallow.pt", pickle.dumps({((((1,),),),): 2, "w": [1.5]}, protocol=2))
    outputs = {}
    for target, codes in ((path, (1, 2)), (ok, (0,))):
        done = subprocess.run([sys.executable, "-m", "ckptverify", "verify", str(target), "--json"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode in codes, (target.name, done.returncode, done.stdout[-2000:], done.stderr[-2000:])
        assert "Traceback" not in done.stderr
        outputs[target.name] = json.loads(done.stdout)
    assert "nests deeper than 200" in json.dumps(outputs["deep.pt"])
