"""Levels ``comm`` and ``op``: the op log, collectives, the op window, captures and recompute pairs, on one rank
and on two gloo ranks, with a user's training script (tests/user_scripts/optrace_train.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.resume.run import LEVELS as RUN_LEVELS
from ckptverify.resume.run import Run, RunConfig
from ckptverify.trace import LEVELS, TraceHeader, compare_traces, open_trace, recompute_findings
from ckptverify.trace.oplog import OpWindow, ops_dropped, read_ops, window_from_dict

SCRIPT = Path(__file__).resolve().parents[1] / "user_scripts" / "optrace_train.py"
STEPS = 3


def _script():
    """The user's script as the module ``optrace_train`` (importable by name, as DataLoader workers started by
    spawn must import its Dataset class)."""
    folder = str(SCRIPT.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import optrace_train

    return optrace_train


def _run(trace_dir, *, level="op", window=None, env=None, name="a", steps=STEPS):
    """Run the user's script for ``steps`` steps in this process (one rank) with a trace at ``level``."""
    env = env or {}
    saved = {k: os.environ.get(k) for k in ("OPTRACE_SKEW", "OPTRACE_PRESERVE_RNG", "OPTRACE_CHECKPOINT")}
    os.environ.update(env)
    threads = torch.get_num_threads()
    try:
        run = Run(RunConfig(name=name, stop_step=steps, trace_dir=str(trace_dir), level=level, op_window=window))
        try:
            _script().train(run)
        finally:
            run.close()
    finally:
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _op_steps(trace_dir):
    """The steps of rank 0 that have an op log, in order."""
    return sorted(int(p.stem[4:]) for p in Path(trace_dir, "rank0", "ops").glob("step*.json"))


def _aligned(a, b):
    """Events of two op logs by key."""
    return {e.key: e for e in a}, {e.key: e for e in b}


# ------------------------------------------------------------------------------------------------ levels


def test_levels_are_ordered_and_shared():
    assert LEVELS == ("metrics", "state", "comm", "module", "op")
    assert RUN_LEVELS == LEVELS
    for level in LEVELS:
        TraceHeader(run="x", level=level)
        RunConfig(level=level)
    with pytest.raises(UsageError):
        RunConfig(level="ops")


def test_cli_level_choices():
    from ckptverify.cli import main

    params = {p.name: p for p in main.commands["resume-check"].params}
    assert tuple(params["level"].type.choices) == LEVELS


# ------------------------------------------------------------------------------------------------ one rank


@pytest.fixture(scope="module")
def op_runs(tmp_path_factory):
    """Two identical runs and one whose custom op computes differently, at level op, window step 2."""
    root = tmp_path_factory.mktemp("oplog")
    window = {"steps": [2]}
    _run(root / "a", window=window)
    _run(root / "b", window=window, name="b")
    _run(root / "skew", window=window, env={"OPTRACE_SKEW": "all"}, name="skew")
    return root


def test_op_log_is_in_execution_order_with_phases(op_runs):
    events = read_ops(op_runs / "a", 0, 2)
    assert [e.index for e in events] == list(range(len(events)))
    assert all(e.step == 2 for e in events)
    phases = [e.phase for e in events]
    # forward, then backward (with the checkpointed blocks recomputed inside it), then the optimizer
    assert phases[0] == "forward"
    first_bwd = phases.index("backward")
    assert "backward" not in phases[:first_bwd] and "optimizer" not in phases[:first_bwd]
    assert "recompute" in phases[first_bwd:]
    assert phases.index("optimizer") > max(i for i, p in enumerate(phases) if p == "recompute")
    assert "other" in phases  # gradient clipping between backward and optimizer.step
    # the custom op and the modules are named
    gains = [e for e in events if e.op == "optrace.gain.default"]
    assert len(gains) == 1 and gains[0].phase == "forward" and gains[0].module == "(root)"
    assert {e.module for e in events if e.phase == "forward"} >= {"blocks.0.fc1", "blocks.1.drop", "head"}
    assert {e.module for e in events if e.phase == "recompute"} >= {"blocks.0.fc1", "blocks.1.drop"}
    # occurrences count per (phase, module, op)
    seen = {}
    for e in events:
        k = (e.phase, e.module, e.op)
        assert e.occurrence == seen.get(k, 0)
        seen[k] = e.occurrence + 1
    # outputs described; views and empty outputs not compared
    addmm = next(e for e in events if e.op == "aten.addmm.default")
    assert addmm.shapes == ((8, 32),) and addmm.dtypes == ("float32",) and addmm.numels == (256,)
    assert addmm.outputs[0] is not None and all(i is not None for i in addmm.inputs)
    views = [e for e in events if e.op in ("aten.view.default", "aten.t.default", "aten.detach.default")]
    assert views and all(o is None for e in views for o in e.outputs)
    assert all(o is None for e in events if e.op.startswith(("aten.empty", "aten.new_empty")) for o in e.outputs)


