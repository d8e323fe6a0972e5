"""The replica check one traced step late (what production mode runs): at each traced step it compares the step
before, whose digests the trace has read back by then, so it never waits for the device; it still names a
flipped bit at the step it happened. Two gloo ranks, on the host path and on the accelerator path run on the
host (``CKPTVERIFY_TRACE_HOST_AS_DEVICE=1``, read at import by the spawned ranks)."""

from __future__ import annotations

import json

import pytest
from helpers.multiproc import spawn_ranks


def _rank(rank: int, world: int, out_dir: str, flip_at: int) -> None:
    import torch
    from torch import nn

    import ckptverify.trace.hostread as H
    from ckptverify import TrainState
    from ckptverify.hardware.replica import ReplicaCheck
    from ckptverify.trace import TraceHeader, TraceRecorder

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=opt)
    check = ReplicaCheck(model)
    to_host, reads = H.to_host, [0]

    def counted(t):
        reads[0] += 1
        return to_host(t)

    found: dict[int, list] = {}
    late_reads: list[int] = []
    with TraceRecorder(f"{out_dir}/trace", header=TraceHeader(run="r", level="state")) as rec:
        rec.attach(model, optimizer=opt)
        check.digest_source = rec
        for step in range(1, 5):
            rec.record_step_start(state)
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            if step == flip_at and rank == 1:
                with torch.no_grad():
                    model[2].weight.view(-1)[3:4].view(torch.int32).bitwise_xor_(1 << 12)
            rec.record_step(step, state=state)
            H.to_host = counted
            before = reads[0]
            found[step] = [(m.step, list(m.tensors)) for m in check.check_late(step)]
            late_reads.append(reads[0] - before)
            H.to_host = to_host
        flushed = [(m.step, list(m.tensors)) for m in check.flush_late()]
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"found": found, "flushed": flushed, "late_reads": late_reads, "reused": check.reused}, f)


@pytest.mark.slow
@pytest.mark.parametrize("host_as_device", ["0", "1"])
def test_the_late_replica_check_names_a_flipped_bit_at_its_step_without_reading_back(tmp_path, monkeypatch,
                                                                                      host_as_device):
    monkeypatch.setenv("CKPTVERIFY_TRACE_HOST_AS_DEVICE", host_as_device)
    spawn_ranks(_rank, 2, str(tmp_path), 2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # step 1 has nothing before it; step 2 compares step 1 (equal); step 3 compares step 2 (the flip);
        # step 4 compares step 3 (still flipped); flushing compares step 4
        # (from step 3 on, what the flipped weight fed differs too)
        found = got["found"]
        assert found["1"] == found["2"] == [] and found["3"] == [[2, ["2.weight"]]], got
        assert [m[0] for m in found["4"]] == [3] and "2.weight" in found["4"][0][1]
        assert [m[0] for m in got["flushed"]] == [4]
        # the digests compared are the trace's (no parameter read again), already on the host: no read-back
        assert got["late_reads"] == [0, 0, 0, 0] and got["reused"] == 4
