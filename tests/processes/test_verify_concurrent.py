"""Files that change while they are verified: a finding ("file changed during verification"), never a death by
``SIGBUS``, never a traceback.

A writer thread truncates, rewrites, grows and replaces a shard in a loop while ``verify`` runs again and again
in child processes (plain, ``--deep``, and against a manifest). Every child must exit by itself with 0 or 1
and print a JSON report; the runs together must have caught the changes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.errors import FileChangedError
from ckptverify.safeparse.readers import ReadOnlyFile

RUNS_PER_MODE = 8
MAX_RUNS_PER_MODE = 40
TIMEOUT = 120


def _checkpoint(path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(32 << 20, generator=g), "small": torch.arange(1000), "step": 7}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=True))
    report, manifest = fingerprint_checkpoint(path, block_bytes=1 << 20)
    assert report.passed and manifest is not None
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint (with its manifest), built once; each test verifies a fresh copy of it."""
    return _checkpoint(tmp_path_factory.mktemp("concurrent") / "ckpt")


@pytest.fixture
def checkpoint(built: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "ckpt"))


def _largest(path: Path) -> Path:
    return max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)


class _Mutator(threading.Thread):
    """Changes ``shard`` in every way a busy file system can, in short bursts, until stopped; restores it after
    each change. The shard is whole most of the time, so runs open it whole and meet the change mid-read."""

    def __init__(self, shard: Path, spare_dir: Path) -> None:
        super().__init__(daemon=True)
        self.shard, self.spare = shard, spare_dir / "spare"
        self.original = shard.read_bytes()
        self.stop = threading.Event()
        self.changes = 0

    def run(self) -> None:
        rng = random.Random(1)
        n = len(self.original)
        while not self.stop.is_set():
            op = rng.choice(("truncate",) * 6 + ("grow", "rewrite", "rewrite", "replace"))
            if op == "truncate":
                k = rng.randrange(n)
                os.truncate(self.shard, k)
                time.sleep(rng.uniform(0, 0.003))
                self._write(k, self.original[k:])
            elif op == "grow":
                with open(self.shard, "ab") as f:
                    f.write(b"\0" * rng.randrange(1, 1 << 20))
                time.sleep(rng.uniform(0, 0.003))
                os.truncate(self.shard, n)
            elif op == "rewrite":  # same size, other bytes, in place
                at = rng.randrange(n - 4096)
                self._write(at, os.urandom(4096))
                time.sleep(rng.uniform(0, 0.003))
                self._write(at, self.original[at : at + 4096])
            else:  # the same bytes in a new file, renamed over the name
                self.spare.write_bytes(self.original)
                os.replace(self.spare, self.shard)
            self.changes += 1
            time.sleep(rng.uniform(0, 0.02))
        self._write(0, self.original)
        os.truncate(self.shard, n)

    def _write(self, at: int, data: bytes) -> None:
        with open(self.shard, "r+b") as f:
            f.seek(at)
            f.write(data)


def _verify(path: Path, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                                     os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "ckptverify", "verify", "--no-progress", "--json", *extra,
                           str(path)], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode >= 0, f"verify died by signal {-proc.returncode}: {proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode in (0, 1), (proc.returncode, proc.stderr[-3000:])
    report = json.loads(proc.stdout)
    assert report["exit_code"] == proc.returncode
    return report


@pytest.mark.parametrize("mode", [(), ("--deep",), ("--no-manifest",)], ids=["manifest", "deep", "no-manifest"])
def test_shard_changing_under_verify_is_a_finding_never_a_crash(mode: tuple[str, ...], checkpoint: Path,
                                                                 tmp_path: Path) -> None:
    path = checkpoint  # a fresh copy: the writer below changes (and restores) its largest shard
    mutator = _Mutator(_largest(path), tmp_path)
    mutator.start()
    reports: list[dict] = []

    def failed() -> list[dict]:
        return [r for r in reports if r["exit_code"] == 1]

    def changed() -> list[dict]:
        return [r for r in reports if any(f["check"] == "file-changed" for f in r["findings"])]

    try:
        # How many runs meet a change depends on how the scheduler interleaves the writer and the reader, so runs
        # go on (up to a bound) until enough have met one; a reader blind to changes never gets there. Every run,
        # however many, is held to "exit 0 or 1 with a JSON report".
        while len(reports) < RUNS_PER_MODE or (
            (len(failed()) < RUNS_PER_MODE // 2 or not changed()) and len(reports) < MAX_RUNS_PER_MODE
        ):
            reports.append(_verify(path, *mode))
    finally:
        mutator.stop.set()
        mutator.join()
    assert mutator.changes > RUNS_PER_MODE
    assert len(failed()) >= RUNS_PER_MODE // 2, [r["findings"][:2] for r in reports]
    assert changed(), [r["findings"][:3] for r in reports]
    for r in changed():
        f = next(f for f in r["findings"] if f["check"] == "file-changed")
        assert f["severity"] == "error" and "file changed during verification" in f["message"]
    # Left alone again, the checkpoint passes.
    assert verify_checkpoint(path, deep=True).passed


def test_truncation_between_open_and_read_is_reported(tmp_path: Path) -> None:
    """Deterministic: a reader whose file shrinks reports it instead of returning short data or faulting."""
    p = tmp_path / "f"
    p.write_bytes(os.urandom(3 << 20))
    with ReadOnlyFile(str(p)) as f:
        os.truncate(p, 1 << 20)
        with pytest.raises(FileChangedError):
            f.crc32(0, f.size)
        with pytest.raises(FileChangedError):
            f.pread((2 << 20), 100)
        assert f.changed() is not None
    p.write_bytes(b"x" * 100)
    with ReadOnlyFile(str(p)) as f:
        assert f.changed() is None
        spare = tmp_path / "g"
        spare.write_bytes(b"x" * 100)
        os.replace(spare, p)
        assert "replaced" in (f.changed() or "")


def test_verify_reports_a_shard_rewritten_in_place_after_it_was_read(checkpoint: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A change that leaves the bytes read intact (it happens after they were hashed) is still reported."""
    from ckptverify.checks.dcp_pipeline import VerificationRun

    path = checkpoint
    shard = _largest(path)
    real = VerificationRun._hash

    def hash_then_touch(self: VerificationRun, layout: object) -> None:
        real(self, layout)
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))

    monkeypatch.setattr(VerificationRun, "_hash", hash_then_touch)
    report = verify_checkpoint(path)
    changed = [f for f in report.findings if f.check == "file-changed"]
    assert len(changed) == 1 and changed[0].location.file == shard.name, report.findings
    assert report.exit_code == 1
