"""The dataset of the replay test jobs: points of four classes, with noise added as each sample is read.

``REPLAY_NOISE`` picks where the noise comes from, as users write it:

* ``worker`` (default): ``torch.randn`` inside ``__getitem__``, i.e. the DataLoader worker's own random
  stream (seeded from the main process when the loader's iterator is made);
* ``index``: a generator seeded from the sample's index, so a sample reads the same in every run;
* ``urandom``: ``os.urandom``, which no seed fixes.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset


class NoisyPoints(Dataset):
    def __init__(self, n: int, dim: int = 8, classes: int = 4) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.noise = os.environ.get("REPLAY_NOISE", "worker")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.noise == "worker":
            x = x + 0.1 * torch.randn_like(x)
        elif self.noise == "index":
            x = x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(i))
        elif self.noise == "urandom":
            u = torch.frombuffer(bytearray(os.urandom(4 * x.numel())), dtype=torch.int32).double() / 2**31
            x = x + 0.1 * u.float()
        return x, self.y[i]
