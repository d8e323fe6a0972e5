"""Training functions for the resume-equivalence harness: the correct built-in workload and planted bugs.

Each is ``train(run)`` in the five-line :class:`~ckptverify.resume.run.Run` protocol, on the tiny GPT
(:mod:`ckptverify.examples.tinygpt`), and runs on 1 or N ranks (FSDP2 over gloo on CPU, or on CUDA). The
planted bugs each break resumption in one way, with the verdict the harness must reach:

| workload | bug | verdict |
|---|---|---|
| ``correct`` | none | ``pass`` |
| ``rng_not_restored`` | re-seeds the global generator after loading, as some frameworks do | ``rng`` |
| ``data_not_restored`` | the data loader is left out of the TrainState | ``data`` |
| ``scheduler_not_saved`` | the LR scheduler is left out of the TrainState | ``scheduler`` |
| ``hidden_counter`` | a module-level counter drives the learning rate | ``scheduler`` (names ``lr``) |
| ``nondeterministic`` | gradients are accumulated in an order that changes between processes | ``nondeterministic`` |

Run one: ``ckptverify resume-check ckptverify.examples.workloads:correct --steps 8 --resume-at 4``.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from ckptverify.examples.tinygpt import (
    Block,
    TinyGPTConfig,
    Training,
    build_training,
    lm_loss,
    make_loader,
    optimizer_step,
    train_step,
)
from ckptverify.resume.run import Run
from ckptverify.state.train_state import TrainState

CONFIG = TinyGPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
BATCH = 4
EXPECTED_VERDICTS = {
    "correct": "pass",
    "rng_not_restored": "rng",
    "data_not_restored": "data",
    "scheduler_not_saved": "scheduler",
    "hidden_counter": "scheduler",
    "nondeterministic": "nondeterministic",
}


def _setup(run: Run, block_cls: type[Block] | None = None) -> tuple[Training, Any]:
    torch.set_num_threads(1)  # bitwise reproducibility on CPU needs a fixed thread count
    random.seed(run.rank)  # every random stream seeded, used or not
    np.random.seed(run.rank)
    mesh = None
    device = "cuda" if run.device == "cuda" and torch.cuda.is_available() else "cpu"
    if run.world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (run.world_size,))
    training = build_training(CONFIG, total_steps=40, num_sequences=512, mesh=mesh, device=device, seed=0,
                              block_cls=block_cls)
    loader = make_loader(training.dataset, BATCH, rank=run.rank, world_size=run.world_size, seed=1)
    return training, loader


def _state(training: Training, loader: Any = None) -> TrainState:
    """The TrainState of ``training``'s model, optimizer and scheduler (and ``loader``): what a correct job holds."""
    return TrainState(model=training.model, optimizer=training.optimizer, scheduler=training.scheduler,
                      dataloader=loader)


def _restored(run: Run, block_cls: type[Block] | None = None) -> tuple[Training, Any]:
    """:func:`_setup`, with the full state (:func:`_state`) registered and restored."""
    training, loader = _setup(run, block_cls)
    run.restore(_state(training, loader))
    return training, loader


def _manual_lr(training: Training) -> None:
    """Drop the built-in schedule: the loop sets lr itself."""
    training.optimizer = torch.optim.AdamW(training.model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    training.scheduler = None


def _loop(run: Run, training: Training, loader: Any, step: Any = train_step) -> None:
    for batch in run.steps(loader):
        out = step(training, batch)
        run.record(loss=out["loss"], batch=batch, lr=out["lr"], grad_norm=out["grad_norm"])


def correct(run: Run) -> None:
    """The built-in workload, with its full state registered: resumes bitwise."""
    _loop(run, *_restored(run))


def rng_not_restored(run: Run) -> None:
    training, loader = _restored(run)
    torch.manual_seed(1234 + run.rank)  # BUG: re-seeding after the restore throws the restored streams away
    _loop(run, training, loader)


def data_not_restored(run: Run) -> None:
    training, loader = _setup(run)
    state = TrainState(model=training.model, optimizer=training.optimizer, scheduler=training.scheduler)  # BUG
    run.restore(state)
    _loop(run, training, loader)


def scheduler_not_saved(run: Run) -> None:
    training, loader = _setup(run)
    state = TrainState(model=training.model, optimizer=training.optimizer, dataloader=loader)  # BUG: no scheduler
    run.restore(state)
    _loop(run, training, loader)


_LR_COUNTER = 0  # BUG: module-level state that drives the learning rate, saved nowhere


def hidden_counter(run: Run) -> None:
    training, loader = _setup(run)
    _manual_lr(training)  # no scheduler at all: the rate comes from a counter
    state = TrainState(model=training.model, optimizer=training.optimizer, dataloader=loader)
    run.restore(state)

    def step(training: Training, batch: Any) -> dict[str, Any]:
        global _LR_COUNTER
        for group in training.optimizer.param_groups:
            group["lr"] = 3e-3 * 0.8**_LR_COUNTER
        _LR_COUNTER += 1
        return train_step(training, batch)

    _loop(run, training, loader, step)


def nondeterministic(run: Run) -> None:
    training, loader = _restored(run)
    order = torch.Generator().manual_seed(os.getpid())  # BUG: the accumulation order depends on the process

    def step(training: Training, batch: Any) -> dict[str, Any]:
        # Gradients accumulated over micro-batches in a process-dependent order: the sums round differently,
        # so the parameters part between two processes (a loss summed in another order would not do: its
        # gradient is the same whatever the order).
        model = training.model
        model.train()
        input_ids, targets = (z.to(training.device) for z in batch)
        parts = list(zip(input_ids.chunk(input_ids.shape[0]), targets.chunk(targets.shape[0]), strict=True))
        total = torch.zeros((), device=training.device)
        for i in torch.randperm(len(parts), generator=order).tolist():
            loss = lm_loss(model, *parts[i]) / len(parts)
            loss.backward()
            total += loss.detach()
        return optimizer_step(training, total)

    _loop(run, training, loader, step)
