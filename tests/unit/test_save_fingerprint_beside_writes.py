"""Fingerprints taken beside the writes: a save fingerprints each large contiguous CPU chunk block by block in the
threads that digest its bytes, right after each piece is written (``dcp/writer.py``: ``_fusable``, ``take_fused``,
``_DigestLane``). The manifest must be exactly the one a save writes with every fingerprint taken in a pass of
its own, whatever the chunk (dtype, NaN/Inf, tied, a view of a larger storage, small) and however the write goes
(several files at once, a write whose memory no chunk owns, a pool that never takes the work)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_fingerprint import backend, small_blocks
from test_save_fingerprint_counts import compiled, planted  # noqa: F401  (compiled: a fixture)
from torch.distributed.checkpoint import DefaultSavePlanner, SavePlanner

import ckptverify.dcp.writer as w
from ckptverify.fingerprint import kernels as kern
from ckptverify.fingerprint import tensor_fingerprint
from ckptverify.fingerprint.logical import blockwise_fingerprint, chunk_fingerprint_counted
from ckptverify.fingerprint.nonfinite import nonfinite_counts
from ckptverify.ownfiles.manifest import read_manifest

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:Detected an existing checkpoint:UserWarning",
)

BIG = 2 * kern.COMPILED_BLOCK + 4099  # two kernel blocks and a tail the host path takes


def state() -> dict[str, Any]:
    s: dict[str, Any] = {
        "f32": planted(torch.float32, BIG, 1),
        "f32.finite": planted(torch.float32, BIG, 2, specials=False),
        "bf16": planted(torch.bfloat16, BIG, 3),
        "f64.rows": planted(torch.float64, 1100 * 1000, 4).view(1100, 1000),
        "c64": planted(torch.complex64, kern.COMPILED_BLOCK + 17, 5),
        "view": planted(torch.float32, 2 * BIG, 6)[:BIG],  # not the whole of its storage: DCP copies it
        "small": planted(torch.float32, 1000, 7),
        "step": 3,
    }
    s["tied"] = s["f32"]  # the same memory written twice
    return s


def manifest_body(path: Path) -> dict[str, Any]:
    m = read_manifest(str(path))
    assert m is not None
    body = dataclasses.replace(m, created="", metadata_files={}).to_dict()
    del body["self_digest"]
    return json.loads(json.dumps(body, sort_keys=True))


def save(path: Path, s: dict[str, Any], threads: int = 1) -> w.HashingFileSystemWriter:
    writer = w.HashingFileSystemWriter(path, sync_files=False, thread_count=threads)
    dcp.save(s, storage_writer=writer)
    return writer


def reference_save(path: Path, threads: int = 1) -> dict[str, Any]:
    """The manifest of a save that takes no fingerprint beside its writes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(w.HashingFileSystemWriter, "_fusable", staticmethod(lambda plan, planner: {}))
        writer = save(path, state(), threads)
    assert writer.stats["fingerprinted_beside_writes"] == 0
    return manifest_body(path)


