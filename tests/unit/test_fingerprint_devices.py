"""Where and how a fingerprint runs on a GPU, checked on CPU.

A CUDA fingerprint must run on its tensor's device (a thread's current device is ``cuda:0``), on a stream chosen
on purpose, never during a CUDA graph capture, and fall back to eager torch for one call when a launch fails.
The many-tensor kernel copies at most a bounded buffer at a time, builds its tables with tensor operations, and
keeps an evicted table alive for the streams that used it. The CUDA calls go through small module functions
(``device._cuda_scope``, ``device._side_stream``, the Triton launchers), which these tests replace to watch them
on tensors that report a CUDA device while their data is on the CPU. tests/gpu/test_cuda.py and
scripts/gpu_check*.sh run the real thing on GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from ckptverify.errors import UsageError
from ckptverify.fingerprint import chunk_fingerprint, device, tensor_fingerprint
from ckptverify.fingerprint import eager as ref
from ckptverify.fingerprint import kernels as kern
from ckptverify.fingerprint import triton_kernel as tri
from ckptverify.fingerprint.spec import INDEX_MULTIPLIER, LANES, dtype_seed
from ckptverify.fingerprint.spec import signed as _signed

# ------------------------------------------------------------------------------------------- helpers


def on_fake_cuda(t: torch.Tensor, index: int) -> torch.Tensor:
    """``t`` (CPU data) reporting ``cuda:index`` as its device, as do the tensors torch makes from it."""
    cls = type(f"FakeCuda{index}", (torch.Tensor,), {"device": property(lambda self: torch.device("cuda", index))})
    return t.as_subclass(cls)


class Guards:
    """Replaces ``device._cuda_scope``: records each entry (device, stream, thread name) and keeps, per thread,
    the stack of devices entered, so a launch can say which device was current when it ran."""

    def __init__(self) -> None:
        self.entries: list[tuple[torch.device, Any, str]] = []
        self._local = threading.local()

    def current(self) -> torch.device | None:
        stack = getattr(self._local, "stack", [])
        return stack[-1] if stack else None

    @contextlib.contextmanager
    def __call__(self, dev: torch.device, stream: Any) -> Iterator[None]:
        self.entries.append((dev, stream, threading.current_thread().name))
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(dev)
        try:
            yield
        finally:
            stack.pop()


@pytest.fixture
def guards(monkeypatch: pytest.MonkeyPatch) -> Guards:
    g = Guards()
    monkeypatch.setattr(device, "_cuda_scope", g)
    monkeypatch.setattr(kern, "_backend", "auto")
    return g


def emulate_many(bits: torch.Tensor, table: torch.Tensor, out: torch.Tensor, programs: int) -> None:
    """The many-tensor kernel's arithmetic in torch, row by row of its table (what Triton would run)."""
    w = bits.to(torch.int64)
    for r, (start, first, length, s0, s1) in enumerate(table.view(-1, 5)[:programs].tolist()):
        seg = w[start : start + length]
        p = torch.arange(first, first + length, dtype=torch.int64).mul_(_signed(INDEX_MULTIPLIER))
        for lane, seed in enumerate((s0, s1)):
            out[r, lane] = ref.mix_tensor(seg ^ (p + seed), LANES[lane]).sum()


def old_rows(numels: list[int], sizes: list[int], seeds: list[tuple[int, int]]) -> list[list[int]]:
    """The many-tensor table as the former plan built it: a Python loop per block of every tensor."""
    rows: list[list[int]] = []
    for size in dict.fromkeys(sizes):
        offset = 0
        for m, n in enumerate(numels):
            if sizes[m] != size or not n:
                continue
            for b in range(0, n, tri.BLOCK):
                rows.append([offset + b, b, min(tri.BLOCK, n - b), _signed(seeds[m][0]), _signed(seeds[m][1])])
            offset += n
    return rows


