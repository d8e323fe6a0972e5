"""Train a small classifier on noisy synthetic points: its own Dataset (augmented in the DataLoader workers),
dropout, AdamW, a OneCycleLR schedule, gradient clipping, DDP when run on several ranks, and an activation kernel
of its own registered with ``torch.library``.

The functions started (each a whole training job, Run protocol):

    train            dropout 0.1
    train_drop2      dropout 0.2 (the same code; one number changed)
    train_flaky      the activation kernel is flaky on rank 1: it adds noise from the OS on some of its calls only

The flaky kernel (``FLAKY_COUNTER`` names a file; unset: never flaky) counts the processes that use it flaky: the
n-th such process (n from 0) adds noise on its first call when n is even, on its second call when n is odd, and
never on another call. One call per training step: the even processes differ from every other run at step 1, the
odd ones at step 2 only.

    python walk_evidence_train.py --func train_drop2 --run-dir runs/a
"""

import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import ckptverify as cv
from ckptverify.state.sampler import ResumableSampler

BATCH = 8
_calls = 0
_process = None  # this process's number among the flaky ones (taken at its first flaky call)


def _process_number():
    """How many flaky processes took a number before this one (a byte appended to the counter file per process;
    the runs are launched one after the other)."""
    global _process
    if _process is None:
        fd = os.open(os.environ["FLAKY_COUNTER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"x")
            _process = os.fstat(fd).st_size - 1
        finally:
            os.close(fd)
    return _process


@torch.library.custom_op("walk_evidence::soft_gate", mutates_args=())
def soft_gate(x: torch.Tensor, flaky: bool) -> torch.Tensor:
    """x * sigmoid(x), with noise from the OS on one call of some processes when ``flaky`` (see the module
    docstring)."""
    global _calls
    _calls += 1
    y = x * torch.sigmoid(x)
    if flaky and os.environ.get("FLAKY_COUNTER") and _calls == 1 + _process_number() % 2:
        noise = np.frombuffer(os.urandom(4 * y.numel()), dtype=np.uint32).astype(np.float32) / 2.0**32
        y = y + torch.from_numpy(noise.reshape(tuple(y.shape))) * 1e-3
    return y


@soft_gate.register_fake
def _(x, flaky):
    return torch.empty_like(x)


def _gate_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    s = torch.sigmoid(x)
    return grad * (s + x * s * (1 - s)), None


def _gate_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


soft_gate.register_autograd(_gate_backward, setup_context=_gate_setup)


class Points(Dataset):
    """Points around four centres; each fetch jitters the point and mirrors it at random (the workers' RNG)."""

    def __init__(self, n=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        self.centres = torch.randn(4, 8, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        y = int(self.labels[i])
        x = self.centres[y] + 0.1 * torch.randn(8)
        if torch.rand(()) < 0.5:
            x = x.flip(0)
        return x, y


class Net(nn.Module):
    def __init__(self, p, flaky):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(32, 4)
        self.flaky = flaky

    def forward(self, x):
        return self.fc2(self.drop(soft_gate(self.fc1(x), self.flaky)))


def _train(run, p=0.1, flaky=False):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net(p, flaky and run.rank == 1)
    if run.world_size > 1:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=run.total_steps)
    data = Points()
    sampler = ResumableSampler(len(data), num_replicas=run.world_size, rank=run.rank, seed=1)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=2)
    state = cv.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    run.restore(state)
    for x, y in run.steps(loader):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        run.record(loss=loss.detach(), batch=(x, y))


def train(run):
    _train(run)


def train_drop2(run):
    _train(run, p=0.2)


def train_flaky(run):
    _train(run, flaky=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--func", default="train")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    cv.Run.main(globals()[args.func], steps=args.steps, run_dir=args.run_dir, trace="state")
