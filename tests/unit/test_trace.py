"""Per-step traces: the store round-trips, identical runs trace identically, and a planted change is found at
the step, site and category the documented semantics (docs/trace.md) say."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.multiproc import spawn_ranks
from torch import nn

from ckptverify import TrainState
from ckptverify.errors import CkptVerifyError, TraceHeaderMismatchError
from ckptverify.trace import (
    Cell,
    TraceHeader,
    TraceRecorder,
    TraceWriter,
    compare_runs,
    compare_traces,
    first_divergence,
    open_trace,
)
from ckptverify.trace.compare import merged_order, rank_comparisons

STEPS = 5

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")


def _batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(steps)]


def _train(run_dir: Path, level: str, *, steps: int = STEPS, lr_change_at: int | None = None,
           perturb_rng_at: int | None = None, zero_grad_at_end: bool = False, grads: str = "record_step",
           workload: str = "mlp", flush_every: int = 64, detail: str = "tensor") -> Path:
    """A small job: Linear/ReLU/Dropout/Linear, AdamW, StepLR. Batches come from their own generator, so the
    global generator feeds dropout only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    state = TrainState(model=model, optimizer=opt, scheduler=sched)
    header = TraceHeader(run=run_dir.name, level=level, workload=workload, extra={"optimizer": "adamw"},
                         detail=detail)
    with TraceRecorder(run_dir, header=header, flush_every=flush_every) as rec:
        rec.attach(model, optimizer=opt if grads == "hook" else None)
        for step, (x, y) in enumerate(_batches(steps), start=1):
            if perturb_rng_at == step:
                torch.rand(1)  # one extra draw: dropout's mask changes from here on
            if not zero_grad_at_end:
                opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            if lr_change_at == step:
                for group in opt.param_groups:
                    group["lr"] *= 0.5
            opt.step()
            if zero_grad_at_end:
                if grads == "record_grads":
                    rec.record_grads()
                opt.zero_grad(set_to_none=True)
            sched.step()
            state.counters.step = step
            rec.record_step(step, metrics={"loss": loss}, batch=(x, y), state=state)
    return run_dir


# ------------------------------------------------------------------------------------------- store


def test_header_round_trip_and_validation() -> None:
    h = TraceHeader(run="a", level="module", workload="w", rank=1, world_size=2, extra={"k": [1, 2]})
    assert TraceHeader.from_dict(h.to_dict()) == h
    assert h.to_dict()["schema"] == "ckptverify/trace" and h.to_dict()["schema_version"] == 1
    assert h.differences(TraceHeader.from_dict({**h.to_dict(), "run": "b", "workload": "v"})) == ["workload"]
    with pytest.raises(ValueError, match="unknown trace level"):
        TraceHeader(run="a", level="everything")
    # Only the version this tool writes reads, with every field present.
    for bad, match in (({**h.to_dict(), "schema_version": 2}, "schema version 2 is not one this tool reads"),
                       ({k: v for k, v in h.to_dict().items() if k != "detail"}, "no detail"),
                       ({k: v for k, v in h.to_dict().items() if k != "run"}, "no run")):
        with pytest.raises(CkptVerifyError, match=match):
            TraceHeader.from_dict(bad)


