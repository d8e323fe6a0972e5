"""State tracing at its floor: the shortcuts that keep a traced step's cost down record exactly what the general
paths record, the trace store grows its arrays a few times a run rather than at every write, and the trace
benchmark's direct measurement of the recorder's cost over its floor runs."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptverify.trace import Cell, TraceHeader, TraceWriter, open_trace
from ckptverify.trace.category import combine
from ckptverify.trace.cells import _metric_cell, _metric_item

_MASK64 = (1 << 64) - 1
BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench_trace.py"


def test_category_cell_lanes_are_the_sums_of_the_low_halves() -> None:
    rng = random.Random(7)
    for n in (0, 1, 5, 300):
        digests = [rng.getrandbits(128) for _ in range(n)]
        if n:
            digests[0] = (1 << 128) - 1  # carries out of the low half must not leak into the lanes
        weights = [rng.getrandbits(64) | 1 for _ in range(n)]
        lows = [d & _MASK64 for d in digests]
        expected = (sum(lows) & _MASK64, sum(lo * w for lo, w in zip(lows, weights, strict=True)) & _MASK64)
        assert combine(digests, weights) == expected


@pytest.mark.parametrize("value", [
    0.1, -0.0, float("inf"), float("nan"), 1e-310,
    torch.tensor(2.5), torch.tensor([-0.0]), torch.tensor([[3.0]], dtype=torch.float64),
    torch.tensor(1.1, dtype=torch.float16), torch.tensor(1.1, dtype=torch.bfloat16),
    torch.tensor(float("nan")), torch.tensor(0.3, requires_grad=True) * 2,
    torch.tensor(7), torch.tensor(True), torch.tensor([1.0, 2.0]), 3, True, np.float32(0.1), np.float64(0.2),
    "text", None,
])
def test_metric_shortcuts_make_the_general_cell(value: Any) -> None:
    got = _metric_item("m", value)
    assert isinstance(got, Cell)
    assert got == _metric_cell("m", value)


def test_hyperparameters_with_a_numpy_bool_keep_their_spec_while_the_groups_change(monkeypatch) -> None:
    import ckptverify.trace.hyperparams as hp

    found = []
    find = hp._find
    monkeypatch.setattr(hp, "_find", lambda *a: found.append(1) or find(*a))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    group = opt.param_groups[0]
    group["nesterov"], group["betas"] = np.bool_(False), (np.bool_(True), 0.5)
    cells = hp._HparamCells("hparam.", "tensor")
    made = []
    for step in range(5):
        group["lr"] = 0.1 / (step + 1)  # as a scheduler's step: the groups change
        before = len(found)
        got = cells([opt])
        made.append(len(found) - before)
        assert got == hp._HparamCells("hparam.", "tensor")([opt])  # a spec found from these values
        assert next(c for c in got if c.site == "hparam.0.nesterov").lanes == (0, 0)
    assert made == [1, 0, 0, 0, 0]  # found once, then reused


def test_store_grows_its_arrays_a_few_times_a_run(tmp_path: Path) -> None:
    header = TraceHeader(run="r", level="metrics", rank=0, world_size=1)
    writer = TraceWriter(tmp_path / "s", header=header, flush_every=4, site_chunk=2, background=False)
    resizes: list[int] = []
    resize = writer._steps.resize

    def counted(shape: Any) -> None:
        resizes.append(shape[0])
        resize(shape)

    writer._steps.resize = counted  # type: ignore[method-assign]
    rows = 1500
    with writer:
        for step in range(1, rows + 1):
            writer.append(step, [Cell.from_int("metric.step", "metric", step),
                                 Cell.from_float("metric.half", "metric", step / 2)])
    # Doubling from 16 chunks: 64, 128, ..., 2048 rows; growing by a quarter would resize some 20 times.
    assert len(resizes) <= math.ceil(math.log2(rows / 64)) + 1, resizes
    trace = open_trace(tmp_path / "s")
    assert trace.steps == tuple(range(1, rows + 1))
    assert trace.value(rows, "metric.step") == rows and trace.value(777, "metric.half") == 388.5
    # Rows allocated ahead and never written are chunks never written: no files for them.
    chunks = [p for p in (tmp_path / "s" / "values").rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert len(chunks) == math.ceil(rows / 4)


def test_bench_measures_the_recorder_over_its_floor() -> None:
    """Both direct measurements of scripts/bench_trace.py run on the built-in workload (no timing asserted)."""
    spec = importlib.util.spec_from_file_location("bench_trace_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(bench)
        traced, floor, write = bench.state_over_floor("small", repeats=1, steps=3)
        in_traced, in_floor, step = bench.in_loop_costs("small", blocks=1, steps=3)
    finally:
        del sys.modules[spec.name]
    assert traced > 0 and floor > 0 and write > 0
    assert all(math.isfinite(x) for x in (traced, floor, write, in_traced, in_floor, step))
    # The recorder's calls include the floor's digests; the step is milliseconds, the timed calls a fraction.
    assert in_traced > 0 and in_floor > 0 and step > in_floor
