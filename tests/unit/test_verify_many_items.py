"""The per-item fast paths of verify and fingerprint give what the general paths give.

A checkpoint of many small items (one file for all, or one file per item) is verified through fast paths:
one ``lstat`` resolves a checkpoint's own entry instead of ``realpath`` of every component, a descriptor
closed to stay under ``readers.MAX_OPEN`` is reopened by the path resolved the first time (when it still
names the same, unchanged regular file), and many small tasks run as one pulling loop per worker instead of
one future each. Each is checked here against the general path it replaces, on planted faults: a flipped
bit in one of 10 000 small items, one item's file missing, a truncated file, a link leading out, a file
replaced or swapped for a FIFO while its descriptor was closed.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.checks import dcp_pipeline
from ckptverify.errors import FileChangedError, UnsafeFileError
from ckptverify.ownfiles import manifest as manifest_mod
from ckptverify.ownfiles.manifest import MANIFEST_FILE, read_manifest
from ckptverify.safeparse import readers
from ckptverify.safeparse.readers import ReadOnlyFile, is_inside, open_regular


def _save(path: Path, n: int, *, per_item: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({f"layers.{i}.weight": torch.full((4,), float(i)) for i in range(n)},
                 storage_writer=dcp.FileSystemWriter(str(path), thread_count=1, single_file_per_rank=not per_item))


def _general_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn every fast path off: full resolution, full reopen, one future per task, no file kept in memory."""
    monkeypatch.setattr(dcp_pipeline, "KEEP_TOTAL_BYTES", 0)
    resolve = readers._resolve_inside
    # A root spelled unlike the path's parent skips the one-lstat resolution of an entry of the root.
    monkeypatch.setattr(readers, "_resolve_inside", lambda root, path, real_root: resolve(root + "/.", path, real_root))
    monkeypatch.setattr(ReadOnlyFile, "_reopen_same", lambda self: None)
    monkeypatch.setattr(dcp_pipeline, "PULL_MAP_MIN", 1 << 62)


def _findings(report: Any) -> list[dict[str, Any]]:
    return [f.to_dict() for f in report.findings]


def _both(monkeypatch: pytest.MonkeyPatch, path: Path) -> tuple[Any, Any]:
    fast = verify_checkpoint(path, jobs=2)
    with monkeypatch.context() as m:
        _general_paths(m)
        general = verify_checkpoint(path, jobs=2)
    return fast, general