def test_batched_appends_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "store"
    header = TraceHeader(run="r", level="metrics", rank=0, world_size=1)
    rng = np.random.default_rng(0)
    expected: dict[int, dict[str, tuple[int, int]]] = {}
    writer = TraceWriter(path, header=header, flush_every=16, site_chunk=4, background=False)
    for step in range(0, 400, 2):  # 200 rows, steps need only increase
        row = {f"s{j}": (int(rng.integers(2**63)) * 2 + 1, int(rng.integers(2**63))) for j in range(6)}
        cells = [Cell(f"s{j}", "metric", row[f"s{j}"], "fp128") for j in range(3)]
        if step >= 200:  # a site first seen late, recorded between s2 and s3 in execution order
            row["late"] = (step, 0)
            cells.append(Cell.from_int("late", "counter", step))
        cells += [Cell(f"s{j}", "metric", row[f"s{j}"], "fp128") for j in range(3, 6)]
        if step % 10 == 0:  # a site recorded only at some steps
            cells.append(Cell.from_float("metric.nan", "metric", math.nan if step == 0 else -0.0))
        writer.append(step, cells)
        expected[step] = row
        if step == 100:
            mid = open_trace(path)  # flushed rows are readable while the writer is open
            assert mid.steps == tuple(range(0, 96, 2)) and mid.value(0, "s0") is not None
    writer.close()
    chunk_files = [f for f in (path / "values" / "c").rglob("*") if f.is_file()]
    assert len(chunk_files) == math.ceil(200 / 16) * math.ceil(8 / 4)  # (rows / flush_every) x (sites / site_chunk)

    trace = open_trace(path)
    assert trace.header == header and len(trace) == 200
    assert [s.name for s in trace.sites] == ["s0", "s1", "s2", "late", "s3", "s4", "s5", "metric.nan"]
    assert trace.site("late").category == "counters" and trace.site("s0").category == "metric"
    for step, row in expected.items():
        for j in range(6):
            assert trace.lanes(step, f"s{j}") == row[f"s{j}"]
        assert trace.value(step, "late") == (step if step >= 200 else None)
    assert math.isnan(trace.metric(0, "nan")) and math.copysign(1.0, trace.metric(10, "nan")) == -1.0
    assert trace.value(2, "metric.nan") is None and trace.value(3, "s0") is None
    assert list(trace.row(200).values) == ["s0", "s1", "s2", "late", "s3", "s4", "s5", "metric.nan"]
    assert sum(1 for _ in trace) == 200


def test_writer_refuses_misuse(tmp_path: Path) -> None:
    header = TraceHeader(run="r", level="metrics", rank=0, world_size=1)
    with TraceWriter(tmp_path / "s", header=header) as w:
        w.append(1, [Cell.from_float("a", "metric", 1.0)])
        with pytest.raises(ValueError, match="must increase"):
            w.append(1, [])
        with pytest.raises(ValueError, match="changed encoding"):
            w.append(2, [Cell.from_int("a", "metric", 1)])
        with pytest.raises(ValueError, match="twice"):
            w.append(3, [Cell.from_float("b", "metric", 1.0), Cell.from_float("b", "metric", 2.0)])
    with pytest.raises(ValueError, match="already exists"):
        TraceWriter(tmp_path / "s", header=header)


def test_presence_difference_is_a_divergence(tmp_path: Path) -> None:
    header = TraceHeader(run="a", level="metrics", rank=0, world_size=1)
    for name, extra_at in (("a", None), ("b", 2)):
        with TraceWriter(tmp_path / name, header=header) as w:
            for step in (1, 2, 3):
                cells = [Cell.from_float("metric.loss", "metric", 1.0)]
                if step == extra_at:
                    cells.append(Cell.from_int("metric.skipped", "metric", 1))
                w.append(step, cells)
    d = first_divergence(tmp_path / "a", tmp_path / "b")
    assert d is not None and (d.step, d.site, d.expected, d.actual) == (2, "metric.skipped", None, 1)
    (div,) = [f for f in compare_traces(tmp_path / "a", tmp_path / "b") if f.check == "trace-divergence"]
    assert "not recorded in A" in div.message
    with pytest.raises(CkptVerifyError, match=r"no trace store at .*missing"):
        open_trace(tmp_path / "missing")


def test_a_comparison_reads_past_the_first_divergent_block_only_when_every_step_is_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptverify.trace import store

    header = TraceHeader(run="a", level="metrics", rank=0, world_size=1)
    for name, loss_at, norm_at in (("a", None, None), ("b", 2, 5)):
        with TraceWriter(tmp_path / name, header=header) as w:
            for step in range(1, 7):
                w.append(step, [Cell.from_float("metric.loss", "metric", 1.0 + (step == loss_at)),
                                Cell.from_float("metric.grad_norm", "metric", 1.0 + (step == norm_at))])
    monkeypatch.setattr(store, "BLOCK_ROWS", 1)  # one step a block
    (first,) = rank_comparisons(tmp_path / "a", tmp_path / "b")
    assert first.first is not None and first.first.step == 2 and first.differing == ("metric.loss",)
    (every,) = rank_comparisons(tmp_path / "a", tmp_path / "b", every_step=True)
    assert every.first == first.first and every.differing == ("metric.loss", "metric.grad_norm")