@pytest.fixture
def many_kernel(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The many-tensor kernel available and checked, launched through :func:`emulate_many`; the list collects
    the bytes of each launch's buffer."""
    sizes: list[int] = []

    def launch(bits: torch.Tensor, table: torch.Tensor, out: torch.Tensor, programs: int) -> None:
        sizes.append(bits.numel() * bits.element_size())
        emulate_many(bits, table, out, programs)

    monkeypatch.setattr(tri, "_kernel", lambda: object())
    monkeypatch.setattr(tri, "_launch_many", launch)
    monkeypatch.setitem(tri._many_verified, "cpu", True)
    monkeypatch.setattr(tri, "_plans", type(tri._plans)())
    return sizes


def mixed_tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3 * tri.BLOCK + 5, generator=gen),
        torch.randn(17, generator=gen).to(torch.bfloat16),
        torch.zeros(0),
        torch.randint(-128, 127, (tri.BLOCK + 1,), dtype=torch.int8, generator=gen),
        torch.randn(300, generator=gen),
        torch.randn(9, dtype=torch.complex64, generator=gen),
        torch.randn(5, 600, generator=gen).t(),  # not contiguous
        torch.randn(2, 3, dtype=torch.complex64, generator=gen).conj(),  # conjugated
        torch.randn(1000, generator=gen).to(torch.float64),
    ]


# ------------------------------------------------------------------------------------- 1: the device


def test_a_cuda_3_tensor_is_fingerprinted_inside_the_cuda_3_guard_of_the_thread_that_fingerprints_it(
    guards: Guards, monkeypatch: pytest.MonkeyPatch
) -> None:
    launches: list[tuple[torch.device, torch.device | None, str]] = []

    def launch(flat: torch.Tensor, geometry: Any, seeds: tuple[int, int]) -> tuple[int, int]:
        launches.append((flat.device, guards.current(), threading.current_thread().name))
        return 1, 2

    monkeypatch.setattr(tri, "lanes", launch)
    t = on_fake_cuda(torch.randn(64, 96), 3)
    with ThreadPoolExecutor(1, thread_name_prefix="fingerprinter") as pool:
        got = pool.submit(chunk_fingerprint, t[16:48], [16, 0], [64, 96]).result()
    assert got.lanes == (1, 2)
    assert len(launches) == 1
    tensor_device, current, thread = launches[0]
    assert tensor_device == torch.device("cuda", 3)
    assert current == torch.device("cuda", 3)
    assert thread.startswith("fingerprinter")
    assert (torch.device("cuda", 3), None, thread) in guards.entries