def test_op_window_steps_only(op_runs):
    assert _op_steps(op_runs / "a") == [2]
    with pytest.raises(CkptVerifyError, match="no op log of step 1"):
        read_ops(op_runs / "a", 0, 1)
    assert ops_dropped(op_runs / "a", 0, 2) == 0
    # the rows of every step are there as at level module
    t = open_trace(op_runs / "a" / "rank0")
    assert t.steps == (1, 2, 3) and t.has_site("module.blocks.0.fwd#0")


def test_identical_runs_have_identical_op_logs(op_runs):
    a, b = read_ops(op_runs / "a", 0, 2), read_ops(op_runs / "b", 0, 2)
    assert [e.key for e in a] == [e.key for e in b]
    for x, y in zip(a, b, strict=True):
        assert (x.inputs, x.outputs, x.shapes, x.chunks) == (y.inputs, y.outputs, y.shapes, y.chunks), x.key
    assert not [f for f in compare_traces(op_runs / "a", op_runs / "b") if f.severity.value == "error"]


def test_planted_op_difference_shows_from_that_op_on(op_runs):
    a, s = read_ops(op_runs / "a", 0, 2), read_ops(op_runs / "skew", 0, 2)
    assert [e.key for e in a] == [e.key for e in s]
    differing = [i for i, (x, y) in enumerate(zip(a, s, strict=True)) if x.outputs != y.outputs]
    first = differing[0]
    origin = s[first]
    assert origin.op == "optrace.gain.default"
    assert a[first].inputs == origin.inputs  # inputs equal, output differs: the op itself
    assert all(x.inputs == y.inputs and x.outputs == y.outputs for x, y in zip(a[:first], s[:first], strict=True))
    # the next op that reads its output already has a differing input
    after = next(i for i in range(first + 1, len(s)) if s[i].inputs != a[i].inputs)
    assert s[after].phase == "forward"


def test_order_sensitive_outputs_get_chunk_cells(tmp_path):
    from ckptverify.trace import TraceRecorder

    with TraceRecorder(tmp_path, header=TraceHeader(run="t", level="op"), chunk_elements=4) as rec:
        rec.record_step_start(None, step=1)
        x = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0, 0.0, 7.0, 6.0, 9.0, 8.0])
        torch.sort(x)
        rec.record_step(1)
        rec.record_step_start(None, step=2)
        y = x.clone()
        y[8], y[9] = y[9], y[8].clone()
        torch.sort(y)
        rec.record_step(2)
    one, two = (next(e for e in read_ops(tmp_path, 0, s) if e.op == "aten.sort.default") for s in (1, 2))
    assert one.chunk_elements == 4
    assert one.chunks[0] is None  # the values: not an order
    assert len(one.chunks[1]) == 3  # the indices, 10 elements in chunks of 4
    # the swap moved indices only in the last chunk
    assert one.chunks[1][:2] == two.chunks[1][:2] and one.chunks[1][2] != two.chunks[1][2]


def test_window_modules_and_cap(tmp_path):
    _run(tmp_path / "m", window={"steps": [1], "modules": ["blocks.1"]}, steps=1)
    events = read_ops(tmp_path / "m", 0, 1)
    assert events and all(e.module == "blocks.1" or e.module.startswith("blocks.1.") for e in events)
    assert {e.phase for e in events} >= {"forward", "recompute", "backward"}
    _run(tmp_path / "cap", window={"steps": [1], "max_ops": 10}, steps=1)
    assert len(read_ops(tmp_path / "cap", 0, 1)) == 10
    assert ops_dropped(tmp_path / "cap", 0, 1) > 100


def test_window_ranks_excludes_this_rank(tmp_path):
    _run(tmp_path / "r", window={"ranks": [1]}, steps=1)
    assert _op_steps(tmp_path / "r") == []