def test_merged_order() -> None:
    assert merged_order(["a", "b", "c"], ["x", "a", "c", "y"]) == ["x", "a", "b", "c", "y"]


# ------------------------------------------------------------------------------------------- runs


@pytest.mark.parametrize("level", ["metrics", "state", "module"])
def test_identical_runs_trace_identically(tmp_path: Path, level: str) -> None:
    a = _train(tmp_path / "a", level)
    b = _train(tmp_path / "b", level, flush_every=2)  # batching does not change a trace's content
    assert compare_runs(a, b) == []
    assert compare_traces(a / "rank0", b / "rank0") == []
    assert first_divergence(a, b) is None
    trace = open_trace(a / "rank0")
    names = [s.name for s in trace.sites]
    assert trace.steps == tuple(range(1, STEPS + 1)) and trace.header.rank == 0
    assert isinstance(trace.metric(1, "loss"), float)
    if level == "metrics":
        assert names == ["metric.loss"]
        return
    for name in ["batch.0", "grad.0.weight", "optim.param_groups.0", "optim.state.0.weight.exp_avg",
                 "param.3.bias", "scheduler.0", "rng.torch_cpu", "counters"]:
        assert name in names
    assert names.index("grad.0.weight") < names.index("optim.param_groups.0") < names.index("param.0.weight")
    assert any(n.startswith("module.") for n in names) == (level == "module")
    if level == "module":
        forward = [n for n in names if n.startswith("module.") and ".bwd#" not in n]
        # In execution order: the root's input, then each child's input and output, then the root's output.
        assert forward == ["module.(root).in#0", "module.0.in#0", "module.0.fwd#0", "module.1.in#0",
                           "module.1.fwd#0", "module.2.in#0", "module.2.fwd#0", "module.3.in#0", "module.3.fwd#0",
                           "module.(root).fwd#0"]
        assert trace.site("module.2.fwd#0").info == "Dropout"


@pytest.mark.parametrize(("level", "step", "site", "category"), [
    ("metrics", 4, "metric.loss", "metric"),  # the loss sees the new parameters one step later
    ("state", 3, "optim.param_groups.0", "optimizer"),  # the hyperparameters precede the update they drive
    ("module", 3, "optim.param_groups.0", "optimizer"),
])
def test_learning_rate_change(tmp_path: Path, level: str, step: int, site: str, category: str) -> None:
    a = _train(tmp_path / "a", level)
    b = _train(tmp_path / "b", level, lr_change_at=3)
    d = first_divergence(a, b)
    assert d is not None
    assert (d.step, d.site, d.category, d.rank, d.origin) == (step, site, category, 0, None)
    if level != "metrics":
        ta, tb = open_trace(a / "rank0"), open_trace(b / "rank0")
        assert ta.value(3, "metric.loss") == tb.value(3, "metric.loss")
        assert ta.value(3, "grad.0.weight") == tb.value(3, "grad.0.weight")
        assert ta.value(3, "param.0.weight") != tb.value(3, "param.0.weight")
    findings = compare_runs(a, b)
    div = [f for f in findings if f.check == "trace-divergence"]
    assert len(div) == 1 and div[0].severity == "error" and div[0].location.rank == 0
    assert div[0].actual["step"] == step and div[0].actual["category"] == category and site in div[0].message
    summary = [f for f in findings if f.check == "trace-summary"]
    assert summary[0].actual["first_step"] == step and summary[0].actual["categories"] == {"0": category}


