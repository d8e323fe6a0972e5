"""Worker for the hardware tests: a small data-parallel job (DDP, or HSDP through FSDP2 on a 2x1 mesh) that
checks its replicas every step, optionally with one planted bit flip. Run under
``helpers.multiproc.spawn_ranks``, gloo."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from ckptverify.errors import ReplicaMismatchError
from ckptverify.hardware.inject import BitFlip, FaultInjector
from ckptverify.hardware.replica import ReplicaCheck
from ckptverify.ownfiles.events import EventLog


def _model(wrap: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if wrap in ("ddp", "ddp-traced"):
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrap == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if wrap == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    raise ValueError(wrap)


def run(rank: int, world: int, out_dir: str, wrap: str, fault: str | None, on_replica_mismatch: str,
        steps: int) -> None:
    result: dict[str, Any] = {"mismatch_steps": [], "compared": [], "reused": [], "error": None, "fired": False}
    model = _model(wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = 0
    injector = None
    if fault:
        injector = FaultInjector(BitFlip.from_json(fault), model=model, optimizer=opt, rank=rank,
                                 step_in_progress=lambda: step + 1)
    check = ReplicaCheck(model, optimizer=opt, on_replica_mismatch=on_replica_mismatch,
                         events=EventLog(out_dir, rank=rank))
    result["tensors"] = check.tensors
    recorder = None
    if wrap == "ddp-traced":  # a state-level trace: the check reuses the parameter digests of each row
        from ckptverify.state.train_state import TrainState
        from ckptverify.trace import TraceHeader, TraceRecorder

        state = TrainState(model=model, optimizer=opt)
        recorder = TraceRecorder(os.path.join(out_dir, "trace"), header=TraceHeader(run="t", level="state"))
        recorder.attach(model, optimizer=opt)
        check.digest_source = recorder
    gen = torch.Generator().manual_seed(1 + rank)  # each replica its own data, as in data parallelism
    try:
        for _ in range(steps):
            x = torch.randn(4, 8, generator=gen)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if recorder is not None:
                recorder.record_step(step, metrics={"loss": loss}, state=state)
            found = check.check(step)
            result["compared"].append(check.compared)
            result["reused"].append(check.reused)
            result["mismatch_steps"] += [(m.step, list(m.tensors), [s["ranks"] for s in m.sides]) for m in found]
    except ReplicaMismatchError as exc:
        result["error"] = {"type": "ReplicaMismatchError", "step": exc.mismatch.step}
    result["fired"] = bool(injector and injector.fired)
    if recorder is not None:
        recorder.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
