"""A small image dataset with augmentation in __getitem__, as a training project keeps it in its own module."""

import os
import random

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info


class NoisyImages(Dataset):
    """Fixed 1x8x8 "images" with labels; each fetch adds Gaussian pixel noise, a random brightness and a random
    horizontal flip, drawn in the DataLoader worker."""

    def __init__(self, n=48, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 1, 8, 8, generator=g)
        self.labels = torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def augment(self, x):
        x = x + 0.1 * torch.randn_like(x)                  # torch's generator
        x = x * (0.8 + 0.4 * random.random())              # Python's random
        if np.random.rand() < 0.5:                         # numpy's global generator
            x = x.flip(-1)
        return x

    def __getitem__(self, i):
        return self.augment(self.images[i]), self.labels[i]


class UrandomNoisyImages(NoisyImages):
    """The noise comes from the operating system's entropy pool: no seed reproduces it."""

    def augment(self, x):
        noise = np.frombuffer(os.urandom(4 * x.numel()), dtype=np.uint32).astype(np.float32) / 2**32
        return x + 0.1 * torch.from_numpy(noise.copy()).view_as(x)


class PerWorkerRngImages(NoisyImages):
    """The noise comes from a generator each worker makes once, at its start (seeded, so two continuous runs
    agree), and that runs on from batch to batch."""

    rng = None

    def augment(self, x):
        return x + 0.1 * torch.from_numpy(self.rng.standard_normal(x.shape).astype(np.float32))


def start_worker_rng(worker_id):
    """worker_init_fn of PerWorkerRngImages."""
    info = get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed)