def test_dropout_rng_perturbation_names_dropout_as_origin(tmp_path: Path) -> None:
    a = _train(tmp_path / "a", "module")
    b = _train(tmp_path / "b", "module", perturb_rng_at=2)
    d = first_divergence(a, b)
    assert d is not None
    assert (d.step, d.site, d.category, d.kind) == (2, "module.2.fwd#0", "module", "module_out")
    assert (d.origin, d.origin_type, d.inputs_verified) == ("2", "Dropout", True)
    assert d.receivers[:3] == ("module.3.in#0", "module.3.fwd#0", "module.(root).fwd#0")
    as_dict = d.to_dict()  # plain JSON data: tuples become lists
    assert as_dict["receivers"] == list(d.receivers) and as_dict["origin_ranks"] == [0]
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert "module.0.fwd#0" not in d.receivers and "module.1.fwd#0" not in d.receivers
    origin = [f for f in compare_runs(a, b) if f.check == "trace-origin"]
    assert len(origin) == 1 and origin[0].location.fqn == "2" and "Dropout" in origin[0].message
    # Restricted to steps after the perturbation's first effect, the origin is unverified but still named.
    d3 = first_divergence(a, b, steps=range(3, STEPS + 1))
    assert d3 is not None and d3.step == 3
    # Without module hooks the loss is the first thing to differ.
    sa = _train(tmp_path / "sa", "state")
    sb = _train(tmp_path / "sb", "state", perturb_rng_at=2)
    d = first_divergence(sa, sb)
    assert d is not None and (d.step, d.site, d.origin) == (2, "metric.loss", None)


def test_gradients_recorded_wherever_zero_grad_is(tmp_path: Path) -> None:
    a = _train(tmp_path / "a", "state")  # zero_grad first: record_step reads p.grad
    b = _train(tmp_path / "b", "state", zero_grad_at_end=True, grads="record_grads")
    c = _train(tmp_path / "c", "state", zero_grad_at_end=True, grads="hook")  # optimizer step pre-hook
    assert compare_runs(a, b) == []
    # The hook also records the hyperparameters the optimizer step used; everything both record is equal.
    both = compare_runs(a, c, force=True)
    assert [f.check for f in both] == ["trace-sites"] and all(n.startswith("hparam.") for n in both[0].actual["sites"])
    assert any(s.kind == "grad" for s in open_trace(c / "rank0").sites)
    # Neither: the gradients are gone by record_step and are not recorded at all.
    d = _train(tmp_path / "d", "state", zero_grad_at_end=True)
    assert not any(s.kind == "grad" for s in open_trace(d / "rank0").sites)


def test_module_called_twice_gets_occurrences(tmp_path: Path) -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(torch.relu(self.block(x)))

    torch.manual_seed(0)
    model = Twice()
    with TraceRecorder(tmp_path / "run", header=TraceHeader(run="t", level="module")) as rec:
        rec.attach(model)
        for step in (1, 2):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
            rec.record_step(step, metrics={"n": step})
    names = [s.name for s in open_trace(tmp_path / "run" / "rank0").sites]
    # Backward hooks fire in backward order: bwd#0 belongs to the last call, and the root's input gradient
    # comes last. Level module includes level state: the gradients are recorded too (detail "category": one
    # cell for all of them).
    assert names == ["module.(root).in#0", "module.block.in#0", "module.block.fwd#0", "module.block.in#1",
                     "module.block.fwd#1", "module.(root).fwd#0", "module.block.bwd#0", "module.block.bwd#1",
                     "module.(root).bwd#0", "metric.n", "grad.*"]


def test_header_mismatch_refused_unless_forced(tmp_path: Path) -> None:
    a = _train(tmp_path / "a", "state")
    b = _train(tmp_path / "b", "state", workload="other")
    with pytest.raises(TraceHeaderMismatchError, match="workload") as exc:
        compare_runs(a, b)
    assert exc.value.fields == ("workload",) and exc.value.exit_code == 2
    assert compare_runs(a, b, force=True) == []
    assert compare_runs(a, b, ignore=["workload"]) == []
    m = _train(tmp_path / "m", "metrics")
    with pytest.raises(TraceHeaderMismatchError, match="level"):
        compare_traces(a / "rank0", m / "rank0")
    forced = compare_traces(a / "rank0", m / "rank0", force=True)
    assert [f.check for f in forced] == ["trace-sites"] and forced[0].severity == "warning"


