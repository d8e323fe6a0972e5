"""The hashing stream's fast paths: small writes digested together, large writes digested piece by piece
behind the write. Whatever path a write takes, the digests are those of exactly the bytes that reached the
file, cut into the same segments and blocks, and a save's manifest is the same as with every write digested
on its own in the writing thread."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_save import check_fingerprints_match, check_manifest_against_disk

from ckptverify.checkpoint.save import save
from ckptverify.dcp import writer as w
from ckptverify.fingerprint import BlockDigest, digest_bytes
from ckptverify.ownfiles.manifest import MANIFEST_FILE

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:Detected an existing checkpoint:UserWarning",
)


class _ShortRaw(io.RawIOBase):
    """A raw stream that accepts at most ``limit`` bytes of a small write (as a raw file may) while ``short``
    is set."""

    def __init__(self, limit: int) -> None:
        self.buf = io.BytesIO()
        self.limit = limit
        self.short = False

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self.short:
            view = view[: self.limit]
        return self.buf.write(view)


def _payload(kind: str, k: int, n: int) -> Any:
    data = bytes((k * 31 + i) % 251 for i in range(n))
    if kind == "bytes":
        return data
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        return memoryview(data)
    # a memoryview of another format (torch.save hands out views of typed storages)
    return memoryview(bytearray(data[: n - n % 4])).cast("I")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(st.one_of(st.tuples(st.integers(0, 3000), st.sampled_from(["bytes", "bytearray", "memoryview",
                                                                            "typed"])), st.just("tell")),
                 max_size=40),
    block=st.integers(1, 500),
    algo=st.sampled_from(["xxh3-128", "sha256"]),
    short=st.sampled_from([None, 7]),
)
def test_stream_paths_give_the_digests_of_the_written_bytes(
    monkeypatch: pytest.MonkeyPatch, ops: list[Any], block: int, algo: str, short: int | None
) -> None:
    """Small thresholds put every path to work in one stream: collected small writes (drained at the
    collection limit, at tell(), before a large write and at close), mid-sized writes digested in place, and
    large writes cut into pieces (their last ``PIECE_BYTES`` in smaller ones); with a raw stream that takes
    only part of a small write, too."""
    monkeypatch.setattr(w, "SMALL_WRITE_BYTES", 40)
    monkeypatch.setattr(w, "COALESCE_BYTES", 100)
    monkeypatch.setattr(w, "PARALLEL_HASH_MIN_BYTES", 1000)
    monkeypatch.setattr(w, "PIECE_BYTES", 333)
    monkeypatch.setattr(w, "TAIL_PIECE_BYTES", 100)
    raw: Any = _ShortRaw(short) if short else io.BytesIO()
    stream = w._HashingStream(raw, algo, block)
    written = raw.buf if short else raw
    expected: dict[tuple[int, int], tuple[str, tuple[str, ...]]] = {}
    start = pos = 0
    for k, op in enumerate(ops):
        if op == "tell":
            assert stream.tell() == pos
            if pos > start:
                ref = BlockDigest(algo, block)
                ref.update(written.getvalue()[start:pos])
                expected[(start, pos - start)] = (ref.hexdigest(), tuple(ref.block_hexdigests()))
            start = pos
            continue
        n, kind = op
        payload = _payload(kind, k, n)
        size = memoryview(payload).nbytes
        if short:
            raw.short = size < w.SMALL_WRITE_BYTES
        got = stream.write(payload)
        assert got == (min(size, short) if short and size < w.SMALL_WRITE_BYTES else size)
        if isinstance(payload, bytearray):
            payload[:] = b"\xff" * len(payload)  # the caller reuses its buffer once write returns
        pos += got
    record = stream.finalize()
    if pos > start:
        ref = BlockDigest(algo, block)
        ref.update(written.getvalue()[start:pos])
        expected[(start, pos - start)] = (ref.hexdigest(), tuple(ref.block_hexdigests()))
    assert record.size == pos == len(written.getvalue())
    assert record.digest == digest_bytes(written.getvalue(), algo)
    assert {k: (v.digest, v.blocks) for k, v in record.segments.items()} == expected


class _ShortLargeRaw(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return max(0, memoryview(b).nbytes - 1)


@pytest.mark.parametrize("size", [5, 500, 5000])  # coalesced, digested at once, pipelined in pieces
def test_a_short_write_is_an_error(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """The digests take whole writes: a raw stream that takes less than it was given fails the write."""
    monkeypatch.setattr(w, "SMALL_WRITE_BYTES", 10)
    monkeypatch.setattr(w, "PARALLEL_HASH_MIN_BYTES", 1000)
    monkeypatch.setattr(w, "PIECE_BYTES", 300)
    stream = w._HashingStream(_ShortLargeRaw(), "xxh3-128", 100)
    with pytest.raises(OSError, match="short write"):
        stream.write(b"x" * size)


def test_pieces_no_pool_thread_took_are_digested_by_the_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every pool thread busy elsewhere, the writing thread digests each piece itself (and does not wait
    for a pool thread): the digests are the same."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(w, "SMALL_WRITE_BYTES", 10)
    monkeypatch.setattr(w, "PARALLEL_HASH_MIN_BYTES", 1000)
    monkeypatch.setattr(w, "PIECE_BYTES", 300)
    busy = ThreadPoolExecutor(max_workers=1)
    release = threading.Event()
    busy.submit(release.wait)
    monkeypatch.setattr(w, "_hash_pool", lambda: busy)
    raw = io.BytesIO()
    stream = w._HashingStream(raw, "xxh3-128", 128)
    data = bytes(range(256)) * 40
    writer = threading.Thread(target=stream.write, args=(data,), daemon=True)
    writer.start()
    writer.join(timeout=60)
    done = not writer.is_alive()
    release.set()
    busy.shutdown()
    assert done, "the write waited for a pool thread that was never free"
    stream.tell()
    record = stream.finalize()
    ref = BlockDigest("xxh3-128", 128)
    ref.update(data)
    assert raw.getvalue() == data
    assert record.digest == digest_bytes(data, "xxh3-128")
    assert record.segments[(0, len(data))].digest == ref.hexdigest()
    assert record.segments[(0, len(data))].blocks == tuple(ref.block_hexdigests())


class _CountingRaw(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, b: Any) -> int:
        self.writes += 1
        return super().write(b)


def test_digests_fall_behind_the_write_by_at_most_pieces_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a pool thread is stuck on the first piece, the write goes on for ``PIECES_IN_FLIGHT`` pieces and
    then waits (it does not digest a piece out of order, nor free a buffer still being digested); once the
    digests go on, the write completes with the digests of every byte."""
    import threading

    monkeypatch.setattr(w, "SMALL_WRITE_BYTES", 10)
    monkeypatch.setattr(w, "PARALLEL_HASH_MIN_BYTES", 1000)
    monkeypatch.setattr(w, "PIECE_BYTES", 300)
    monkeypatch.setattr(w, "PIECES_IN_FLIGHT", 3)
    monkeypatch.setattr(w, "TAIL_PIECE_BYTES", 300)
    release = threading.Event()
    started = threading.Event()
    digest = w._digest_piece

    def slow(file_digest: Any, seg: Any, piece: memoryview) -> None:
        started.set()
        release.wait(60)
        digest(file_digest, seg, piece)

    monkeypatch.setattr(w, "_digest_piece", slow)
    raw = _CountingRaw()
    stream = w._HashingStream(raw, "xxh3-128", 128)
    data = bytes(range(256)) * 40  # 35 pieces
    writer = threading.Thread(target=stream.write, args=(data,), daemon=True)
    writer.start()
    assert started.wait(60)
    deadline = time.monotonic() + 60
    while raw.writes < 4 and time.monotonic() < deadline:
        writer.join(0.01)
    writer.join(0.3)
    # the piece being digested, PIECES_IN_FLIGHT - 1 queued behind it, and the one written before the wait
    assert raw.writes == 4 and writer.is_alive()
    release.set()
    writer.join(60)
    assert not writer.is_alive()
    stream.tell()
    record = stream.finalize()
    ref = BlockDigest("xxh3-128", 128)
    ref.update(data)
    assert raw.getvalue() == data
    assert record.digest == digest_bytes(data, "xxh3-128")
    assert record.segments[(0, len(data))].blocks == tuple(ref.block_hexdigests())


