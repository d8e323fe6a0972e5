"""A classifier trained with an EMA of its weights, the way training scripts keep one.

Entry points (each a ``train(run)``), one per way of keeping the EMA:

* ``train_averaged``: ``torch.optim.swa_utils.AveragedModel``, not in the TrainState;
* ``train_dict``: a dict of tensors cloned from the state dict, updated in place every step, not in the TrainState;
* ``train_dict_rebound``: the same dict rebuilt (a new dict, new tensors) every step;
* ``train_registered``: the ``AveragedModel`` registered with ``TrainState(extras=...)``;
* ``train_scheduler_unsaved``: the dict EMA, and the OneCycleLR scheduler left out of the TrainState;
* ``train_nonpersistent``: the dict EMA, and a running statistic in a non-persistent buffer that feeds the forward.

The dataset lives in ``ema_data.py`` beside this script (DataLoader workers import it). Runs on one rank, or on
several with DDP (the process group exists: ``torchrun`` or the harness).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ema_data import CLASSES, FEATURES, SAMPLES, NoisyBlobs
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader

import ckptverify as cv
from ckptverify.state.sampler import ResumableSampler

BATCH = 8
EMA_DECAY = 0.9
TOTAL_STEPS = 40


class Net(nn.Module):
    def __init__(self, running_norm: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, CLASSES))
        self.running_norm = running_norm
        if running_norm:
            self.register_buffer("input_rms", torch.ones(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.running_norm:
            if self.training:
                with torch.no_grad():
                    self.input_rms.mul_(0.9).add_(0.1 * x.pow(2).mean().sqrt())
            x = x / self.input_rms
        return self.net(x)


def setup(run: cv.Run, running_norm: bool = False):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Net(running_norm)
    model = DDP(net) if run.world_size > 1 else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-2, total_steps=TOTAL_STEPS)
    sampler = ResumableSampler(SAMPLES, num_replicas=run.world_size, rank=run.rank, seed=1, drop_last=True)
    loader = DataLoader(NoisyBlobs(), batch_size=BATCH, sampler=sampler, num_workers=2, drop_last=True)
    return net, model, optimizer, scheduler, loader


def step(model, optimizer, scheduler, batch) -> torch.Tensor:
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train_averaged(run: cv.Run) -> None:
    net, model, optimizer, scheduler, loader = setup(run)
    ema_model = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))
    state = cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader)
    run.restore(state)
    for batch in run.steps(loader):
        loss = step(model, optimizer, scheduler, batch)
        ema_model.update_parameters(net)
        run.record(loss=loss, batch=batch)


def train_registered(run: cv.Run) -> None:
    net, model, optimizer, scheduler, loader = setup(run)
    ema_model = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))
    state = cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader,
                          extras={"ema": ema_model})
    run.restore(state)
    for batch in run.steps(loader):
        loss = step(model, optimizer, scheduler, batch)
        ema_model.update_parameters(net)
        run.record(loss=loss, batch=batch)


@torch.no_grad()
def update_ema(ema: dict[str, torch.Tensor], net: nn.Module) -> None:
    for k, v in net.state_dict().items():
        if v.dtype.is_floating_point:
            ema[k].mul_(EMA_DECAY).add_(v, alpha=1 - EMA_DECAY)


def train_dict(run: cv.Run) -> None:
    net, model, optimizer, scheduler, loader = setup(run)
    ema = {k: v.detach().clone() for k, v in net.state_dict().items()}
    state = cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader)
    run.restore(state)
    for batch in run.steps(loader):
        loss = step(model, optimizer, scheduler, batch)
        update_ema(ema, net)
        run.record(loss=loss, batch=batch)


def train_dict_rebound(run: cv.Run) -> None:
    net, model, optimizer, scheduler, loader = setup(run)
    ema = {k: v.detach().clone() for k, v in net.state_dict().items()}
    state = cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader)
    run.restore(state)
    for batch in run.steps(loader):
        loss = step(model, optimizer, scheduler, batch)
        with torch.no_grad():
            ema = {k: EMA_DECAY * ema[k] + (1 - EMA_DECAY) * v.detach() for k, v in net.state_dict().items()}
        run.record(loss=loss, batch=batch)


def train_scheduler_unsaved(run: cv.Run) -> None:
    net, model, optimizer, scheduler, loader = setup(run)
    ema = {k: v.detach().clone() for k, v in net.state_dict().items()}
    state = cv.TrainState(model=model, optimizer=optimizer, dataloader=loader)  # the scheduler is missing
    run.restore(state)
    for batch in run.steps(loader):
        loss = step(model, optimizer, scheduler, batch)
        update_ema(ema, net)
        run.record(loss=loss, batch=batch)


def train_nonpersistent(run: cv.Run) -> None:
    net, model, optimizer, scheduler, loader = setup(run, running_norm=True)
    ema = {k: v.detach().clone() for k, v in net.state_dict().items()}
    state = cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader)
    run.restore(state)
    for batch in run.steps(loader):
        loss = step(model, optimizer, scheduler, batch)
        update_ema(ema, net)
        run.record(loss=loss, batch=batch)