def _flip_bit(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


# --- the pulled map -------------------------------------------------------------------------------------


def test_pulled_map_gives_the_results_in_order_on_every_worker() -> None:
    seen: set[str] = set()

    def fn(x: int) -> int:
        seen.add(threading.current_thread().name)
        return x * x

    with ThreadPoolExecutor(4) as pool:
        assert dcp_pipeline.pulled_map(pool, 4, fn, list(range(5000))) == [x * x for x in range(5000)]
        assert dcp_pipeline.pulled_map(pool, 4, fn, []) == []
    assert len(seen) >= 1


def test_pulled_map_raises_what_pool_map_raises() -> None:
    def fn(x: int) -> int:
        if x in (700, 300, 4000):
            raise ValueError(f"item {x}")
        return x

    with ThreadPoolExecutor(3) as pool:
        with pytest.raises(ValueError) as general:
            list(pool.map(fn, range(5000)))
        for _ in range(5):  # whichever worker meets which failure first, the lowest index wins
            with pytest.raises(ValueError) as pulled:
                dcp_pipeline.pulled_map(pool, 3, fn, list(range(5000)))
            assert str(pulled.value) == str(general.value) == "item 300"


def test_run_map_takes_the_pulled_path_for_many_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = dcp_pipeline.pulled_map

    def spy(pool: Any, workers: int, fn: Any, items: list[Any]) -> list[Any]:
        calls.append(len(items))
        return real(pool, workers, fn, items)

    monkeypatch.setattr(dcp_pipeline, "pulled_map", spy)
    run = dcp_pipeline.VerificationRun(str(tmp_path), 2, None)
    try:
        assert run.map(lambda x: x + 1, range(10)) == list(range(1, 11))
        assert calls == []
        assert run.map(lambda x: x + 1, range(1000)) == list(range(1, 1001))
        assert calls == [1000]
    finally:
        run.close()


# --- resolving a checkpoint's own entries ------------------------------------------------------------------


def test_an_entry_resolves_as_realpath_resolves_it(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "plain").write_bytes(b"x")
    (root / "sub").mkdir()
    (root / "sub" / "deep").write_bytes(b"y")
    outside = tmp_path / "outside"
    outside.write_bytes(b"z")
    (root / "link-in").symlink_to(root / "plain")
    (root / "link-out").symlink_to(outside)
    (root / "dangling").symlink_to(tmp_path / "nothing")
    linked_root = tmp_path / "root-link"
    linked_root.symlink_to(root)
    for r in (str(root), str(root) + "/", str(linked_root), os.path.relpath(root)):
        real_root = os.path.realpath(r)
        for name in ("plain", "sub", "sub/deep", "link-in", "link-out", "dangling", "missing", "..", "."):
            path = os.path.join(r, name)
            want = os.path.realpath(path)
            inside_general = want != real_root and os.path.commonpath([real_root, want]) == real_root
            assert is_inside(r, path) == inside_general, (r, name)
            if inside_general:
                target, st = readers._resolve_inside(r, path, real_root)
                assert target == want, (r, name)
                assert st is None or st == os.lstat(want)
    with pytest.raises(UnsafeFileError, match="outside"):
        open_regular(str(root / "link-out"), root=str(root))
    fd, _ = open_regular(str(root / "link-in"), root=str(root))
    os.close(fd)


@pytest.fixture
def few_descriptors(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(readers, "MAX_OPEN", 3)
    return 3


def test_a_quick_reopen_reads_the_same_file(tmp_path: Path, few_descriptors: int) -> None:
    paths = [tmp_path / f"f{i}" for i in range(6)]
    for i, p in enumerate(paths):
        p.write_bytes(bytes([i]) * 100)
    files = [ReadOnlyFile(str(p), root=str(tmp_path)) for p in paths]
    try:
        assert files[0]._fd is None  # closed to stay under MAX_OPEN
        assert files[0].pread(0, 4) == b"\x00" * 4
        assert files[1]._fd is None
        assert files[1].pread(10, 3) == b"\x01" * 3
    finally:
        for f in files:
            f.close()


def test_a_file_replaced_while_closed_is_reported_by_either_reopen(tmp_path: Path, few_descriptors: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for general in (False, True):
        root = tmp_path / f"r{general}"
        root.mkdir()
        paths = [root / f"f{i}" for i in range(5)]
        for p in paths:
            p.write_bytes(b"a" * 100)
        with monkeypatch.context() as m:
            if general:
                _general_paths(m)
            files = [ReadOnlyFile(str(p), root=str(root)) for p in paths]
            try:
                spare = root / "spare"
                spare.write_bytes(b"a" * 100)
                st = os.stat(paths[0])
                os.utime(spare, ns=(st.st_atime_ns, st.st_mtime_ns))
                os.replace(spare, paths[0])  # same size and time, another inode
                with pytest.raises(FileChangedError, match="replaced"):
                    files[0].pread(0, 10)
                paths[1].unlink()
                os.mkfifo(paths[1])  # a FIFO in its place: never opened (it would block), reported
                with pytest.raises(FileChangedError):
                    files[1].pread(0, 10)
                paths[2].write_bytes(b"a" * 50)  # truncated (open or closed now: either way reported)
                with pytest.raises(FileChangedError):
                    files[2].pread(60, 10)
            finally:
                for f in files:
                    f.close()


# --- planted faults: fast and general paths agree --------------------------------------------------------


def test_a_flipped_bit_in_one_of_10000_items_is_found_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    _save(path, 10_000, per_item=False)
    (shard,) = path.glob("*.distcp")
    clean_fast, clean_general = _both(monkeypatch, path)
    assert clean_fast.passed and clean_general.passed
    assert _findings(clean_fast) == _findings(clean_general)
    _flip_bit(shard, shard.stat().st_size * 7 // 10)
    fast, general = _both(monkeypatch, path)
    assert not fast.passed
    assert _findings(fast) == _findings(general)
    assert fast.stats["items"] == general.stats["items"] == 10_000


def test_faults_in_a_checkpoint_of_one_file_per_item_are_found_alike(tmp_path: Path, few_descriptors: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    _save(path, 300, per_item=True)
    shards = sorted(path.glob("*.distcp"))
    assert len(shards) == 300
    clean_fast, clean_general = _both(monkeypatch, path)
    assert clean_fast.passed and clean_general.passed and _findings(clean_fast) == _findings(clean_general)
    _flip_bit(shards[17], shards[17].stat().st_size - 200)
    shards[101].unlink()
    with open(shards[202], "r+b") as f:
        f.truncate(shards[202].stat().st_size // 2)
    (path / "stray.bin").write_bytes(b"x")
    os.symlink(tmp_path, path / "__0_299.distcp.out")
    fast, general = _both(monkeypatch, path)
    assert _findings(fast) == _findings(general)
    checks = {(f.check, f.location.file) for f in fast.findings if f.severity == "error"}
    assert ("file-missing", shards[101].name) in checks
    assert any(f == shards[17].name for _, f in checks), checks
    assert any(f == shards[202].name for _, f in checks), checks


def test_fingerprint_of_many_items_gives_the_same_manifest(tmp_path: Path, few_descriptors: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    manifests = []
    for general in (False, True):
        path = tmp_path / f"ckpt{general}"
        _save(path, 200, per_item=True)
        with monkeypatch.context() as m:
            if general:
                _general_paths(m)
            report, manifest = fingerprint_checkpoint(path, jobs=2)
        assert report.passed and manifest is not None
        assert read_manifest(str(path)) == manifest
        manifests.append(manifest)
        assert verify_checkpoint(path, jobs=2).passed
    a, b = (m.to_dict() for m in manifests)
    for d in (a, b):  # .metadata differs between two saves of the same state (a uuid, the path)
        for key in ("created", "self_digest", "metadata_files"):
            d.pop(key)
    assert a == b


# --- the manifest's layout on disk ------------------------------------------------------------------------


def test_the_manifest_is_written_one_entry_a_line_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, 50, per_item=False)
    report, manifest = fingerprint_checkpoint(path, jobs=1)
    assert report.passed and manifest is not None
    text = (path / MANIFEST_FILE).read_text()
    body = json.loads(text)
    assert body == manifest.to_dict()
    assert text == manifest_mod._dumps_by_line(body)
    lines = text.splitlines()
    assert sum(1 for line in lines if line.startswith('  {"fqn": ')) == 50  # one item a line
    assert sum(1 for line in lines if line.startswith('  "layers.')) == 50  # one tensor a line
    # Odd values survive the encoding: non-ASCII names, empty containers.
    odd = {"a": {"é\n": [1, {}]}, "b": [], "c": {}, "d": None, "e": "x\"y"}
    assert json.loads(manifest_mod._dumps_by_line(odd)) == odd
    # Its self-digest still guards it: one digit changed is refused.
    edited = text.replace(manifest.items[3].digest, "0" * len(manifest.items[3].digest), 1)
    (path / MANIFEST_FILE).write_text(edited)
    with pytest.raises(Exception, match="self-digest"):
        read_manifest(str(path))


def test_small_tensors_fingerprinted_many_at_once_match_the_general_scan(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptverify.checks import adoption
    from ckptverify.fingerprint import tensor_fingerprint

    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {f"f32.{i}": torch.randn(3, 5, generator=g) for i in range(40)}
    state.update({
        "f16": torch.randn(7, generator=g).half(), "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "f64": torch.randn(4, generator=g).double(), "i64": torch.arange(9), "u8": torch.arange(5, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]), "step": torch.tensor(1000), "empty": torch.zeros(0, 3),
        "nan": torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), float("nan")]),
        "big": torch.randn(1 << 15, generator=g), "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "view": torch.randn(4, 6, generator=g).t(), "extra": {"lr": 0.1},
    })
    manifests = []
    scanned: list[set[str]] = []
    real = adoption._scan_small_tensors

    def spy(desc: Any, run_map: Any) -> Any:
        scans = real(desc, run_map)
        scanned.append(set(scans))
        return scans

    for general in (False, True):
        path = tmp_path / f"ckpt{general}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))
        with monkeypatch.context() as m:
            m.setattr(adoption, "_scan_small_tensors", (lambda desc, run_map: {}) if general else spy)
            report, manifest = fingerprint_checkpoint(path, jobs=2)
        assert report.passed and manifest is not None
        manifests.append(manifest)
    fast, general = manifests
    assert fast.tensors == general.tensors
    assert {"f32.0", "f16", "bf16", "f64", "i64", "u8", "flag", "step", "nan"} <= scanned[0]
    assert not {"big", "c64", "empty"} & scanned[0]
    assert fast.tensors["nan"].nan_count == 2 and fast.tensors["nan"].inf_count == 2
    for name in ("f32.7", "bf16", "step", "flag"):
        assert fast.tensors[name].fingerprint == tensor_fingerprint(state[name]).value


def test_a_small_file_kept_at_open_reads_as_the_file(tmp_path: Path, few_descriptors: int) -> None:
    data = bytes(range(256)) * 3
    paths = [tmp_path / f"f{i}" for i in range(6)]
    for p in paths:
        p.write_bytes(data)
    files = [ReadOnlyFile(str(p), root=str(tmp_path), keep_bytes=1 << 10) for p in paths]
    big = ReadOnlyFile(str(paths[0]), root=str(tmp_path), keep_bytes=100)  # larger than it keeps
    try:
        assert all(f.kept == len(data) for f in files) and big.kept == 0
        assert files[0]._fd is None  # closed to stay under MAX_OPEN: read from memory, no reopen
        for off, n in ((0, 10), (700, 100), (767, 5), (768, 5), (5, 0)):
            assert files[0].pread(off, n) == data[off:off + n] == big.pread(off, n)
        assert files[0]._fd is None
        paths[1].write_bytes(data[:100])  # truncated after it was read: still found, by the end-of-run check
        assert files[1].changed() is not None
        files[1].release_kept()
        assert files[1].kept == 0
        with pytest.raises(FileChangedError):
            files[1].pread(200, 10)
    finally:
        big.close()
        for f in files:
            f.close()


def test_a_file_truncated_after_it_was_kept_is_reported_changed(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    _save(path, 20, per_item=True)
    victim = sorted(path.glob("*.distcp"))[5]
    real = dcp_pipeline.VerificationRun._archives

    def truncate_then_plan(self: Any, layout: Any) -> None:
        with open(victim, "r+b") as f:
            f.truncate(100)
        real(self, layout)

    monkeypatch.setattr(dcp_pipeline.VerificationRun, "_archives", truncate_then_plan)
    report = verify_checkpoint(path, jobs=2)
    assert not report.passed
    assert any(f.check == "file-changed" and f.location.file == victim.name for f in report.findings)
