"""Train a small CNN on augmented images: DataLoader workers, AdamW, OneCycleLR, gradient clipping, dropout, an EMA,
DDP on several ranks. `train` is the job as it should be; the other functions are the same job with one mistake."""

import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from data_noisy_images import NoisyImages, PerWorkerRngImages, UrandomNoisyImages, start_worker_rng
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader

import ckptverify as cv
from ckptverify.state.sampler import ResumableSampler

BATCH = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc(self.drop(x.flatten(1)))


def build(run, dataset_cls=NoisyImages, worker_init_fn=None, n=24, generator=None):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    dataset = dataset_cls(n=n)
    sampler = ResumableSampler(len(dataset), num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2, drop_last=True,
                        worker_init_fn=worker_init_fn, generator=generator)
    net = Net()
    model = DDP(net) if run.world_size > 1 else net
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=40)
    return model, ema, optimizer, scheduler, loader


def loop(run, model, ema, optimizer, scheduler, loader):
    model.train()
    for images, labels in run.steps(loader):
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update_parameters(model.module if isinstance(model, DDP) else model)
        run.record(loss=loss.detach(), batch=(images, labels), grad_norm=grad_norm)


def train(run):
    model, ema, optimizer, scheduler, loader = build(run)
    state = cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader,
                          extras={"ema": ema})
    run.restore(state)
    loop(run, model, ema, optimizer, scheduler, loader)


def train_unregistered_loader(run):
    model, ema, optimizer, scheduler, loader = build(run)
    state = cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, extras={"ema": ema})  # no loader
    run.restore(state)
    loop(run, model, ema, optimizer, scheduler, loader)


def train_urandom_noise(run):
    model, ema, optimizer, scheduler, loader = build(run, UrandomNoisyImages)
    state = cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader,
                          extras={"ema": ema})
    run.restore(state)
    loop(run, model, ema, optimizer, scheduler, loader)


def train_per_worker_rng(run):
    model, ema, optimizer, scheduler, loader = build(run, PerWorkerRngImages, worker_init_fn=start_worker_rng)
    state = cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader,
                          extras={"ema": ema})
    run.restore(state)
    loop(run, model, ema, optimizer, scheduler, loader)


def train_reseeded(run):
    model, ema, optimizer, scheduler, loader = build(run)
    state = cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader,
                          extras={"ema": ema})
    run.restore(state)
    torch.manual_seed(1234)  # seeds again after the restore
    loop(run, model, ema, optimizer, scheduler, loader)


def train_unsaved_scheduler(run):
    model, ema, optimizer, scheduler, loader = build(run)
    state = cv.TrainState(model=model, optimizer=optimizer, dataloader=loader, extras={"ema": ema})  # no scheduler
    run.restore(state)
    loop(run, model, ema, optimizer, scheduler, loader)


def train_fetch_ahead(run):
    """Overlaps loading with compute: the next batch is taken from the loader before the step ends."""
    model, ema, optimizer, scheduler, loader = build(run, n=48, generator=torch.Generator().manual_seed(1))
    state = cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader,
                          extras={"ema": ema})
    run.restore(state)
    batches = iter(loader.sampler.track(loader))
    batch = next(batches)
    model.train()
    for _ in run.steps():
        images, labels = batch
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update_parameters(model.module if isinstance(model, DDP) else model)
        batch = next(batches, None)  # the next step's batch, fetched while this one finishes
        run.record(loss=loss.detach(), batch=(images, labels), grad_norm=grad_norm)


if __name__ == "__main__":
    cv.Run.main(train, steps=20)