def test_a_digest_that_fails_fails_the_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error raised while digesting a piece reaches the caller of ``write`` (it is not lost in the pool)."""
    monkeypatch.setattr(w, "SMALL_WRITE_BYTES", 10)
    monkeypatch.setattr(w, "PARALLEL_HASH_MIN_BYTES", 1000)
    monkeypatch.setattr(w, "PIECE_BYTES", 300)

    def broken(file_digest: Any, seg: Any, piece: memoryview) -> None:
        raise MemoryError("digest failed")

    monkeypatch.setattr(w, "_digest_piece", broken)
    stream = w._HashingStream(io.BytesIO(), "xxh3-128", 128)
    with pytest.raises(MemoryError, match="digest failed"):
        stream.write(b"x" * 5000)


def _manifest_text(root: Path) -> dict[str, Any]:
    body = json.loads((root / MANIFEST_FILE).read_text())
    # .metadata names the checkpoint's path (DCP's storage_meta): it differs between two directories
    for key in ("created", "self_digest", "metadata_files"):
        body.pop(key)
    return body


def test_manifest_same_as_with_every_write_digested_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state with many small items and tensors spanning several pieces (and block sizes that do not divide
    the pieces) gives the same manifest, digest for digest and block for block, as a save whose every write
    is digested on its own in the writing thread."""
    gen = torch.Generator().manual_seed(5)
    state = {f"small{i}": torch.randn(int(torch.randint(1, 300, (1,), generator=gen)), generator=gen)
             for i in range(300)}
    state["big"] = torch.randn(3 << 19, generator=gen)  # 6 MiB
    state["rows"] = torch.randn(700, 1001, generator=gen)  # 2.7 MiB, rows that straddle pieces
    state["step"] = 12
    block = (1 << 20) - 7
    monkeypatch.setattr(w, "PIECE_BYTES", (1 << 20) + 13)
    fast = save(state, tmp_path / "fast", block_bytes=block, thread_count=2)
    assert fast is not None
    check_manifest_against_disk(tmp_path / "fast", fast)
    check_fingerprints_match(fast, state)

    monkeypatch.setattr(w, "SMALL_WRITE_BYTES", 0)
    monkeypatch.setattr(w, "PARALLEL_HASH_MIN_BYTES", 1 << 62)
    slow = save(state, tmp_path / "slow", block_bytes=block, thread_count=2)
    assert slow is not None
    assert _manifest_text(tmp_path / "fast") == _manifest_text(tmp_path / "slow")
    assert max(len(it.blocks) for it in fast.items) == 7