def test_incomplete_steps(tmp_path: Path) -> None:
    a = _train(tmp_path / "a", "metrics")
    b = _train(tmp_path / "b", "metrics", steps=3)
    findings = compare_runs(a, b)
    assert [f.check for f in findings] == ["trace-incomplete"]
    assert findings[0].actual["steps"] == [4, 5] and findings[0].actual["only_in"] == "A"
    assert compare_runs(a, b, steps=range(1, 4)) == []
    (tmp_path / "a" / "rank1").mkdir()
    os.replace(_train(tmp_path / "x", "metrics") / "rank0", tmp_path / "a" / "rank1")
    missing = [f for f in compare_runs(a, b, steps=range(1, 4)) if f.check == "trace-incomplete"]
    assert len(missing) == 1 and missing[0].location.rank == 1


# --------------------------------------------------------------------------------------- two ranks


def _fsdp_worker(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message="Full backward hook is firing")

    mesh = init_device_mesh("cpu", (world,))
    for run, perturb, detail in (("a", False, "tensor"), ("b", False, "tensor"), ("c", True, "tensor"),
                                 ("d", True, "category")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = TrainState(model=model, optimizer=opt)
        batches = _batches(3, seed=10 + rank)
        with TraceRecorder(Path(out_dir) / run, header=TraceHeader(run=run, level="module", detail=detail)) as rec:
            rec.attach(model)
            for step, (x, y) in enumerate(batches, start=1):
                if perturb and rank == 1 and step == 2:
                    x = x + 1.0
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                rec.record_step(step, metrics={"loss": loss}, batch=(x, y), state=state)


@pytest.mark.slow
def test_two_ranks_fsdp2(tmp_path: Path) -> None:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    spawn_ranks(_fsdp_worker, 2, str(tmp_path))
    for run in "abcd":
        assert sorted(p.name for p in (tmp_path / run).iterdir()) == ["rank0", "rank1"]
    t0, t1 = open_trace(tmp_path / "a" / "rank0"), open_trace(tmp_path / "a" / "rank1")
    assert (t0.header.rank, t1.header.rank, t0.header.world_size) == (0, 1, 2)
    # Each rank records the digest of the shard it holds (traces compare runs of one sharding).
    assert t0.value(3, "param.0.weight") != t1.value(3, "param.0.weight")
    assert t0.value(1, "batch.0") != t1.value(1, "batch.0")
    assert compare_runs(tmp_path / "a", tmp_path / "b") == []

    findings = compare_runs(tmp_path / "a", tmp_path / "c")
    by_rank = {f.location.rank: f for f in findings if f.check == "trace-divergence"}
    assert by_rank[1].actual["site"] == "batch.0" and by_rank[1].actual["category"] == "data"
    # Rank 0's own batch and forward are unchanged; the gradients reduced over both ranks are not.
    assert by_rank[0].actual["step"] == 2 and by_rank[0].actual["category"] == "gradients"
    assert "(a receiver: only values a collective wrote differ on this rank)" in by_rank[0].message
    assert "receiver" not in by_rank[1].message
    summary = next(f for f in findings if f.check == "trace-summary")
    assert summary.actual["first_step"] == 2 and summary.actual["ranks"] == [0, 1]
    # The job's first divergence is rank 1's own batch: rank 0 only received it through the reduce-scatter.
    d = first_divergence(tmp_path / "a", tmp_path / "c")
    assert d is not None and (d.step, d.rank, d.category) == (2, 1, "data")
    assert (d.origin_ranks, d.receiver_ranks) == ((1,), (0,))
    assert "born on rank 1, received through a collective by rank 0" in summary.message
    rank0 = {c.rank: c.first for c in rank_comparisons(tmp_path / "a", tmp_path / "c")}[0]
    assert (rank0.step, rank0.category, rank0.own_site) == (2, "gradients", None)
    # The same run traced with one cell per category compares with the per-tensor trace: same step, rank and
    # category; every gradient of rank 0 differs, so no single tensor is named.
    rank0 = {c.rank: c.first for c in rank_comparisons(tmp_path / "a", tmp_path / "d")}[0]
    assert (rank0.step, rank0.category, rank0.site, rank0.tensors) == (2, "gradients", "grad.*", "several")
    d = first_divergence(tmp_path / "a", tmp_path / "d")
    assert d is not None and (d.step, d.rank, d.origin_ranks) == (2, 1, (1,))


# ------------------------------------------------------------------------------------------ category cells


def test_state_digests_keep_their_serialization() -> None:
    """Checkpoints store state digests: the fast walk must hash the same bytes as it always did."""
    from ckptverify.state.digest import state_digest

    values = {"nested": {"b": [1, 2.5, None, True, "x", b"y"], "a": (3, -4)},
              "tensor": torch.arange(6, dtype=torch.int16).reshape(2, 3).t(),
              "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "np": np.arange(4, dtype=np.float32),
              "scalars": [np.float64(0.1), np.int32(7), np.bool_(False), 2**70]}
    golden = {"nested": "b84bb49cbac86c96317ffe750c5c1b35", "tensor": "77c167323ed67f137e6e8b9c281ec8a0",
              "bf16": "a1558532e9e2c51ba07643078cd51441", "np": "1bc6fa2418109e907bb87e42075b6507",
              "scalars": "2b1bd4755c8c82fb6201333cf4c8c876"}
    assert {k: state_digest(v) for k, v in values.items()} == golden


def test_batched_device_lanes_equal_the_fingerprint_of_each_tensor() -> None:
    """lanes_many (the accelerator path, run here on CPU: same code) equals tensor_fingerprint tensor by tensor,
    across blocks holding several tensors and tensors cut into several blocks, also under deterministic mode."""
    from ckptverify.fingerprint import TensorFingerprint, tensor_fingerprint
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint.eager import EAGER_BLOCK

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(3, 4, generator=g), torch.zeros(0), torch.randn((), generator=g),
               torch.randint(-5, 5, (7,), dtype=torch.int8, generator=g), torch.randn(5, generator=g).bfloat16(),
               torch.randn(2, 3, dtype=torch.complex64, generator=g), torch.randn(4, 5, generator=g).t(),
               torch.randn(EAGER_BLOCK * 2 + 17, generator=g), torch.tensor([True, False]),
               torch.randn(EAGER_BLOCK - 3, generator=g), torch.randn(9, dtype=torch.float64, generator=g)]
    tensors += [torch.randn(20_000, generator=g) for _ in range(6)]
    expected = [tensor_fingerprint(t).value for t in tensors]
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):  # the second time from the cached plan
            lanes = kern.lanes_many(tensors).tolist()
            got = [TensorFingerprint.from_lanes((a % 2**64, b % 2**64), "", (), 0).value for a, b in lanes]
            assert got == expected
    finally:
        torch.use_deterministic_algorithms(previous)