def test_the_many_tensor_fingerprint_of_cuda_3_tensors_runs_inside_the_cuda_3_guard(
    guards: Guards, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[torch.device | None] = []

    def launch(tensors: list[torch.Tensor]) -> torch.Tensor:
        seen.append(guards.current())
        return torch.zeros((len(tensors), 2), dtype=torch.int64)

    monkeypatch.setattr(tri, "lanes_many", launch)
    tensors = [on_fake_cuda(torch.randn(100), 3), on_fake_cuda(torch.randn(7), 3)]
    assert kern.lanes_many(tensors).shape == (2, 2)
    assert seen == [torch.device("cuda", 3)]


def test_a_save_thread_fingerprinting_chunks_of_two_gpus_enters_each_gpus_guard_and_side_stream(
    guards: Guards, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from ckptverify.dcp.writer import HashingFileSystemWriter

    launched: dict[torch.device, torch.device | None] = {}

    def launch(flat: torch.Tensor, geometry: Any, seeds: tuple[int, int]) -> tuple[int, int]:
        launched[flat.device] = guards.current()
        return 5, 6

    sides: list[tuple[torch.device, Any, Any]] = []

    def side_stream(dev: torch.device, kept: Any, producer: Any, t: torch.Tensor) -> Any:
        sides.append((dev, kept, producer))
        return f"side{dev.index}"

    monkeypatch.setattr(tri, "lanes", launch)
    monkeypatch.setattr(device, "_side_stream", side_stream)
    data = {"a": on_fake_cuda(torch.randn(4, 300), 1), "b": on_fake_cuda(torch.randn(500), 3),
            "c": on_fake_cuda(torch.randn(200), 1), "d": torch.randn(50)}
    items = []
    for fqn, t in data.items():
        chunk = ChunkStorageMetadata(offsets=torch.Size([0] * t.dim()), sizes=t.shape)
        props = TensorProperties.create_from_tensor(torch.empty(0))
        items.append(WriteItem(index=MetadataIndex(fqn, torch.Size([0] * t.dim())), type=WriteItemType.TENSOR,
                               tensor_data=TensorWriteData(chunk=chunk, properties=props, size=t.shape)))

    class Planner:
        def resolve_data(self, item: WriteItem) -> torch.Tensor:
            return data[item.index.fqn]

    streams = device.FingerprintStreams({1: "producer1", 3: "producer3"})
    with ThreadPoolExecutor(1, thread_name_prefix="ckptverify-fingerprint") as pool:
        facts = pool.submit(HashingFileSystemWriter._fingerprint_items, SavePlan(items), Planner(), set(),
                            streams).result()
    assert {fqn: facts[item.index].fingerprint is not None for fqn, item in zip(data, items, strict=True)} == {
        "a": True, "b": True, "c": True, "d": True}
    assert launched == {torch.device("cuda", 1): torch.device("cuda", 1),
                        torch.device("cuda", 3): torch.device("cuda", 3)}
    # Each GPU chunk: its device's guard, then its device's side stream, made once per device, waiting for the
    # saving thread's stream of that device. The CPU chunk enters no guard.
    assert sides == [(torch.device("cuda", 1), None, "producer1"), (torch.device("cuda", 3), None, "producer3"),
                     (torch.device("cuda", 1), "side1", "producer1")]
    with_streams = [(d.index, s) for d, s, thread in guards.entries if s is not None]
    assert with_streams == [(1, "side1"), (3, "side3"), (1, "side1")]
    assert {thread for _, _, thread in guards.entries} == {"ckptverify-fingerprint_0"}
    assert {d.index for d, _, _ in guards.entries} == {1, 3}


def test_a_save_asks_cuda_for_the_current_streams_of_its_tensors_devices_only(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: asked.append(d) or f"stream of {d}")
    assert device.FingerprintStreams.capture([torch.device("cpu")])._producers == {}
    assert asked == []  # a CPU-only save asks CUDA nothing (no context, no lazy init)
    got = device.FingerprintStreams.capture([torch.device("cuda", 2), torch.device("cpu"), torch.device("cuda", 2),
                                             torch.device("cuda", 0)])
    assert got._producers == {2: "stream of cuda:2", 0: "stream of cuda:0"}
    assert asked == [torch.device("cuda", 2), torch.device("cuda", 0)]


def test_the_writer_finds_its_chunks_devices_where_the_state_dict_holds_them() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckptverify.dcp.writer import _chunk_devices

    state = {"a": on_fake_cuda(torch.randn(3), 1), "b": torch.randn(2), "n": 5}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plan = planner.create_local_plan()
    assert _chunk_devices(plan, planner) == {torch.device("cuda", 1), torch.device("cpu")}


def test_a_cpu_fingerprint_enters_no_device_guard(guards: Guards) -> None:
    tensor_fingerprint(torch.randn(1000))
    kern.lanes_many([torch.randn(10)])
    assert guards.entries == []


# ------------------------------------------------------------------------- 11: what is never launched


def test_a_meta_or_fake_tensor_is_refused_rather_than_fingerprinted() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(UsageError, match="meta tensor"):
        tensor_fingerprint(torch.empty(4, device="meta"))
    with pytest.raises(UsageError, match="meta tensor"):
        kern.lanes_many([torch.empty(4, device="meta")])
    mode = FakeTensorMode()
    fake = mode.from_tensor(torch.randn(8))
    with pytest.raises(UsageError, match="fake tensor"):
        chunk_fingerprint(fake, [0], [8])


def test_nothing_is_launched_while_the_stream_is_capturing_a_cuda_graph(
    guards: Guards, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(tri, "lanes", lambda *a: calls.append("lanes"))
    monkeypatch.setattr(tri, "lanes_many", lambda *a: calls.append("many"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    t = on_fake_cuda(torch.randn(100), 2)
    with pytest.raises(UsageError, match="capturing a CUDA graph"):
        tensor_fingerprint(t)
    with pytest.raises(UsageError, match="capturing a CUDA graph"):
        kern.lanes_many([t])
    assert calls == []
    # The kernel's own entry declines too, for a caller that reaches it directly.
    monkeypatch.undo()
    monkeypatch.setattr(tri, "_kernel", lambda: object())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    geometry = ref.chunk_geometry([100], [0], [100])
    assert tri.lanes(t.view(torch.int32), geometry, (1, 2)) is None
    assert tri.lanes_many([t]) is None


def test_a_launch_that_fails_once_falls_back_for_that_call_only_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    attempts: list[int] = []

    def flaky(flat: torch.Tensor, geometry: Any, seeds: tuple[int, int]) -> tuple[int, int]:
        attempts.append(1)
        if len(attempts) in (1, 3):
            raise RuntimeError("CUDA out of memory (transient)")
        return 7, 8

    monkeypatch.setattr(tri, "_kernel", lambda: object())
    monkeypatch.setitem(tri._verified, ("cpu", torch.int32), True)
    monkeypatch.setattr(tri, "lanes_of", flaky)
    monkeypatch.setattr(tri, "_failures", 0)
    flat = torch.arange(5000, dtype=torch.int32)
    geometry = ref.chunk_geometry([5000], [0], [5000])
    with caplog.at_level(logging.DEBUG, logger=tri.__name__):
        got = [tri.lanes(flat, geometry, (1, 2)) for _ in range(4)]
    assert got == [None, (7, 8), None, (7, 8)]
    assert tri.failures() == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "out of memory" in warnings[0].getMessage()


def test_a_many_tensor_launch_that_fails_once_falls_back_for_that_call_only(
    many_kernel: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    fail = [True]

    def launch(bits: torch.Tensor, table: torch.Tensor, out: torch.Tensor, programs: int) -> None:
        if fail.pop() if fail else False:
            raise RuntimeError("transient")
        emulate_many(bits, table, out, programs)

    monkeypatch.setattr(tri, "_launch_many", launch)
    monkeypatch.setattr(tri, "_failures", 0)
    tensors = mixed_tensors(3)
    assert tri.lanes_many(tensors) is None
    assert tri.lanes_many(tensors).tolist() == ref.lanes_many_eager(tensors).tolist()
    assert tri.failures() == 1


def test_a_self_check_that_raises_is_tried_again_and_given_up_after_three_tries(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def check() -> bool:
        calls.append(1)
        raise RuntimeError("driver hiccup")

    verdicts: dict[str, bool] = {}
    monkeypatch.setattr(tri, "_check_errors", {})
    monkeypatch.setattr(tri, "_failures", 0)
    assert [tri._checked(verdicts, "k", check) for _ in range(5)] == [False] * 5
    assert len(calls) == tri._CHECK_TRIES
    assert verdicts == {"k": False}
    assert tri._checked(verdicts, "ok", lambda: True) is True


# --------------------------------------------------------------------------- 9 and 12: many tensors


@pytest.mark.parametrize("bound", [1 << 12, 1 << 15, 1 << 40])
def test_the_many_tensor_kernel_in_bounded_launches_gives_the_eager_paths_sums(
    many_kernel: list[int], monkeypatch: pytest.MonkeyPatch, bound: int
) -> None:
    monkeypatch.setattr(tri, "MANY_GROUP_BYTES", bound)
    tensors = mixed_tensors(7)
    assert tri.lanes_many(tensors).tolist() == ref.lanes_many_eager(tensors).tolist()
    largest = max(t.numel() * t.element_size() for t in tensors)
    # Each launch's buffer: within the bound, or one tensor alone (read in place when contiguous).
    assert all(size <= max(bound, largest) for size in many_kernel)
    if bound == 1 << 12:
        assert len(many_kernel) > 4  # the float32 tensors did not all go in one buffer
    if bound == 1 << 40:
        assert len(many_kernel) == 4  # one buffer per element width: 4, 2, 1 and 8 bytes


def test_groups_keep_within_the_bound_and_take_every_nonempty_tensor_once() -> None:
    numels = [10, 0, 300, 5, 5, 1000, 7, 0, 64]
    sizes = [4, 4, 4, 2, 4, 4, 2, 1, 4]
    groups = tri._groups(numels, sizes, 1024)
    taken = sorted(m for g in groups for m in g)
    assert taken == [m for m, n in enumerate(numels) if n]
    for g in groups:
        assert len({sizes[m] for m in g}) == 1
        assert len(g) == 1 or sum(numels[m] * sizes[m] for m in g) <= 1024
    assert [5] in groups  # 4000 bytes: alone


def test_the_vectorized_plan_equals_the_block_by_block_loop_on_many_layouts() -> None:
    gen = torch.Generator().manual_seed(11)
    edge = [0, 1, 2, tri.BLOCK - 1, tri.BLOCK, tri.BLOCK + 1, 3 * tri.BLOCK, 5 * tri.BLOCK + 77]
    layouts = [[n] for n in edge] + [edge, edge[::-1]]
    for _ in range(40):
        count = int(torch.randint(1, 30, (1,), generator=gen))
        layouts.append([int(x) for x in torch.randint(0, 4 * tri.BLOCK, (count,), generator=gen)])
    names = ["float32", "bfloat16", "int8", "float64", "int16", "uint8"]
    widths = {"float32": 4, "bfloat16": 2, "int8": 1, "float64": 8, "int16": 2, "uint8": 1}
    for numels in layouts:
        dtypes = [names[(i * 7 + len(numels)) % len(names)] for i in range(len(numels))]
        sizes = [widths[n] for n in dtypes]
        seeds = [(dtype_seed(n, 0), dtype_seed(n, 1)) for n in dtypes]
        plan = tri._ManyPlan(numels, sizes, seeds, torch.device("cpu"), 1 << 62)
        rows = [r for _, table, _, _ in plan.groups for r in table.view(-1, 5).tolist()]
        assert rows == old_rows(numels, sizes, seeds), numels
        assert plan.programs == len(rows)
        # Each member's programs: consecutive, from first to last (empty members: none).
        spans = [b - a for a, b in zip(plan.first.tolist(), plan.last.tolist(), strict=True)]
        assert spans == [-(-n // tri.BLOCK) for n in numels]


def test_a_plan_used_on_another_stream_is_recorded_on_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    current = ["A"]
    recorded: list[tuple[int, str]] = []
    monkeypatch.setattr(tri, "_current_stream", lambda dev: current[0])
    monkeypatch.setattr(tri, "_record_stream", lambda t, s: recorded.append((id(t), s)))
    seeds = [(dtype_seed("float32", 0), dtype_seed("float32", 1))] * 3
    plan = tri._ManyPlan([5000, 10, 3000], [4, 2, 4], seeds, torch.device("cpu"), 1 << 30)
    tensors = {id(table) for _, table, _, _ in plan.groups} | {id(plan.first), id(plan.last)}
    plan.use_on("A")  # the stream it was built on: its tensors' own
    assert recorded == []
    plan.use_on("B")
    assert sorted(i for i, _ in recorded) == sorted(tensors) and {s for _, s in recorded} == {"B"}
    plan.use_on("B")
    plan.use_on("A")
    assert len(recorded) == len(tensors)


def test_the_plan_cache_keeps_the_recently_used_plans_within_its_bounds(
    many_kernel: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tri, "_PLANS_KEPT", 3)
    lists = [[torch.randn(n)] for n in (100, 200, 300, 400)]
    for t in lists[:3]:
        tri.lanes_many(t)
    tri.lanes_many(lists[0])  # used again: now the most recent
    tri.lanes_many(lists[3])  # evicts the least recently used: the 200-element layout
    kept = [key[2][0][0] for key in tri._plans]
    assert kept == [300, 100, 400]
    monkeypatch.setattr(tri, "_PLAN_BYTES_KEPT", 1)
    tri.lanes_many([torch.randn(500)])
    assert len(tri._plans) == 1  # over the byte bound: only the newest stays


# ------------------------------------------------------------------------------ 8: rare values


def test_a_conjugated_or_negated_view_is_fingerprinted_by_its_values() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 5, dtype=torch.complex64, generator=gen)
    assert tensor_fingerprint(x.conj()) == tensor_fingerprint(x.conj().resolve_conj())
    assert tensor_fingerprint(x.conj()) != tensor_fingerprint(x)
    neg = torch.randn(1, dtype=torch.complex64, generator=gen).conj().imag  # contiguous, negative bit set
    assert neg.is_neg() and neg.is_contiguous()
    assert tensor_fingerprint(neg) == tensor_fingerprint(neg.resolve_neg())
    many = kern.lanes_many([x.conj(), neg]).tolist()
    assert many == kern.lanes_many([x.conj().resolve_conj(), neg.resolve_neg()]).tolist()


def test_a_non_contiguous_packed_float4_tensor_is_read_by_its_bytes_in_order() -> None:
    f4 = getattr(torch, "float4_e2m1fn_x2", None)
    if f4 is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    raw = torch.randint(0, 256, (8, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    packed = raw.view(f4)
    same = raw.t().contiguous().view(f4)
    assert tensor_fingerprint(packed.t()) == tensor_fingerprint(same)
    assert chunk_fingerprint(packed.t()[1:4], [1, 0], [6, 8]) == chunk_fingerprint(same[1:4], [1, 0], [6, 8])
    assert kern.lanes_many([packed.t()]).tolist() == kern.lanes_many([same]).tolist()
    assert ref.flat_bits(packed.t()).tolist() == raw.t().contiguous().view(torch.int8).reshape(-1).tolist()


# ------------------------------------------------------------------------------ 8: DTensor placements


class _Mesh:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def size(self, dim: int) -> int:
        return self.shape[dim]


def _local_shard(full: torch.Tensor, mesh_shape: tuple[int, ...], placements: list[Any],
                 coordinate: tuple[int, ...]) -> torch.Tensor:
    """The shard DTensor's ``distribute_tensor`` gives the rank at ``coordinate``: each placement's own split,
    mesh dimension by mesh dimension, left to right."""
    from torch.distributed.tensor import Replicate

    local = full
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        shards, _ = p._split_tensor(local, mesh_shape[mesh_dim], with_padding=False)
        local = shards[coordinate[mesh_dim]]
    return local


def _placement_cases() -> list[tuple[tuple[int, ...], list[Any], tuple[int, ...]]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return [
        ((2,), [_StridedShard(0, split_factor=2)], (8, 5)),
        ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)], (8, 3)),  # FSDP2 + TP on one dim
        ((3, 2), [_StridedShard(1, split_factor=2), Shard(1)], (4, 13)),  # uneven
        ((2, 2), [Shard(1), _StridedShard(0, split_factor=3)], (12, 6)),
        ((2, 2), [Replicate(), _StridedShard(0, split_factor=2)], (9, 4)),
        ((2, 3), [Shard(0), Shard(1)], (5, 7)),
    ]


@pytest.mark.parametrize("case", range(6))
def test_a_strided_shard_is_fingerprinted_box_by_box_at_its_global_indices_without_a_gather(case: int) -> None:
    import itertools

    from torch.distributed.tensor import Replicate

    from ckptverify.fingerprint import logical

    mesh_shape, placements, gshape = _placement_cases()[case]
    full = torch.randn(gshape, generator=torch.Generator().manual_seed(case))
    whole = tensor_fingerprint(full)
    sums = [0, 0]
    elements = 0
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        local = _local_shard(full, mesh_shape, placements, coordinate)
        index = logical._shard_indices(list(gshape), _Mesh(mesh_shape), placements, list(coordinate))
        assert [len(ix) for ix in index] == list(local.shape)
        assert torch.equal(full[torch.meshgrid(*index, indexing="ij")], local)
        if any(coordinate[d] for d, p in enumerate(placements) if isinstance(p, Replicate)) or not local.numel():
            continue
        for box, offsets in logical._boxes(index):
            a, b = kern.fingerprint_lanes(local[box], offsets, list(gshape), "float32")
            sums[0] += a
            sums[1] += b
            elements += local[box].numel()
    assert (sums[0] % (1 << 64), sums[1] % (1 << 64)) == whole.lanes
    assert elements == full.numel()


def test_a_shard_of_too_many_boxes_is_refused() -> None:
    from ckptverify.fingerprint import logical

    with pytest.raises(UsageError, match="separate boxes"):
        logical._boxes([torch.arange(0, 600, 2), torch.arange(0, 600, 2)])
    assert logical._boxes([torch.tensor([4, 5, 6, 0, 1]), torch.arange(3)]) == [
        ((slice(0, 3), slice(0, 3)), [4, 0]), ((slice(3, 5), slice(0, 3)), [0, 0])]


def test_the_lane_sums_of_a_cpu_offloaded_shard_travel_on_the_gpu_over_nccl_and_on_the_cpu_over_gloo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from ckptverify.fingerprint import logical

    cpu = torch.device("cpu")
    monkeypatch.setattr(logical, "_current_index", lambda kind: 5)
    for backend, local, want in [
        ("nccl", cpu, torch.device("cuda", 5)),
        ("nccl", torch.device("cuda", 2), torch.device("cuda", 2)),
        ("gloo", cpu, cpu),
        ("cpu:gloo,cuda:nccl", cpu, cpu),
        ("cpu:gloo,cuda:nccl", torch.device("cuda", 1), torch.device("cuda", 1)),
    ]:
        monkeypatch.setattr(dist, "get_backend", lambda group, b=backend: b)
        assert logical.collective_device(object(), local, "cuda") == want, backend


def _strided_worker(rank: int, world: int, out_dir: str) -> None:
    import json
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    def no_gather(self: Any, *a: Any, **k: Any) -> Any:
        raise AssertionError("full_tensor() called")

    DTensor.full_tensor = no_gather  # a fingerprint must not gather
    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(9))
    results = {}
    mesh = init_device_mesh("cpu", (world,))
    d = distribute_tensor(full, mesh, [_StridedShard(0, split_factor=2)])
    results["strided"] = tensor_fingerprint(d).to_dict()
    mesh2 = init_device_mesh("cpu", (world, 1))
    d2 = distribute_tensor(full, mesh2, [_StridedShard(1, split_factor=3), Shard(1)])
    results["strided2d"] = tensor_fingerprint(d2).to_dict()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
def test_a_strided_sharded_dtensor_on_two_gloo_ranks_has_the_full_tensors_fingerprint(tmp_path: Any) -> None:
    import json

    from helpers.multiproc import spawn_ranks

    from ckptverify.fingerprint import TensorFingerprint

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    spawn_ranks(_strided_worker, 2, str(tmp_path))
    want = tensor_fingerprint(torch.randn(8, 6, generator=torch.Generator().manual_seed(9)))
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert TensorFingerprint.from_dict(got["strided"]) == want
        assert TensorFingerprint.from_dict(got["strided2d"]) == want


def test_the_eager_many_plans_kept_are_bounded_and_evicted_oldest_first(monkeypatch) -> None:
    monkeypatch.setattr(ref, "_many_plans", {})
    monkeypatch.setattr(ref, "_MANY_PLANS_KEPT", 3)
    for n in range(1, 6):  # five layouts: one tensor of n elements each
        t = torch.arange(float(n))
        assert ref.lanes_many_eager([t]).tolist() == [[_signed(x) for x in tensor_fingerprint(t).lanes]]
    assert [key[2][0][0] for key in ref._many_plans] == [3, 4, 5]
