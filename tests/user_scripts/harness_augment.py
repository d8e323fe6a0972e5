"""Train a small classifier on a synthetic image set, with random augmentation done in the DataLoader workers.

    python harness_augment.py                     # a plain run
    python harness_augment.py --run-dir runs/a    # a production job: checkpoints, trace, replays
    torchrun --nproc_per_node 2 harness_augment.py --run-dir runs/a
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset

import ckptverify as cv
from ckptverify.state.sampler import ResumableSampler

BATCH = 8
STEPS = 8


class NoisyShapes(Dataset):
    """8x8 images of four classes; each fetch flips and jitters the image at random (the workers' RNG)."""

    def __init__(self, n=96, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        self.base = torch.randn(4, 1, 8, 8, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        y = int(self.labels[i])
        x = self.base[y].clone()
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        x = x + 0.1 * torch.randn_like(x)
        return x, y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(4 * 8 * 8, 4)

    def forward(self, x):
        return self.head(self.drop(F.relu(self.conv(x)).flatten(1)))


def train(run):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"starting rank {run.rank} of {run.world_size}")
    model = Net()
    if run.world_size > 1:
        model = DDP(model)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=64)
    data = NoisyShapes()
    sampler = ResumableSampler(len(data), num_replicas=run.world_size, rank=run.rank, seed=1)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=2)
    state = cv.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader, extras={"ema": ema})
    run.restore(state)
    for x, y in run.steps(loader):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        ema.update_parameters(model)
        print(f"step {run.step + 1} loss {loss.item():.4f}")
        run.record(loss=loss.detach(), batch=(x, y), grad_norm=grad_norm)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--save-every", type=int, default=None)
    args = ap.parse_args()
    cv.Run.main(train, steps=args.steps, run_dir=args.run_dir, save_every=args.save_every)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os._exit(0)  # gloo threads left behind by DDP can abort a normal interpreter exit