def test_a_category_cell_names_the_one_member_that_changed() -> None:
    from ckptverify.trace.category import combine, locate, matches, weight

    names = [f"param.layer{i}.weight" for i in range(50)]
    weights = [weight(n) for n in names]
    rng = np.random.default_rng(0)
    lows = [int(x) * 2 + 1 for x in rng.integers(0, 2**63, 50, dtype=np.uint64)]
    base = combine(lows, weights)
    def change(j: int, delta: int) -> tuple[int, int] | None:
        changed = list(lows)
        changed[j] = (changed[j] + delta) % 2**64
        return locate(base, combine(changed, weights))

    for j, delta in ((7, 1), (31, 2**40), (0, 3 * 2**20)):  # odd and even differences: the weight mod 2**(64-k)
        found = change(j, delta)
        assert found is not None and [n for n in names if matches(n, found)] == [names[j]]
    # A difference with 63 trailing zero bits leaves the weight unknown (every odd weight matches): callers
    # name a tensor only when exactly one member matches.
    found = change(5, 2**63)
    assert found is not None and sum(matches(n, found) for n in names) == len(names)
    several = list(lows)
    several[3] = (several[3] + 5) % 2**64
    several[9] = (several[9] + 5) % 2**64
    found = locate(base, combine(several, weights))
    assert found is None or not any(matches(n, found) for n in names)
    # combine sums the low halves of whole 128-bit digests.
    assert combine([(12345 << 64) | lo for lo in lows], weights) == base
    assert locate(base, base) is None