@pytest.fixture
def reference(compiled: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:  # noqa: F811
    return reference_save(tmp_path_factory.mktemp("reference") / "ckpt")


@pytest.mark.parametrize("threads", [1, 2])
def test_beside_the_writes_the_manifest_is_the_same(compiled: None, tmp_path: Path, threads: int) -> None:  # noqa: F811
    reference = reference_save(tmp_path / "reference", threads)  # threads: how many files
    s = state()
    writer = save(tmp_path / "ckpt", s, threads)
    # f32 (or tied: one write carries it), f32.finite, bf16, f64.rows, c64; not the view, nor the small one
    assert writer.stats["fingerprinted_beside_writes"] == 5
    assert manifest_body(tmp_path / "ckpt") == reference
    m = read_manifest(str(tmp_path / "ckpt"))
    assert m is not None
    for fqn, t in s.items():
        if isinstance(t, torch.Tensor):
            assert m.tensors[fqn].fingerprint == tensor_fingerprint(t).value, fqn
            assert (m.tensors[fqn].nan_count, m.tensors[fqn].inf_count) == nonfinite_counts(t), fqn


def test_a_write_that_carries_no_chunk_s_memory_leaves_the_fingerprint_to_the_writer(
        reference: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the stream is handed a copy (no chunk's memory), every chunk is fingerprinted after the write."""
    monkeypatch.setattr(w._HashingFileSystem, "take_fused", lambda self, view: None)
    writer = save(tmp_path / "ckpt", state())
    assert writer.stats["fingerprinted_beside_writes"] == 0
    assert manifest_body(tmp_path / "ckpt") == reference


def test_a_pool_that_never_starts_leaves_the_work_to_the_writing_thread(
        reference: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every digest thread busy elsewhere, the writing thread digests and fingerprints each piece itself."""
    busy = ThreadPoolExecutor(max_workers=1)
    release = threading.Event()
    busy.submit(release.wait)
    monkeypatch.setattr(w, "_hash_pool", lambda: busy)
    try:
        writer = save(tmp_path / "ckpt", state())
    finally:
        release.set()
        busy.shutdown()
    assert writer.stats["fingerprinted_beside_writes"] == 5
    assert manifest_body(tmp_path / "ckpt") == reference


def test_a_fingerprint_that_fails_beside_the_write_is_taken_after_it(
        reference: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block pass that fails leaves its chunk incomplete, never fails the save: the chunk is fingerprinted
    after the write, with the same result."""
    def broken(self: Any, ready: int) -> None:
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(w.BlockwiseFingerprint, "advance", broken)
    writer = save(tmp_path / "ckpt", state())
    assert writer.stats["fingerprinted_beside_writes"] == 0
    assert manifest_body(tmp_path / "ckpt") == reference


@pytest.mark.parametrize("step", [4096, 1 << 20, 3 << 20, 7 << 20])
def test_blockwise_fingerprint_is_the_chunk_fingerprint_however_the_bytes_come(compiled: None,  # noqa: F811
                                                                             step: int) -> None:
    """Ready bytes in steps that do and do not meet the blocks' ends: the same fingerprint and count as
    :func:`chunk_fingerprint_counted`, for a chunk of a larger tensor too."""
    whole = planted(torch.float32, 3000 * 1500, 9).view(3000, 1500)
    chunk = whole[1000:2500]
    bw = blockwise_fingerprint(chunk, (1000, 0), (3000, 1500))
    assert bw is not None and bw.nbytes == chunk.numel() * 4
    ready = 0
    while not bw.complete:
        with pytest.raises(RuntimeError):
            bw.result()
        ready += step
        bw.advance(ready)
    assert bw.result() == chunk_fingerprint_counted(chunk, (1000, 0), (3000, 1500))


def test_no_blockwise_fingerprint_where_the_kernel_would_not_take_the_chunk(compiled: None) -> None:  # noqa: F811
    assert blockwise_fingerprint(torch.randn(1000), (0,), (1000,)) is None  # too small
    assert blockwise_fingerprint(torch.randn(3000, 1500).t(), (0, 0), (1500, 3000)) is None  # not contiguous
    # Rows shorter than a block: runs of the global index the kernel's blocks do not hold.
    assert blockwise_fingerprint(torch.randn(3000, 1500)[:, :700].contiguous(), (0, 0), (3000, 1500)) is None
    with backend("numpy"):
        assert blockwise_fingerprint(torch.randn(BIG), (0,), (BIG,)) is None
    assert os.environ.get("CKPTVERIFY_FINGERPRINT_BACKEND") in (None, "auto", "compiled")


class CastingPlanner(DefaultSavePlanner):
    """A user's planner that writes every float32 tensor as float64: ``resolve_data`` makes a new tensor."""

    def transform_object(self, write_item: Any, object: Any) -> Any:
        if isinstance(object, torch.Tensor) and object.dtype == torch.float32:
            return object.to(torch.float64)
        return super().transform_object(write_item, object)

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        items = [dataclasses.replace(item, tensor_data=dataclasses.replace(
            item.tensor_data, properties=dataclasses.replace(item.tensor_data.properties, dtype=torch.float64)))
            if item.tensor_data is not None and item.tensor_data.properties.dtype == torch.float32 else item
            for item in plan.items]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan


class NoLookupPlanner(SavePlanner):
    """A planner that is not a ``DefaultSavePlanner``: it says nothing of what the state dict holds."""

    def __init__(self) -> None:
        self.inner = DefaultSavePlanner()

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        self.inner.set_up_planner(*args, **kwargs)

    def create_local_plan(self) -> Any:
        return self.inner.create_local_plan()

    def create_global_plan(self, plans: Any) -> Any:
        return self.inner.create_global_plan(plans)

    def finish_plan(self, plan: Any) -> Any:
        return self.inner.finish_plan(plan)

    def resolve_data(self, write_item: Any) -> Any:
        return self.inner.resolve_data(write_item)


def test_a_planner_that_makes_new_tensors_has_them_fingerprinted_after_the_write(compiled: None,  # noqa: F811
                                                                                tmp_path: Path) -> None:
    """Only memory the state dict holds rides on its write: what a planner makes (here a float64 copy of each
    float32 tensor) is neither kept for the whole write nor matched; its fingerprint is the copy's, taken after."""
    s = {"f32": planted(torch.float32, BIG, 1), "bf16": planted(torch.bfloat16, BIG, 3)}
    writer = w.HashingFileSystemWriter(tmp_path / "ckpt", sync_files=False)
    fusable = w.HashingFileSystemWriter._fusable
    seen: list[set[str]] = []

    def spy(plan: Any, planner: Any) -> Any:
        out = fusable(plan, planner)
        seen.append({item.index.fqn for item, _, _ in out.values()})
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(w.HashingFileSystemWriter, "_fusable", staticmethod(spy))
        dcp.save(s, storage_writer=writer, planner=CastingPlanner())
    assert seen == [{"bf16"}]  # the float64 copy is not kept: it is not the state dict's memory
    assert writer.stats["fingerprinted_beside_writes"] == 1
    m = read_manifest(str(tmp_path / "ckpt"))
    assert m is not None
    assert m.tensors["f32"].fingerprint == tensor_fingerprint(s["f32"].to(torch.float64)).value
    assert m.tensors["bf16"].fingerprint == tensor_fingerprint(s["bf16"]).value
    loaded = {"f32": torch.empty(BIG, dtype=torch.float64), "bf16": torch.empty(BIG, dtype=torch.bfloat16)}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt")
    assert torch.equal(loaded["f32"].view(torch.int64), s["f32"].to(torch.float64).view(torch.int64))


def test_a_planner_that_says_nothing_of_the_state_dict_has_every_chunk_fingerprinted_after_the_write(
        reference: dict[str, Any], tmp_path: Path) -> None:
    writer = w.HashingFileSystemWriter(tmp_path / "ckpt", sync_files=False)
    dcp.save(state(), storage_writer=writer, planner=NoLookupPlanner())
    assert writer.stats["fingerprinted_beside_writes"] == 0
    assert manifest_body(tmp_path / "ckpt") == reference


def test_a_thread_s_staging_buffer_serves_only_its_own_block_shape(compiled: None) -> None:  # noqa: F811
    """Each thread keeps its staging buffer across chunks; a block geometry of another shape (the tests' small
    blocks) must get a buffer of its own, not fail the kernel (which would turn it off for the process)."""
    big = planted(torch.float32, BIG, 11)
    assert blockwise_fingerprint(big, (0,), (BIG,)) is not None  # stages a full-size block in this thread
    expected = chunk_fingerprint_counted(big, (0,), (BIG,))
    bw = blockwise_fingerprint(big, (0,), (BIG,))
    assert bw is not None
    bw.advance(bw.nbytes)
    assert bw.result() == expected
    small = planted(torch.float32, 1000, 12)
    with small_blocks(eager=32, row=16, compiled=64):
        bw = blockwise_fingerprint(small, (0,), (1000,))
        assert bw is not None
        bw.advance(bw.nbytes)
        got, count = bw.result()
    assert not kern._compile_failed
    assert got == tensor_fingerprint(small)
    assert count == 6  # planted: 3 NaN, 2 +Inf, 1 -Inf
