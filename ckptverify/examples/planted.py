"""Planted resume bugs of the kinds teams really ship, each with the verdict and the name the harness must give.

Every function is a ``train(run)`` in the :class:`~ckptverify.resume.run.Run` protocol on the tiny GPT, for 1 or
N ranks. Several draw their batches the way many single-file training scripts do: random offsets from the
global generator each step (no loader), so a random stream that moves changes the batch too, and only a
diagnosis that looks at the streams when the step starts can tell the cause from the consequence.

* ``reseed_after_restore``: ``torch.manual_seed`` right after ``run.restore`` -> ``rng``, ``rng.torch_cpu``;
* ``eval_after_save``: an evaluation drawing random batches, placed after the end-of-step save -> ``rng``,
  ``rng.torch_cpu``;
* ``counter_reset_lr``: a local iteration counter restarts at 0 on resume; it sets lr and triggers an
  evaluation -> ``scheduler``, ``lr``;
* ``hparam_reapplied``: ``weight_decay`` re-applied from the config after the restore ->
  ``changed-after-restore``, ``weight_decay``;
* ``ema_unregistered``: an EMA copy of the weights, not in the TrainState: no traced value reads it, but it ends
  the run different in A and B -> ``unregistered-state``, ``ema``;
* ``scaler_unregistered``: a GradScaler, not in the TrainState: its power-of-two scale leaves every traced value
  equal, but the scale itself ends different -> ``unregistered-state``, ``scaler``;
* ``missing_optimizer``: no optimizer in the TrainState -> ``unregistered-state``, ``training.optimizer``;
* ``nonpersistent_buffer``: a running statistic registered with ``persistent=False`` feeds the forward ->
  ``hidden-state``, ``buffer.blocks.0.act_rms``;
* ``parent_forward``: a block scales its input in its own ``forward`` by a process-global counter ->
  ``hidden-state``, origin ``blocks.0`` (feeding ``blocks.0.ln1``).

Run one: ``ckptverify resume-check ckptverify.examples.planted:eval_after_save --steps 5 --resume-at 2``.
"""

from __future__ import annotations

import torch
from torch import nn

from ckptverify.examples.tinygpt import Block, TinyGPTConfig, Training, lm_loss, train_step
from ckptverify.examples.workloads import BATCH, _loop, _manual_lr, _restored, _setup, _state
from ckptverify.resume.run import Run
from ckptverify.state.train_state import TrainState
from ckptverify.trace.sites import local_view

#: name -> (verdict kind, the site or variable the verdict or a warning must name).
EXPECTED: dict[str, tuple[str, str]] = {
    "reseed_after_restore": ("rng", "rng.torch_cpu"),
    "eval_after_save": ("rng", "rng.torch_cpu"),
    "counter_reset_lr": ("scheduler", "lr"),
    "hparam_reapplied": ("changed-after-restore", "weight_decay"),
    "ema_unregistered": ("unregistered-state", "ema"),
    "scaler_unregistered": ("unregistered-state", "scaler"),
    "missing_optimizer": ("unregistered-state", "training.optimizer"),
    "nonpersistent_buffer": ("hidden-state", "buffer.blocks.0.act_rms"),
    "parent_forward": ("hidden-state", "blocks.0"),
}

EVAL_EVERY = 2


# ------------------------------------------------------------------------------ random-offset batches


def get_batch(training: Training) -> tuple[torch.Tensor, torch.Tensor]:
    """``BATCH`` random sequences drawn from the global generator (each rank its own: seeded per rank)."""
    index = torch.randint(len(training.dataset), (BATCH,))
    pairs = [training.dataset[int(i)] for i in index]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


@torch.no_grad()
def evaluate(training: Training, batches: int = 2) -> float:
    """Mean loss on random batches: draws from the global generator, as an eval loop on random offsets does."""
    model = training.model
    model.eval()
    total = 0.0
    for _ in range(batches):
        x, y = get_batch(training)
        total += float(lm_loss(model, x.to(training.device), y.to(training.device)))
    model.train()
    return total / batches


# ------------------------------------------------------------------------------------------- §1 causes


def reseed_after_restore(run: Run) -> None:
    training, _ = _setup(run)
    run.restore(_state(training))
    torch.manual_seed(1234 + run.rank)  # BUG: throws the restored stream away; the next batch changes too
    for _ in run.steps():
        batch = get_batch(training)
        out = train_step(training, batch)
        run.record(loss=out["loss"], batch=batch, lr=out["lr"])