def _flip(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.view(-1)[0:1].view(torch.int32).bitwise_xor_(1 << 20)


def _flipped_run(run_dir: Path, detail: str, flip_at: int | None, param: str = "0.weight") -> Path:
    """Like _train at level state (optimizer hook), with one bit of one parameter flipped after the optimizer
    step of ``flip_at``: as a fault in memory would."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model=model, optimizer=opt)
    with TraceRecorder(run_dir, header=TraceHeader(run=run_dir.name, level="state", detail=detail)) as rec:
        rec.attach(model, optimizer=opt)
        for step, (x, y) in enumerate(_batches(STEPS), start=1):
            rec.record_step_start(state)
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            if step == flip_at:
                _flip(dict(model.named_parameters())[param])
            rec.record_step(step, metrics={"loss": loss}, batch=(x, y), state=state)
    return run_dir


def test_category_trace_against_a_tensor_trace_names_the_flipped_tensor(tmp_path: Path) -> None:
    """Production (one cell per category) against a replay (a cell per tensor too): the first differing
    category is traced back to its tensor; two category traces can only name the category."""
    replay = _flipped_run(tmp_path / "replay", "tensor", None)
    production = _flipped_run(tmp_path / "production", "category", 3)
    trace = open_trace(production / "rank0")
    names = [s.name for s in trace.sites]
    assert "param.*" in names and "grad.*" in names and "optim.state.*" in names and "hparam.*" in names
    assert not any(n.startswith(("param.0.", "grad.0.", "hparam.0.")) for n in names)
    assert trace.header.detail == "category" and trace.site("param.*").encoding == "set128"
    assert compare_runs(replay, _flipped_run(tmp_path / "same", "category", None)) == []
    d = first_divergence(replay, production)
    assert d is not None
    assert (d.step, d.site, d.via, d.tensors, d.category) == (3, "param.0.weight", "param.*", "one", "parameters")
    div = next(f for f in compare_runs(replay, production) if f.check == "trace-divergence")
    assert "param.0.weight" in div.message and "param.*" in div.message and div.actual["via"] == "param.*"
    # Category against category: the category, and how to name the tensor.
    both = first_divergence(_flipped_run(tmp_path / "c2", "category", None), production)
    assert both is not None and (both.step, both.site, both.tensors) == (3, "param.*", "unnamed")
    # The step after, every parameter has moved on differently: no single tensor explains it.
    later = first_divergence(replay, production, steps=range(4, STEPS + 1))
    assert later is not None and later.step == 4 and later.site == "metric.loss"


def test_hyperparameters_are_one_category_cell_that_names_the_changed_one(tmp_path: Path) -> None:
    a = _train(tmp_path / "a", "state", grads="hook", zero_grad_at_end=True)
    b = _train(tmp_path / "b", "state", grads="hook", zero_grad_at_end=True, lr_change_at=3, detail="category")
    tb = open_trace(b / "rank0")
    assert "hparam.*" in [s.name for s in tb.sites] and not tb.has_site("hparam.0.lr")
    d = first_divergence(a, b)
    assert d is not None and (d.step, d.site, d.via) == (3, "hparam.0.lr", "hparam.*")
    ta = open_trace(a / "rank0")
    assert ta.value(3, "hparam.0.lr") == 5e-3 and ta.site("hparam.0.lr").group == "hparam.*"  # StepLR(2, 0.5)


def test_stream_digests_equal_the_digests_of_captured_streams() -> None:
    """The cheap change detection gives exactly state_digest(capture_rng()[kind]) after any draw, including
    draws that only use a Gaussian cached by the draw before."""
    import random

    from ckptverify.state.digest import state_digest
    from ckptverify.state.rng import capture_rng
    from ckptverify.trace.streams import StreamDigests

    gen = torch.Generator().manual_seed(5)
    streams = StreamDigests({"g": gen})

    def check() -> None:
        assert streams.current() == {k: state_digest(v) for k, v in capture_rng({"g": gen}).items()
                                     if k != "cuda_device"}  # which device: not a stream

    check()
    for draw in (random.random, np.random.rand, np.random.randn, np.random.randn, np.random.randn,
                 lambda: torch.rand(1), lambda: torch.rand(1, generator=gen), lambda: random.gauss(0, 1),
                 lambda: random.gauss(0, 1), lambda: np.random.seed(3), lambda: random.seed(4), lambda: None):
        draw()
        check()


def test_the_layout_follows_replaced_parameters_and_moved_storage(tmp_path: Path) -> None:
    """Parameters replaced (registration hooks) or given new storage (p.data = ...) between steps are read
    where they are now: the trace equals one recorded by a fresh recorder on the same state."""
    def cells(rec: TraceRecorder, state: TrainState, step: int) -> dict[str, Any]:
        rec.record_step(step, state=state)
        rec.flush()
        return open_trace(rec.store_path).row(step).values

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    state = TrainState(model=model)

    def fresh(step: int) -> Any:
        with TraceRecorder(tmp_path / f"fresh{step}", header=TraceHeader(run="x", level="state")) as rec:
            return cells(rec, state, 1)["param.*"]

    with TraceRecorder(tmp_path / "long", header=TraceHeader(run="x", level="state")) as rec:
        seen = [cells(rec, state, 1)["param.*"]]
        model[0].weight.data = torch.ones(4, 4)  # new storage under the same Parameter
        seen.append(cells(rec, state, 2)["param.*"])
        assert seen[-1] == fresh(2)
        model[1].bias = nn.Parameter(torch.full((2,), 3.0))  # a new Parameter
        seen.append(cells(rec, state, 3)["param.*"])
        assert seen[-1] == fresh(3)
    assert len(set(seen)) == 3


def test_background_writes_commit_every_row_and_report_their_errors(tmp_path: Path) -> None:
    header = TraceHeader(run="r", level="metrics", rank=0, world_size=1)
    with TraceWriter(tmp_path / "s", header=header, flush_every=4) as w:
        for step in range(1, 42):
            w.append(step, [Cell.from_int("metric.step", "metric", step)])
    trace = open_trace(tmp_path / "s")
    assert trace.steps == tuple(range(1, 42)) and trace.value(41, "metric.step") == 41
    w = TraceWriter(tmp_path / "t", header=header, flush_every=2)

    def broken(*args: Any) -> None:
        raise OSError("disk full")

    w._write = broken  # type: ignore[method-assign]
    w.append(1, [Cell.from_int("metric.step", "metric", 1)])
    w.append(2, [Cell.from_int("metric.step", "metric", 2)])  # handed to the writing thread
    with pytest.raises(OSError, match="disk full"):
        w.flush()


def test_sparse_gradients_are_digested_as_their_dense_values(tmp_path: Path) -> None:
    def run(name: str, bump: bool) -> Path:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with TraceRecorder(tmp_path / name, header=TraceHeader(run=name, level="state", detail="tensor")) as rec:
            rec.attach(model, optimizer=opt)
            for step in (1, 2):
                opt.zero_grad()
                model(torch.tensor([1, 2, 2 + (bump and step == 2)])).sum().backward()
                opt.step()
                rec.record_step(step, state=TrainState(model=model, optimizer=opt))
        return tmp_path / name

    d = first_divergence(run("a", False), run("b", True))
    assert d is not None and (d.step, d.site) == (2, "grad.0.weight")


def test_paused_recorder_records_no_module_sites(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    with TraceRecorder(tmp_path / "run", header=TraceHeader(run="p", level="module")) as rec:
        rec.attach(model, backward=False)
        with rec.paused():
            model(torch.randn(2, 4))
        rec.record_step(1, metrics={"n": 1})
        model(torch.randn(2, 4))
        rec.record_step(2, metrics={"n": 2})
    trace = open_trace(tmp_path / "run" / "rank0")
    assert trace.value(1, "module.0.fwd#0") is None and trace.value(2, "module.0.fwd#0") is not None