def test_capture_saves_the_inputs_of_one_op(tmp_path, op_runs):
    origin = next(e for e in read_ops(op_runs / "a", 0, 2) if e.op == "aten.addmm.default")
    path = tmp_path / "cap.pt"
    _run(tmp_path / "c", window={"steps": [2], "capture": list(origin.key), "capture_path": str(path)}, steps=2)
    saved = torch.load(path, weights_only=True)
    assert saved["op"] == "aten.addmm.default"
    bias, inp, weight = saved["args"]
    again = torch.ops.aten.addmm.default(bias, inp, weight)
    from ckptverify.trace.category import host_digest

    assert host_digest(again) == origin.outputs[0]
    assert [host_digest(t) for t in (bias, inp, weight)] == list(origin.inputs)


# ------------------------------------------------------------------------------------------------ recompute


def test_recompute_with_dropout_without_rng_state_is_a_finding(tmp_path):
    _run(tmp_path / "bad", level="module", env={"OPTRACE_PRESERVE_RNG": "0"}, steps=2)
    _run(tmp_path / "good", level="module", env={"OPTRACE_PRESERVE_RNG": "1"}, steps=2)
    _run(tmp_path / "none", level="module", env={"OPTRACE_CHECKPOINT": "0"}, steps=2)
    t = open_trace(tmp_path / "good" / "rank0")
    pairs = [s.name for s in t.sites if s.kind == "module_recompute"]
    assert "module.blocks.0.drop.recompute#0" in pairs and "module.blocks.1.fc1.recompute#0" in pairs
    assert all(t.hex(1, p) == t.hex(1, p.replace("recompute", "fwd")) for p in pairs)
    assert recompute_findings(tmp_path / "good") == []
    assert not any(s.kind == "module_recompute" for s in open_trace(tmp_path / "none" / "rank0").sites)
    found = recompute_findings(tmp_path / "bad")
    assert found and {f.check for f in found} == {"recompute-mismatch"}
    modules = {f.location.fqn for f in found}
    # the dropout draws another mask; what follows it in the block receives that
    assert "blocks.0.drop" in modules and "blocks.1.drop" in modules
    assert "blocks.0.fc1" not in modules  # before the dropout: recomputed equal
    assert all(f.location.rank == 0 and f.location.record == "step 1" for f in found)
    # trace diff of the run with itself shows it, with no second run
    assert any(f.check == "recompute-mismatch" for f in compare_traces(tmp_path / "bad", tmp_path / "bad"))


# ------------------------------------------------------------------------------------------------ bad input


def test_window_from_dict_refuses_bad_windows():
    assert window_from_dict({"steps": [1, 2], "max_ops": 5}) == OpWindow(steps=(1, 2), max_ops=5)
    for bad in ([1], {"steps": "1"}, {"max_ops": -1}, {"capture": [1, "forward", "", "aten.mm.default", 0]},
                {"capture": [1, "sideways", "", "x", 0], "capture_path": "x"}, {"step": [1]}):
        with pytest.raises(UsageError):
            window_from_dict(bad)
    with pytest.raises(UsageError):
        RunConfig(level="op", op_window={"steps": ["two"]})


def test_damaged_op_log_is_a_format_error(tmp_path, op_runs):
    import shutil

    shutil.copytree(op_runs / "a", tmp_path / "a")
    path = tmp_path / "a" / "rank0" / "ops" / "step2.json"
    data = json.loads(path.read_text())
    for damage in ("{", json.dumps({**data, "step": 3}),
                   json.dumps({**data, "events": [{**data["events"][0], "i": ["zz"]}]}),
                   json.dumps({**data, "events": [{**data["events"][0], "p": "elsewhere"}]})):
        path.write_text(damage)
        with pytest.raises(CkptVerifyError):
            read_ops(tmp_path / "a", 0, 2)


# ------------------------------------------------------------------------------------------------ device path

#: The three runs of the device-path test, one after another in one interpreter of their own (the variable that
#: sends host tensors down the device path is read at import): ``argv``: device, then (folder, skew) pairs.
_DEVICE_PATH_SCRIPT = r'''
import sys, torch
from ckptverify.trace import TraceHeader, TraceRecorder
from ckptverify.trace import readback
from pathlib import Path
device = sys.argv[1]
assert readback._HOST_AS_DEVICE or device != "cpu"
for folder, skew in zip(sys.argv[2::2], sys.argv[3::2], strict=True):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).to(device)
    skew = skew == "1"
    with TraceRecorder(folder, header=TraceHeader(run="d", level="op")) as rec:
        for step in (1, 2):
            rec.record_step_start(None, step=step)
            y = lin(torch.ones(2, 8, device=device) * step)
            if skew and step == 2:
                y = y * 1.0001
            torch.topk(y.flatten(), 5)
            rec.record_step(step, metrics={"loss": y.sum()})
            # the op log of a step waits for its digests: written when the next row is recorded, or at close
            logged = sorted(int(p.stem[4:]) for p in Path(folder, "rank0", "ops").glob("step*.json"))
            assert logged == list(range(1, step))
'''


