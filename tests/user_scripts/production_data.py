"""The data side of the production training script: a dataset of noisy 2-D points in four classes, with the
augmentation applied when an example is read (so DataLoader workers draw from their own random streams)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class NoisyBlobs(Dataset):
    """Four Gaussian blobs in 8 dimensions; every read jitters the point and, half the time, mirrors it."""

    def __init__(self, n: int = 512, dim: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(4, dim, generator=g) * 3
        self.labels = torch.randint(0, 4, (n,), generator=g)
        self.points = centers[self.labels] + torch.randn(n, dim, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.points[i] + 0.05 * torch.randn_like(self.points[i])  # augmentation: jitter
        if torch.rand(()) < 0.5:
            x = x.flip(0) * 1.0  # augmentation: mirror the feature order
        return x, self.labels[i]
