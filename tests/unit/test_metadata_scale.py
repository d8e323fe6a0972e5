"""Metadata reading and the structural checks are linear in the number of chunks.

Work is measured by counting Python function calls (``sys.setprofile``), which does not depend on machine
load: quadrupling the chunks must roughly quadruple the calls (a quadratic loop would multiply them by 16).
One test also reads and checks 100 000 chunks end to end under a generous time bound.
"""

from __future__ import annotations

import itertools
import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptverify.checks.structure import check_coverage, check_files, check_items, check_tiling, stat_files
from ckptverify.dcp.metadata import read_layout


def write_metadata(root: Path, grid: tuple[int, ...], step: int = 2, files: int = 8) -> int:
    """A ``.metadata`` (pickled by torch from DCP's own classes) for one tensor cut into a grid of chunks."""
    shape = tuple(g * step for g in grid)
    chunks, storage = [], {}
    for i, idx in enumerate(itertools.product(*(range(g) for g in grid))):
        offsets = torch.Size(k * step for k in idx)
        chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([step] * len(grid))))
        storage[MetadataIndex("w", offsets, i)] = _StorageInfo(f"__{i % files}_0.distcp", (i // files) * 64, 64)
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)},
                  storage_data=storage)
    root.mkdir(parents=True, exist_ok=True)
    (root / ".metadata").write_bytes(pickle.dumps(md))
    return len(chunks)


def read_and_check(root: Path) -> int:
    """Everything verify does with the metadata alone; returns the number of findings."""
    layout, findings = read_layout(str(root))
    assert layout is not None, findings
    tiling, _ = check_tiling(layout)
    stats = stat_files(str(root), layout.files)
    out = findings + tiling + check_coverage(layout) + check_files(str(root), layout, stats)
    out += check_items(layout, stats)
    return len(out)


def count_calls(fn, *args) -> int:
    calls = 0

    def profiler(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profiler)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return calls


# 1-D split along dim 0, along dim 1 (every chunk starts at row 0), and a 2-D grid.
ARRANGEMENTS = {
    "rows": lambda n: (n, 1),
    "columns": lambda n: (1, n),
    "grid": lambda n: (int(n**0.5), int(n**0.5)),
}


@pytest.mark.parametrize("arrangement", sorted(ARRANGEMENTS))
def test_work_grows_linearly_with_chunks(tmp_path, arrangement):
    small, large = 2500, 10000
    n_small = write_metadata(tmp_path / "s", ARRANGEMENTS[arrangement](small))
    n_large = write_metadata(tmp_path / "l", ARRANGEMENTS[arrangement](large))
    calls_small = count_calls(read_and_check, tmp_path / "s")
    calls_large = count_calls(read_and_check, tmp_path / "l")
    ratio = calls_large / calls_small
    assert ratio < 1.5 * n_large / n_small, (arrangement, calls_small, calls_large)


def test_irregular_chunks_are_bounded_not_quadratic(tmp_path):
    # Chunks of different widths stacked in one column: no grid, every chunk starts at row 0.
    chunks = [ChunkStorageMetadata(torch.Size([0, i]), torch.Size([1 + i % 2, 1])) for i in range(3000)]
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2, 3000]),
                                              chunks)}, storage_data={})
    tmp_path.joinpath(".metadata").write_bytes(pickle.dumps(md))
    layout, _ = read_layout(str(tmp_path))
    findings, _ = check_tiling(layout)
    assert any(f.check == "chunk-tiling" for f in findings)  # half the rows [1, 2) are in no chunk


def _small_tensors(path: Path, n: int) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({f"p.{i}": torch.full((4,), float(i)) for i in range(n)}, checkpoint_id=str(path))
    return path


def test_verify_work_grows_linearly_with_items(tmp_path):
    # The whole verification (metadata, structure, every item's archive and CRCs), not the metadata alone.
    from ckptverify.audit.verify import verify_checkpoint

    small, large = _small_tensors(tmp_path / "s", 500), _small_tensors(tmp_path / "l", 2000)
    calls_small = count_calls(lambda: verify_checkpoint(small, jobs=1))
    calls_large = count_calls(lambda: verify_checkpoint(large, jobs=1))
    assert calls_large / calls_small < 1.5 * 4, (calls_small, calls_large)
    assert verify_checkpoint(large, jobs=1).stats["items"] == 2000


def test_hundred_thousand_chunks_read_and_check_in_seconds(tmp_path):
    n = write_metadata(tmp_path, (100_000, 1))
    assert n == 100_000
    # Seconds on an idle machine (it was minutes when quadratic): the growth is held by the call counts above,
    # the time by scripts/bench_verify.py, and a relapse to quadratic by the per-test timeout.
    assert read_and_check(tmp_path) == 8  # the eight shard files the metadata names and nobody wrote: nothing else


def _tiling_messages(shape: tuple[int, ...], *boxes: tuple[tuple[int, ...], tuple[int, ...]]) -> list[str]:
    from ckptverify.dcp.layout import Chunk, Layout, TensorInfo

    chunks = tuple(Chunk(offsets, sizes) for offsets, sizes in boxes)
    findings, _ = check_tiling(Layout(tensors={"w": TensorInfo("w", "float32", shape, chunks)}))
    assert all(f.check == "chunk-tiling" for f in findings)
    return [f.message for f in findings]


def test_tiling_refuses_chunks_that_do_not_tile_the_tensor():
    assert _tiling_messages((4,), ((0,), (2,)), ((2,), (2,))) == []
    assert "has 2 dims, the tensor has 1" in _tiling_messages((4,), ((0, 0), (4, 1)))[0]
    assert "reaches past its global shape [4]" in _tiling_messages((4,), ((0,), (2,)), ((2,), (3,)))[0]
    assert _tiling_messages((4,), ((0,), (2,)), ((0,), (2,)), ((2,), (2,))) == [
        "chunks [0] and [0] of 'w' overlap"]  # same start: found without the sweep
    # No grid (sizes differ at one start): the sweep finds the overlap, and the gap is not said on top of it.
    assert _tiling_messages((4, 2), ((0, 0), (3, 2)), ((2, 0), (2, 1))) == ["chunks [0, 0] and [2, 0] of 'w' overlap"]
    assert _tiling_messages((), ((), ()), ((), ())) == ["scalar 'w' is stored more than once"]