def test_op_log_on_the_device_path(tmp_path, device="cpu"):
    """Accelerator tensors (on CPU: host ones sent the device way): fingerprints computed in the step, read back
    with the row, and the op log written when they arrive. ``tests/gpu/test_trace_ops_cuda.py`` runs it on CUDA."""
    import subprocess

    env = {**os.environ, "CKPTVERIFY_TRACE_HOST_AS_DEVICE": "1" if device == "cpu" else "0"}
    runs = ("p", "q", "s")
    # one interpreter for the three runs: each is its own recorder, model and seed, as in a process of its own
    args = [arg for name, skew in zip(runs, ("0", "0", "1"), strict=True) for arg in (str(tmp_path / name), skew)]
    subprocess.run([sys.executable, "-c", _DEVICE_PATH_SCRIPT, device, *args], check=True, env=env, timeout=300)
    p, q, s = (read_ops(tmp_path / name, 0, 2) for name in runs)
    assert [(e.key, e.inputs, e.outputs, e.chunks) for e in p] == [(e.key, e.inputs, e.outputs, e.chunks) for e in q]
    assert all(v is not None for e in p if e.op == "aten.addmm.default" for v in (*e.inputs, *e.outputs))
    topk = next(e for e in p if e.op == "aten.topk.default")
    assert topk.chunks[0] is None and len(topk.chunks[1]) == 1
    first = next(i for i, (x, y) in enumerate(zip(p, s, strict=True)) if x.outputs != y.outputs)
    assert s[first].op == "aten.mul.Tensor" and s[first].inputs[0] == p[first].inputs[0]
    one = read_ops(tmp_path / "p", 0, 1)  # step 1's, written when step 2 was recorded
    assert [(e.key, e.outputs) for e in one] == [(e.key, e.outputs) for e in read_ops(tmp_path / "s", 0, 1)]
    assert one[0].op == "aten.ones.default" and one[0].outputs[0] is not None


def test_resume_check_reports_a_recompute_mismatch_of_its_own_run(monkeypatch):
    from ckptverify.resume.harness import Plan, resume_check

    monkeypatch.setenv("OPTRACE_PRESERVE_RNG", "0")
    outcome = resume_check(Plan(target=f"{SCRIPT}:train", steps=2, resume_at=1, runs=("A",), level="module"))
    found = [f for f in outcome.report.findings if f.check == "recompute-mismatch"]
    assert found and all(f.message.startswith("[A recompute]") for f in found)
    assert {f.location.fqn for f in found} >= {"blocks.0.drop", "blocks.1.drop"}
    assert outcome.report.exit_code == 1


#: The NVTX test's run, in an interpreter of its own. In the suite's process, after the fingerprint kernel was
#: compiled for the tests' tiny block geometry (``small_blocks`` in ``test_save_fingerprint_beside_writes``:
#: blocks of 4 x 16, which no save compiles), the traced script's custom op failed inside torch's dispatcher
#: (``vector::reserve``, ``bad_alloc``, once a crash) in 5 of 30 runs; with that one test left out, in none of 20.
_NVTX_CHILD = """
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[3])
import test_trace_ops as t
from ckptverify.trace import kernel
pushed, depth = [], []
kernel.nvtx_enabled = lambda: True
torch.cuda.nvtx.range_push = lambda name: (pushed.append(name), depth.append(1))
torch.cuda.nvtx.range_pop = lambda: depth.pop()
t._run(Path(sys.argv[1]), window={"steps": [2], "modules": ["blocks.1"]}, steps=2)
Path(sys.argv[2]).write_text(json.dumps({"pushed": pushed, "open": len(depth)}))
"""


def test_each_op_of_the_window_runs_in_an_nvtx_range_named_for_its_site(tmp_path):
    import subprocess

    from ckptverify.trace import kernel

    out = tmp_path / "nvtx.json"
    done = subprocess.run([sys.executable, "-c", _NVTX_CHILD, str(tmp_path / "n"), str(out),
                           str(Path(__file__).parent)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    pushed = got["pushed"]
    events = read_ops(tmp_path / "n", 0, 2)
    names = {kernel.site_name(e.key) for e in events}
    assert events and names <= set(pushed) and not got["open"]  # every recorded op inside its range; all closed
    assert all(name.startswith("step2/") for name in pushed)  # nothing outside the window
