"""Levels ``comm`` and ``op`` on two gloo ranks: DDP's bucket all-reduce and point-to-point ops as trace sites and
op log records, equal on both ranks and between identical runs."""

from __future__ import annotations

import json
import os

import pytest
from helpers.multiproc import spawn_ranks

from ckptverify.trace import compare_traces, open_trace
from ckptverify.trace.oplog import read_ops

STEPS = 2


def _ddp_rank(rank: int, world: int, trace_dir: str, level: str, window: dict | None, env: dict) -> None:
    import test_trace_ops as single

    from ckptverify.resume.run import Run, RunConfig

    os.environ.update(env)
    run = Run(RunConfig(name=os.path.basename(trace_dir), stop_step=STEPS, trace_dir=trace_dir, level=level,
                        op_window=window))
    try:
        single._script().train(run)
    finally:
        run.close()


def _p2p_rank(rank: int, world: int, trace_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from ckptverify.trace import TraceHeader, TraceRecorder

    with TraceRecorder(trace_dir, header=TraceHeader(run="p2p", level="op")) as rec:
        rec.record_step_start(None, step=1)
        t = torch.arange(6, dtype=torch.float32) * (rank + 1)
        if rank == 0:
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        from torch.distributed import _functional_collectives as fc

        u = fc.all_reduce(torch.full((4,), float(rank)), "sum", dist.group.WORLD)
        u = u + 1  # waits on it
        rec.record_step(1)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    window = {"steps": [2]}
    spawn_ranks(_ddp_rank, 2, str(root / "a"), "op", window, {})
    spawn_ranks(_ddp_rank, 2, str(root / "b"), "op", window, {})
    spawn_ranks(_ddp_rank, 2, str(root / "comm"), "comm", None, {})
    spawn_ranks(_ddp_rank, 2, str(root / "skew1"), "comm", None, {"OPTRACE_SKEW": "1"})
    return root


def test_ddp_bucket_allreduce_is_recorded_on_both_ranks(ddp_runs):
    for run in ("a", "comm"):
        stores = [open_trace(ddp_runs / run / f"rank{r}") for r in (0, 1)]
        names = [[s.name for s in t.sites if s.category == "comm"] for t in stores]
        assert names[0] == names[1] and "comm.g0-1.allreduce_#0.in" in names[0]
        assert "comm.g0-1.allreduce_#0.out" in names[0]
        site = stores[0].site("comm.g0-1.allreduce_#0.in")
        info = json.loads(site.info)
        assert info["collective"] == "allreduce_" and info["group"] == [0, 1] and info["peer"] is None
        assert info["reduce_op"] == "sum" and info["sizes"][0] > 0
        # identical ranks of an identical model: after the reduction the buckets agree across ranks
        for step in (1, 2):
            out = [t.hex(step, "comm.g0-1.allreduce_#0.out") for t in stores]
            assert out[0] == out[1]
            # ... and before it they do not (each rank reduces its own batch's gradients)
            before = [t.hex(step, "comm.g0-1.allreduce_#0.in") for t in stores]
            assert before[0] != before[1]
    # the comm sites come in execution order: the bucket is reduced during backward (after the forward's sites,
    # among the module gradients' ones), before the gradients the optimizer reads
    t = open_trace(ddp_runs / "a" / "rank0")
    order = [s.name for s in t.sites]
    at = order.index("comm.g0-1.allreduce_#0.in")
    assert order.index("module.head.fwd#0") < at < order.index("comm.g0-1.allreduce_#0.out")
    assert at > order.index("module.head.bwd#0")
    assert at < min(i for i, name in enumerate(order) if name.startswith("grad"))


def test_collective_records_carry_group_seq_on_both_ranks(ddp_runs):
    logs = [read_ops(ddp_runs / "a", r, 2) for r in (0, 1)]
    comms = [[e for e in log if e.comm is not None] for log in logs]
    assert comms[0] and len(comms[0]) == len(comms[1])
    for x, y in zip(*comms, strict=True):
        assert x.comm == y.comm and x.key == y.key
        assert x.comm.group == (0, 1) and x.comm.peer is None
        assert x.outputs == y.outputs and x.outputs[0] is not None  # taken at completion
    buckets = [e for e in comms[0] if e.comm.collective == "allreduce_"]
    assert buckets and all(e.phase == "backward" and e.comm.reduce_op == "sum" for e in buckets)
    # what else DDP issues (its forward-time broadcast) is there too, with no reduce op
    assert all(e.comm.reduce_op is None for e in comms[0] if e.comm.collective == "broadcast_")
    # seq counts every collective on the group since the recorder started: step 2's continue step 1's
    assert comms[0][0].comm.seq >= 1
    assert [e.comm.seq for e in comms[0]] == list(range(comms[0][0].comm.seq, comms[0][0].comm.seq + len(comms[0])))


def test_identical_ddp_runs_agree_and_a_skewed_rank_shows_in_its_collective(ddp_runs):
    errors = [f for f in compare_traces(ddp_runs / "a", ddp_runs / "b") if f.severity.value == "error"]
    assert errors == []
    for r in (0, 1):
        a, b = read_ops(ddp_runs / "a", r, 2), read_ops(ddp_runs / "b", r, 2)
        assert [(e.key, e.inputs, e.outputs) for e in a] == [(e.key, e.inputs, e.outputs) for e in b]
    # rank 1's custom op computes differently: its bucket input differs, rank 0's does not; both outputs differ
    base = [open_trace(ddp_runs / "comm" / f"rank{r}") for r in (0, 1)]
    skew = [open_trace(ddp_runs / "skew1" / f"rank{r}") for r in (0, 1)]
    site_in, site_out = "comm.g0-1.allreduce_#0.in", "comm.g0-1.allreduce_#0.out"
    assert base[0].hex(1, site_in) == skew[0].hex(1, site_in)
    assert base[1].hex(1, site_in) != skew[1].hex(1, site_in)
    assert base[0].hex(1, site_out) != skew[0].hex(1, site_out)


def test_send_recv_name_their_peer(tmp_path):
    spawn_ranks(_p2p_rank, 2, str(tmp_path))
    logs = [read_ops(tmp_path, r, 1) for r in (0, 1)]
    send = next(e for e in logs[0] if e.comm is not None and e.comm.collective == "send")
    recv = next(e for e in logs[1] if e.comm is not None and e.comm.collective == "recv_")
    assert send.comm.peer == 1 and recv.comm.peer == 0
    assert send.comm.group == recv.comm.group == (0, 1) and send.comm.seq == recv.comm.seq == 0
    assert recv.inputs == (None,)  # the receive buffer before the data arrived: not compared
    assert recv.outputs == send.inputs  # what arrived is what was sent
    red = [next(e for e in log if e.comm is not None and e.comm.collective == "allreduce_") for log in logs]
    assert red[0].comm == red[1].comm and red[0].comm.reduce_op == "max" and red[0].comm.seq == 1
    assert red[0].outputs == red[1].outputs
    # a functional collective: its group from its name, its output at its wait
    fun = [next(e for e in log if e.comm is not None and e.comm.collective == "all_reduce") for log in logs]
    assert fun[0].comm == fun[1].comm and fun[0].comm.reduce_op == "sum" and fun[0].comm.seq == 2
    assert fun[0].comm.group == (0, 1) and fun[0].inputs != fun[1].inputs
    assert fun[0].outputs == fun[1].outputs and fun[0].outputs[0] is not None
    # what reads the result before its wait reads a buffer in flight: not compared
    wraps = [e for e in logs[0] if e.index > fun[0].index and e.inputs and e.op.startswith("_c10d_functional.")]
    assert wraps and all(e.inputs == (None,) for e in wraps)
    # the op that reads its result (through the AsyncCollectiveTensor torch wraps it in) sees the reduced value
    adds = [[e for e in log if e.op == "aten.add.Tensor"][-1] for log in logs]
    assert adds[0].inputs[0] == adds[1].inputs[0] == fun[0].outputs[0]
    t = open_trace(tmp_path / "rank0")
    assert t.hex(1, "comm.g0-1.all_reduce#0.out") == open_trace(tmp_path / "rank1").hex(1, "comm.g0-1.all_reduce#0.out")
    assert t.has_site("comm.g0-1.send#0.in") and not t.has_site("comm.g0-1.send#0.out")
    t1 = open_trace(tmp_path / "rank1")
    assert t1.has_site("comm.g0-1.recv_#0.out") and not t1.has_site("comm.g0-1.recv_#0.in")
    assert t1.hex(1, "comm.g0-1.recv_#0.out") == t.hex(1, "comm.g0-1.send#0.in")


def _kernels_rank(rank: int, world: int, trace_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from ckptverify.trace import TraceHeader, TraceRecorder

    def registered() -> bool:
        return torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "AutogradCPU")

    assert not registered()
    with TraceRecorder(trace_dir, header=TraceHeader(run="k", level="comm")) as rec:
        for step in (1, 2):
            rec.record_step_start(None, step=step)
            t = torch.full((3,), float(step))
            dist.all_reduce(t)
            rec.record_step(step)
            assert registered()
        dist.all_reduce(torch.ones(2))  # between steps: not recorded
    assert not registered()  # given back with the recorder
    dist.all_reduce(torch.ones(2))


def test_comm_level_kernels_are_given_back_and_record_only_steps(tmp_path):
    spawn_ranks(_kernels_rank, 1, str(tmp_path))
    t = open_trace(tmp_path / "rank0")
    assert [s.name for s in t.sites if s.category == "comm"] == ["comm.g0-0.allreduce_#0.in",
                                                                  "comm.g0-0.allreduce_#0.out"]
    assert t.hex(1, "comm.g0-0.allreduce_#0.in") != t.hex(2, "comm.g0-0.allreduce_#0.in")
    assert t.header.level == "comm"
