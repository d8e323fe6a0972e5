"""The dataset of ``ema_train.py``: Gaussian blobs with per-sample augmentation."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

FEATURES, CLASSES, SAMPLES = 16, 4, 256


class NoisyBlobs(Dataset):
    """Gaussian blobs, one per class; each sample augmented with noise and a random sign flip of a few features,
    seeded by the sample index so every worker augments it the same way."""

    def __init__(self, n: int = SAMPLES, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.centers = torch.randn(CLASSES, FEATURES, generator=g) * 2
        self.labels = torch.randint(CLASSES, (n,), generator=g)
        self.points = self.centers[self.labels] + torch.randn(n, FEATURES, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        x = self.points[i] + 0.1 * torch.randn(FEATURES, generator=g)
        flip = torch.rand(FEATURES, generator=g) < 0.1
        return torch.where(flip, -x, x), self.labels[i]
