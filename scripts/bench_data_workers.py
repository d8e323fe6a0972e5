"""What re-seeding DataLoader workers per batch costs: an epoch of a worker-augmented loader registered in a
``TrainState``, with ``ResumableSampler(reseed_workers=True)`` (the default: the workers' random streams are
state, and a resumed run draws the same augmentation) against ``reseed_workers=False`` (torch's own seeding: the
baseline), as a ratio measured in one run.

    python scripts/bench_data_workers.py [--samples 4096] [--batch 32] [--workers 2] [--rounds 5]

Each round times one epoch of each variant, in alternation (a fresh iterator each time, workers started anew, as
a job's epochs do); the best epoch of each is compared. The dataset draws its augmentation from torch, ``random``
and numpy in ``__getitem__``, as image and audio pipelines do.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class Augmented(Dataset):
    """Images with noise, a random flip and a random brightness, drawn in the worker."""

    def __init__(self, n: int) -> None:
        self.images = torch.rand(n, 3, 32, 32)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.images[i] + 0.05 * torch.randn(3, 32, 32)
        if random.random() < 0.5:
            x = x.flip(-1)
        return x * float(np.random.uniform(0.8, 1.2))


def epoch_seconds(dataset: Dataset, batch: int, workers: int, reseed: bool) -> float:
    import ckptverify as cv

    loader = DataLoader(dataset, batch_size=batch, num_workers=workers,
                        sampler=cv.ResumableSampler(len(dataset), seed=0, reseed_workers=reseed))
    cv.TrainState(model=torch.nn.Linear(1, 1), dataloader=loader)  # registered: re-seeding installed if asked
    began = time.perf_counter()
    n = sum(1 for _ in loader)
    assert n == -(-len(dataset) // batch)
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    dataset = Augmented(args.samples)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for reseed in (False, True):
            times[reseed].append(epoch_seconds(dataset, args.batch, args.workers, reseed))
    base, ours = min(times[False]), min(times[True])
    batches = -(-args.samples // args.batch)
    print(f"{args.samples} samples, batch {args.batch}, {args.workers} workers, {batches} batches an epoch, "
          f"best of {args.rounds} epochs each")
    print(f"torch's own worker seeding (baseline): {base:.3f} s an epoch")
    print(f"per-batch re-seeding (resumable):      {ours:.3f} s an epoch")
    print(f"ratio: {ours / base:.3f}x  ({(ours - base) / batches * 1e6:+.0f} us a batch)")


if __name__ == "__main__":
    main()