def eval_after_save(run: Run) -> None:
    training, _ = _setup(run)
    run.restore(_state(training))
    for _ in run.steps():
        batch = get_batch(training)
        out = train_step(training, batch)
        run.record(loss=out["loss"], batch=batch, lr=out["lr"])  # saves when the harness asks
        if run.step % EVAL_EVERY == 0:
            evaluate(training)  # BUG: after the save point, and it draws from the global generator


def counter_reset_lr(run: Run) -> None:
    training, _ = _setup(run)
    _manual_lr(training)
    state = TrainState(model=training.model, optimizer=training.optimizer)
    run.restore(state)
    iter_num = 0  # BUG: restarts at 0 on resume (should be run.step)
    for _ in run.steps():
        lr = 3e-3 * 0.7 ** iter_num
        for group in training.optimizer.param_groups:
            group["lr"] = lr
        if iter_num % 4 == 0:
            evaluate(training)  # the step-0 evaluation, re-triggered on resume: draws randomness
        batch = get_batch(training)
        out = train_step(training, batch)
        iter_num += 1  # noqa: SIM113 (a hand-kept counter is the bug)
        run.record(loss=out["loss"], batch=batch, lr=out["lr"])


def hparam_reapplied(run: Run) -> None:
    training, loader = _restored(run)
    configured_wd = 0.1
    for group in training.optimizer.param_groups[:1]:
        group["weight_decay"] = configured_wd  # BUG: re-applied from the config over the restored value
    for batch in run.steps(loader):
        if run.step == 1:
            training.optimizer.param_groups[0]["weight_decay"] = 0.05  # weight decay lowered after step 1
        out = train_step(training, batch)
        run.record(loss=out["loss"], batch=batch, lr=out["lr"])


# ------------------------------------------------------------------------------------ §2 forgotten state


class EMA(nn.Module):
    """An exponential moving average of a model's (local) parameters."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        super().__init__()
        self.decay = decay
        self.shadow = nn.ParameterList(
            nn.Parameter(local_view(p).detach().clone(), requires_grad=False) for p in model.parameters())

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for s, p in zip(self.shadow, model.parameters(), strict=True):
            s.lerp_(local_view(p), 1 - self.decay)


def ema_unregistered(run: Run) -> None:
    training, loader = _setup(run)
    ema = EMA(training.model)  # BUG: not in the TrainState; nothing traced reads it
    run.restore(_state(training, loader))
    for batch in run.steps(loader):
        out = train_step(training, batch)
        ema.update(training.model)
        run.record(loss=out["loss"], batch=batch, lr=out["lr"])


def scaler_unregistered(run: Run) -> None:
    training, loader = _setup(run)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)  # BUG: not in the TrainState
    run.restore(_state(training, loader))
    model, optimizer = training.model, training.optimizer
    for batch in run.steps(loader):
        loss = lm_loss(model, *batch)
        scaler.scale(loss).backward()  # a power-of-two scale: every value stays bitwise equal
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip)
        lr = float(optimizer.param_groups[0]["lr"])
        scaler.step(optimizer)
        scaler.update()
        training.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.record(loss=loss.detach(), batch=batch, lr=lr)


def missing_optimizer(run: Run) -> None:
    training, loader = _setup(run)
    state = TrainState(model=training.model, dataloader=loader)  # BUG: no optimizer (and no scheduler)
    run.restore(state)
    _loop(run, training, loader)


class RunningRMSBlock(Block):
    """A block that normalises its input by a running RMS kept in a non-persistent buffer."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__(config)
        self.register_buffer("act_rms", torch.ones(()), persistent=False)  # BUG: no checkpoint holds it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.act_rms.mul_(0.5).add_(0.5 * x.detach().pow(2).mean().sqrt())
        return super().forward(x / self.act_rms)


_CALLS = 0  # BUG: process-global state used in a block's own forward


class CountingBlock(Block):
    """A block that scales its input in its own ``forward`` (before its first child) by a global call count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global _CALLS
        _CALLS += 1
        x = x * (1.0 + 0.01 * (_CALLS % 5))
        return super().forward(x)


def nonpersistent_buffer(run: Run) -> None:
    _loop(run, *_restored(run, RunningRMSBlock))


def parent_forward(run: Run) -> None:
    _loop(run, *_restored(run, CountingBlock))

