"""Level ``comm`` takes a c10d collective's output when its work completes, on two gloo ranks: the tracer keeps
no reference to it (FSDP2's all-gathered parameters must be freed when FSDP2 frees them), and what the caller
does to it afterwards (FSDP2's in-place division) is not in its fingerprint."""

from __future__ import annotations

import json
import os

from helpers.multiproc import spawn_ranks

from ckptverify.trace import open_trace


def _rank(rank: int, world: int, trace_dir: str) -> None:
    import time
    import weakref

    import torch
    import torch.distributed as dist

    from ckptverify.trace import TraceHeader, TraceRecorder
    from ckptverify.trace.cells import _tensor_cell

    expected: dict[str, list[int]] = {}
    refs: dict[str, weakref.ref] = {}

    def taken(site: str, t: torch.Tensor) -> None:
        expected[site] = list(_tensor_cell(site, "comm_out", t.clone()).lanes)

    def sync_then_divided() -> None:
        t = torch.arange(8, dtype=torch.float32) + rank
        dist.all_reduce(t)
        taken("comm.g0-1.allreduce_#0.out", t)
        t.div_(2)  # what FSDP2 does to its reduce-scatter output once the collective returned
        refs["sync all_reduce"] = weakref.ref(t)

    def async_then_scaled() -> None:
        t = torch.ones(6) * (rank + 1)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        taken("comm.g0-1.allreduce_#1.out", t)
        t.mul_(3)
        refs["async all_reduce"] = weakref.ref(t)

    def gathered_then_freed() -> None:
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, torch.full((4,), float(rank + 1)))
        taken("comm.g0-1._allgather_base_#0.out", out)
        out.zero_()
        refs["all_gather"] = weakref.ref(out)

    with TraceRecorder(trace_dir, header=TraceHeader(run="c", level="comm")) as rec:
        for step in (1, 2):
            rec.record_step_start(None, step=step)
            sync_then_divided()
            async_then_scaled()
            gathered_then_freed()
            # The work that completed them lets go of them on gloo's thread, just after wait() returns: give it
            # time. The tracer, which used to hold them to the end of the step, must not.
            deadline = time.monotonic() + 60
            while any(r() is not None for r in refs.values()) and time.monotonic() < deadline:
                time.sleep(0.01)
            alive = sorted(name for name, r in refs.items() if r() is not None)
            rec.record_step(step)
            with open(os.path.join(trace_dir, f"rank{rank}-step{step}.json"), "w") as f:
                json.dump({"alive": alive, "expected": expected}, f)


def test_collective_outputs_are_fingerprinted_at_completion_and_not_kept(tmp_path):
    spawn_ranks(_rank, 2, str(tmp_path))
    for rank in (0, 1):
        trace = open_trace(tmp_path / f"rank{rank}")
        for step in (1, 2):
            seen = json.loads((tmp_path / f"rank{rank}-step{step}.json").read_text())
            assert seen["alive"] == [], f"rank {rank} step {step}: still referenced before the row: {seen['alive']}"
            assert len(seen["expected"]) == 3
            for site, lanes in seen["expected"].items():
                # the value the collective produced, not the one the caller made of it afterwards
                assert list(trace.lanes(step, site)) == lanes, (rank, step, site)
    # the reduced values agree across ranks, the gathered one too
    a, b = (open_trace(tmp_path / f"rank{r}") for r in (0, 1))
    for site in ("comm.g0-1.allreduce_#0.out", "comm.g0-1.allreduce_#1.out", "comm.g0-1._allgather_base_#0.out"):
        assert a.hex(1, site) == b.hex(1, site)
