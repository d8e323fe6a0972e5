"""Worker for the TrainState tests: train, save, and record what must come next; or load in a fresh process
and record what comes next. Run as a module function under torch.multiprocessing (1 or 2 ranks, gloo)."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ckptverify
from ckptverify.examples import TinyGPTConfig, build_training, make_loader, train_step

CONFIG = TinyGPTConfig(d_model=32, n_layers=1, n_heads=2, seq_len=16)
BATCH = 4


def _build(world: int, loader_kind: str, workers: int, allow_reseed: bool = False) -> tuple[Any, Any, Any]:
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    training = build_training(CONFIG, total_steps=50, num_sequences=256, mesh=mesh, seed=3)
    rank = dist.get_rank() if world > 1 else 0
    gen = torch.Generator().manual_seed(100 + rank)
    if loader_kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = make_loader(training.dataset, BATCH, rank=rank, world_size=world, seed=5,
                             loader_cls=StatefulDataLoader, num_workers=workers)
    else:
        loader = make_loader(training.dataset, BATCH, rank=rank, world_size=world, seed=5, num_workers=workers)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    state = ckptverify.TrainState(model=training.model, optimizer=training.optimizer, scheduler=training.scheduler,
                                  scaler=scaler, dataloader=loader, generators={"aux": gen},
                                  allow_reseed=allow_reseed)
    return training, state, gen


def _batches(state: Any, loader_kind: str) -> Any:
    if loader_kind == "stateful":
        return iter(state.dataloader)
    return iter(state.dataloader.sampler.track(state.dataloader))


def _next_things(training: Any, state: Any, gen: torch.Generator, batches: Any) -> dict[str, Any]:
    """What an uninterrupted run sees next: state digests, tensor fingerprints, RNG draws, batches.

    ``batches`` is an iterator already created (creating one draws a base seed from the global generator).
    """
    from ckptverify.dcp.loading import flat_names
    from ckptverify.fingerprint import tensor_fingerprint

    model_sd, optim_sd = state.model_optim_state()
    flat = flat_names({"model": model_sd, "optim": optim_sd})
    out: dict[str, Any] = {"digests": state.digests(),
                           "tensors": {k: tensor_fingerprint(v).value for k, v in sorted(flat.items())
                                       if isinstance(v, torch.Tensor)}}
    out["draws"] = {
        "python": [random.random() for _ in range(3)],
        "numpy": np.random.rand(3).tolist(),
        "torch": torch.rand(3),
        "aux": torch.rand(3, generator=gen),
        "dropout": torch.nn.functional.dropout(torch.ones(64), 0.5, training=True),
    }
    out["batches"] = [next(batches) for _ in range(3)]
    return out


def run(rank: int, world: int, mode: str, ckpt: str, out_dir: str, steps: int, loader_kind: str, workers: int,
        allow_reseed: bool = False) -> None:
    """One rank: with ``world`` > 1 under ``helpers.multiproc.spawn_ranks`` (which holds the group), with
    ``world`` == 1 in a plain fresh process."""
    torch.set_num_threads(1)
    training, state, gen = _build(world, loader_kind, workers, allow_reseed)
    result: dict[str, Any] = {}
    if mode == "save":
        batches = _batches(state, loader_kind)
        for _ in range(steps):
            train_step(training, next(batches))
            state.scaler.scale(torch.ones(()))  # make the scaler's state non-trivial
            state.scaler.update(state.scaler.get_scale() * 2)
            state.counters.step += 1
            state.counters.samples_seen += BATCH * world
        ckptverify.save(state, ckpt)
        result = _next_things(training, state, gen, batches)
    else:
        try:
            report = ckptverify.load(state, ckpt)
        except Exception as exc:  # reported to the test process
            result = {"error": type(exc).__name__, "message": str(exc)}
        else:
            batches = _batches(state, loader_kind)
            state.reapply_rng()  # the iterator drew a base seed; the uninterrupted run drew it before saving
            result = {"report": report.to_dict(), **_next_things(training, state, gen, batches)}
    torch.save(result, os.path.join(out_dir, f"{mode}-rank{rank}.pt"))
