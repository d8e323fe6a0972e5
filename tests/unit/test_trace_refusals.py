"""Trace inputs the recorder, the store and the kernel re-run refuse, and values that take a
general path (a live hyperparameter that is not plain data, hyperparameters whose types change, a metric that does
not fit 64 bits, a dtype numpy lacks, a group of non-consecutive ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.trace import Cell, TraceHeader, TraceRecorder, TraceWriter, compare_runs
from ckptverify.trace.category import digest_lanes, host_digest
from ckptverify.trace.cells import _metric_cell, _tensor_cell, _value_lanes
from ckptverify.trace.comm import group_label
from ckptverify.trace.flatten import _Leaves
from ckptverify.trace.hyperparams import _HparamCells
from ckptverify.trace.kernel import Capture, rerun
from ckptverify.trace.oplog import window_from_dict
from ckptverify.trace.store import hex_lanes


@pytest.mark.parametrize(("fields", "message"), [
    ({"rank": 3}, "trace header says rank 3, but this process is rank 0"),
    ({"world_size": 4}, "trace header says world size 4, but the job has 1"),
])
def test_recorder_refuses_a_header_for_another_rank_or_world(tmp_path, fields, message) -> None:
    with pytest.raises(UsageError, match=message):
        TraceRecorder(tmp_path, header=TraceHeader(run="a", **fields))


def test_recorder_refuses_bad_chunks_a_second_model_and_grads_without_a_model(tmp_path) -> None:
    with pytest.raises(UsageError, match="chunk_elements must be positive"):
        TraceRecorder(tmp_path / "c", header=TraceHeader(run="a", level="comm"), chunk_elements=0)
    with TraceRecorder(tmp_path / "s", header=TraceHeader(run="a")) as rec:
        with pytest.raises(UsageError, match="needs a model"):
            rec.record_grads()
        rec.attach(nn.Linear(2, 2))
        with pytest.raises(UsageError, match="already attached"):
            rec.attach(nn.Linear(2, 2))


def test_writer_refuses_bad_layouts_unknown_kinds_and_rows_after_close(tmp_path) -> None:
    header = TraceHeader(run="a")
    with pytest.raises(UsageError, match="must be positive"):
        TraceWriter(tmp_path / "z", header=header, flush_every=0)
    writer = TraceWriter(tmp_path / "w", header=header, background=False)
    with pytest.raises(UsageError, match="unknown kind 'nope'"):
        writer.append(1, [Cell("x", "nope", (0, 0), "digest128")])
    with pytest.raises(UsageError, match="unknown encoding 'nope'"):
        writer.append(1, [Cell("x", "metric", (0, 0), "nope")])
    writer.append(1, [Cell.from_int("metric.n", "metric", 1)])
    writer.flush()
    with pytest.raises(UsageError, match="can only change before its first row"):
        writer.set_header(header)
    writer.close()
    with pytest.raises(UsageError, match="the trace writer is closed"):
        writer.append(2, [])


def test_cell_values_out_of_range_are_refused() -> None:
    with pytest.raises(UsageError, match="does not fit in 64 bits"):
        Cell.from_int("metric.n", "metric", 1 << 63)
    with pytest.raises(UsageError, match="32 hex digits"):
        hex_lanes("abc")


def test_a_metric_past_64_bits_is_digested_not_refused() -> None:
    cell = _metric_cell("n", 1 << 70)
    assert (cell.encoding, cell.lanes) == ("digest128", _value_lanes(1 << 70))
    assert _metric_cell("n", 1 << 71).lanes != cell.lanes


def test_a_tensor_of_a_dtype_numpy_lacks_is_digested_by_its_bytes() -> None:
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    cell = _tensor_cell("batch", "batch", t)
    assert (cell.encoding, cell.lanes) == ("digest128", digest_lanes(host_digest(t)))


def test_a_group_of_non_consecutive_ranks_is_named_by_its_hash() -> None:
    assert group_label((2, 3, 4)) == "g2-4"
    label = group_label((0, 2))
    assert label.startswith("g") and len(label) == 13 and label != group_label((0, 3))


def test_live_hyperparameters_that_are_not_plain_are_read_every_step() -> None:
    group = {"params": [0], "lr": 0.5, "betas": [0.9, 0.99]}  # a list: the group is not compared as a whole
    flat = {"optim.param_groups.0.lr": 0.5, "optim.param_groups.0.betas": [0.9, 0.99],
            "optim.param_groups.0.params": [0]}
    leaves = _Leaves(flat, "optim.", "optim.", "optim", [group])
    (first,) = leaves.cells()
    assert leaves.cells() == [first]
    group["betas"][1] = 0.999  # changed in place: the same list object
    (changed,) = leaves.cells()
    assert changed.lanes != first.lanes
    group["betas"][1] = 0.99
    group["lr"] = torch.tensor(0.5)  # not JSON: the general digest
    (tensor_lr,) = leaves.cells()
    assert tensor_lr.lanes not in (first.lanes, changed.lanes)
    group["lr"] = torch.tensor(0.25)
    assert leaves.cells()[0].lanes != tensor_lr.lanes


@pytest.mark.parametrize("fields", [{"modules": "blocks.0"}, {"capture_path": 3}])
def test_op_window_fields_of_the_wrong_type_are_refused(fields) -> None:
    with pytest.raises(UsageError, match="op window"):
        window_from_dict(fields)


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_rerun_refuses_a_time_limit_that_is_not_a_positive_number(timeout_s) -> None:
    with pytest.raises(UsageError, match="timeout_s must be a positive number"):
        rerun(Capture(op="aten.add.Tensor", args=(torch.ones(2), torch.ones(2)), kwargs={}), timeout_s=timeout_s)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on a host without CUDA")
def test_rerun_on_cuda_without_cuda_is_refused() -> None:
    with pytest.raises(UsageError, match="CUDA is not available"):
        rerun(Capture(op="aten.add.Tensor", args=(torch.ones(2), torch.ones(2)), kwargs={}), device="cuda")


def test_hyperparameters_whose_types_change_are_found_again() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5, momentum=0.9)
    cells = _HparamCells("hparam.", "tensor")
    cells([opt])
    opt.param_groups[0]["momentum"] = None  # same keys, a number no more: the packing spec is found again
    assert cells([opt]) == _HparamCells("hparam.", "tensor")([opt])
    assert "hparam.0.momentum" not in {c.site for c in cells([opt])}


def test_comparing_what_is_not_a_pair_of_run_directories_is_refused(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(CkptVerifyError, match="no trace directory at"):
        compare_runs(tmp_path / "a", tmp_path / "missing")
    with pytest.raises(CkptVerifyError, match="no rank<r>/ trace stores in"):
        compare_runs(tmp_path / "a", tmp_path / "b")
    with TraceWriter(tmp_path / "a" / "rank0", header=TraceHeader(run="a"), background=False) as w:
        w.append(1, [Cell.from_int("metric.n", "metric", 1)])
    with pytest.raises(UsageError, match="is a single trace store, not a run directory"):
        compare_runs(tmp_path / "a" / "rank0", tmp_path / "b")
