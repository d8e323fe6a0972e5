"""Level ``op`` records what decides an op's outputs, and only that: every argument (scalars, shapes, dtypes,
lists, generators), never memory no op wrote, and what an in-place op wrote. Recorded with a real
:class:`~ckptverify.trace.TraceRecorder` around real torch ops; the op log read back as the walk reads it."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from ckptverify.errors import CkptVerifyError
from ckptverify.resume.locate.ops import locate
from ckptverify.trace import TraceHeader, TraceRecorder
from ckptverify.trace.category import host_digest
from ckptverify.trace.oplog import OP_LOG_VERSION, op_log_path, read_ops


def _record(path, body, *, level="op"):
    """Run ``body()`` as step 1 of a trace at ``level`` in ``path``; the op log of that step."""
    with TraceRecorder(path, header=TraceHeader(run="t", level=level)) as rec:
        rec.record_step_start(None, step=1)
        body()
        rec.record_step(1)
    return read_ops(path, 0, 1)


def _only(events, op):
    found = [e for e in events if e.op == op]
    assert len(found) == 1, [e.op for e in events]
    return found[0]


def test_scalar_arguments_are_inputs_and_a_changed_dropout_is_named_at_its_op(tmp_path):
    def step(p):
        def body():
            torch.manual_seed(0)
            x = torch.randn(16, 8)
            F.dropout(x, p, training=True).sum()
        return body

    a = _record(tmp_path / "a", step(0.1))
    b = _record(tmp_path / "b", step(0.2))
    drawn = _only(a, "aten.bernoulli_.float")
    assert {x.name: x.text for x in drawn.arguments} == {"p": "0.9", "generator": "None"}
    assert drawn.inputs == (None,)  # the mask it overwrites is not read
    assert drawn.outputs[0] is not None  # what it drew is compared
    got = locate({0: [a]}, {0: [b]}, state_equal=True)
    assert got.origin is not None and (got.origin.kind, got.origin.op) == ("op", "aten.bernoulli_.float"), \
        got.sentence()
    assert "aten.bernoulli_.float p: 0.9 vs 0.8" in got.sentence()
    # The same code twice: nothing differs, arguments included.
    assert locate({0: [a]}, {0: [_record(tmp_path / "a2", step(0.1))]}).origin is None


def test_shapes_dtypes_lists_and_generators_are_recorded(tmp_path):
    def body(seed):
        def run():
            g = torch.Generator().manual_seed(seed)
            torch.randn(3, 4, generator=g, dtype=torch.float64)
            torch.cat([torch.ones(2), torch.zeros(2)], 0)
        return run

    a = _record(tmp_path / "a", body(1))
    b = _record(tmp_path / "b", body(2))
    ra, rb = _only(a, "aten.randn.generator"), _only(b, "aten.randn.generator")
    args_a = {x.name: x for x in ra.arguments}
    assert args_a["size"].text == "[3, 4]" and args_a["dtype"].text == "torch.float64"
    assert args_a["generator"].text is None  # a generator is named by its state, not shown
    assert args_a["generator"].digest != {x.name: x for x in rb.arguments}["generator"].digest
    cat = _only(a, "aten.cat.default")
    assert len(cat.inputs) == 2 and {x.name for x in cat.arguments} == {"tensors", "dim"}
    got = locate({0: [a]}, {0: [b]})
    assert got.origin is not None and got.origin.op == "aten.randn.generator"
    assert got.arguments == ({"name": "generator", "a": None, "b": None},)


def test_memory_no_op_wrote_is_never_compared(tmp_path):
    kept = {}

    def body():
        x = kept["x"] = torch.randn(4, 4)
        torch.empty(4, 4).copy_(x)
        torch.empty_like(x).fill_(1.0)
        x.new_empty((4, 4)).normal_()
        x.new_empty_strided((4, 4), (4, 1)).uniform_()
        torch.empty_strided((4, 4), (4, 1))[1:].zero_()  # through a view: the object was never seen
        torch.empty_like(x).bernoulli_(0.5)
        torch.empty(8).resize_(64)
        out = torch.empty(4, 4)
        torch.add(x, x, out=out)

    events = _record(tmp_path, body)
    for e in events:
        if e.op.startswith(("aten.empty", "aten.new_empty")) or e.op == "aten.resize_.default":
            assert e.outputs == (None,), e
        if e.op.split(".")[1] in ("copy_", "fill_", "normal_", "uniform_", "zero_", "bernoulli_", "resize_"):
            assert e.inputs[0] is None, e  # overwritten whole: its prior content is not read
            if e.op != "aten.resize_.default":
                assert e.outputs[0] is not None, e
    add = _only(events, "aten.add.out")
    assert add.inputs == (add.inputs[0], add.inputs[0])  # the out= buffer is not an input
    assert add.outputs[0] == host_digest(kept["x"] + kept["x"])  # what it wrote, not what the buffer held


def test_an_in_place_op_records_what_it_wrote(tmp_path):
    kept = {}

    def body():
        x = torch.arange(6, dtype=torch.float32)
        x.add(1.0)  # x is read (and its digest kept) before it is written in place
        x.mul_(3.0)
        kept["x"] = x.clone()
        params = [torch.ones(3), torch.zeros(2)]
        torch._foreach_add_(params, 2.0)
        kept["params"] = [p.clone() for p in params]

    events = _record(tmp_path, body)
    mul = _only(events, "aten.mul_.Tensor")  # a Python number reaches the op as itself
    assert mul.inputs[0] != mul.outputs[0]
    assert mul.outputs[0] == host_digest(kept["x"])
    assert {x.name: x.text for x in mul.arguments} == {"other": "3.0"}
    foreach = _only(events, "aten._foreach_add_.Scalar")
    assert foreach.outputs == tuple(host_digest(p) for p in kept["params"])


def test_op_log_versions_and_hostile_arguments_are_refused_cleanly(tmp_path):
    _record(tmp_path, lambda: torch.ones(2).mul(2.0))
    path = op_log_path(tmp_path / "rank0", 1)
    data = json.loads(path.read_text())
    assert data["version"] == OP_LOG_VERSION

    def write(d):
        path.write_text(json.dumps(d))

    for bad in (
        {**data, "version": OP_LOG_VERSION + 1},
        {**data, "version": True},
        {**data, "version": OP_LOG_VERSION - 1},
        {k: v for k, v in data.items() if k != "version"},
        {**data, "events": [{**data["events"][0], "a": [["p", "zz" * 16, "0.1"]]}]},
        {**data, "events": [{**data["events"][0], "a": [["p", "0" * 32]]}]},
        {**data, "events": [{**data["events"][0], "a": [["", "0" * 32, None]]}]},
        {**data, "events": [{**data["events"][0], "a": [["p", "0" * 32, "x" * 10_000]]}]},
        {**data, "events": [{**data["events"][0], "a": {"p": 1}}]},
    ):
        write(bad)
        with pytest.raises(CkptVerifyError):
            read_ops(tmp_path, 0, 1)


@pytest.mark.parametrize("level", ["module", "op"])
def test_our_backward_hooks_give_no_warning_at_the_users_backward(tmp_path, level):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1))
    with TraceRecorder(tmp_path, header=TraceHeader(run="t", level=level)) as rec:
        rec.attach(model)
        for step in (1, 2):
            rec.record_step_start(None, step=step)
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                model(torch.tensor([1, 2, 3])).sum().backward()
                warnings.warn("the user's own warning", UserWarning, stacklevel=1)
            rec.record_step(step)
            assert [str(w.message) for w in got] == ["the user's own warning"], step
        # The user's own full backward hook on the embedding: torch's warning is theirs, and shows.
        model[0].register_full_backward_hook(lambda *_: None)
        rec.record_step_start(None, step=3)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            model(torch.tensor([1, 2, 3])).sum().backward()
        rec.record_step(3)
        assert any("Full backward hook is firing" in str(w.message) for w in got)


def test_a_non_blocking_copy_is_not_compared_however_the_flag_is_passed(tmp_path):
    def body():
        torch.zeros(3).copy_(torch.ones(3), True)
        torch.zeros(3).copy_(torch.ones(3), non_blocking=True)
        torch.zeros(3).copy_(torch.ones(3))

    copies = [e for e in _record(tmp_path, body) if e.op == "aten.copy_.default"]
    assert [e.outputs[0] is None for e in copies] == [True, True, False]
