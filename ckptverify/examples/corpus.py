"""A small synthetic token corpus, generated in code, identical on every rank, run, platform and library version.

The "language" is a first-order Markov chain over ``vocab_size`` tokens: every token has ``branching`` likely
successors (Zipf-weighted, chosen by the seed) that together take ``1 - smoothing`` of the probability; the remaining
``smoothing`` is spread uniformly over the whole vocabulary. Its entropy rate is far below ``log(vocab_size)``, so a
model's loss falls visibly within a few dozen steps.

All randomness comes from a counter-based hash (SplitMix64 finalizer) evaluated with integer arithmetic, never from a
library random number generator, so the tokens do not depend on the torch or numpy version, the number of threads or
the process: each sequence is a pure function of ``(seed, sequence index, position)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Dataset

from ckptverify.fingerprint.spec import LANES, mix

__all__ = ["TokenDataset"]

# Stream tags keep the hash inputs of different uses apart.
_TAG_SUCCESSORS = 1
_TAG_START = 2
_TAG_BRANCH = 3
_TAG_UNIFORM = 4
_PROB_BITS = 32  # probabilities are compared as 32-bit integers: exact, no float rounding involved
_SPLITMIX64 = LANES[1]  # SplitMix64's finalizer, the fingerprint's second lane mixer (wrapping uint64 arithmetic)


def _hash(seed: int, tag: int, a: np.ndarray, b: np.ndarray | int = 0) -> np.ndarray:
    """A 64-bit hash of ``(seed, tag, a, b)``, elementwise over the broadcast of ``a`` and ``b``."""
    with np.errstate(over="ignore"):
        h = mix(np.asarray([(seed * 0x9E3779B97F4A7C15 + tag) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64), _SPLITMIX64)
        h = mix(h ^ np.asarray(a, dtype=np.uint64), _SPLITMIX64)
        h = mix(h ^ (np.asarray(b, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)), _SPLITMIX64)
    return h


def _sample(vocab_size: int, seed: int, branching: int, smoothing: float, num_sequences: int,
            length: int) -> np.ndarray:
    """The chain's first ``num_sequences`` sequences, as an int64 array ``(num_sequences, length)``."""
    if vocab_size < 2:
        raise ValueError("vocab_size must be at least 2")
    if not 1 <= branching <= vocab_size:
        raise ValueError("branching must be between 1 and vocab_size")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError("smoothing must be in [0, 1)")
    rows = np.arange(vocab_size, dtype=np.uint64)[:, None]
    cols = np.arange(vocab_size, dtype=np.uint64)[None, :]
    # Each row's successors: the tokens with the smallest hashes (distinct by construction).
    keys = _hash(seed, _TAG_SUCCESSORS, rows, cols)
    successors = np.argsort(keys, axis=1, kind="stable")[:, :branching].astype(np.int64)
    scale = 1 << _PROB_BITS
    uniform_threshold = np.uint64(round(smoothing * scale))
    zipf = [1.0 / (k + 1) for k in range(branching)]
    cdf = np.cumsum([w / sum(zipf) for w in zipf])
    # Thresholds over [0, 2**32) for picking successor k; the last one covers the whole range.
    branch_cdf = np.minimum(np.round(cdf * scale), scale).astype(np.uint64)
    branch_cdf[-1] = np.uint64(scale)

    seq_ids = np.arange(num_sequences, dtype=np.uint64)
    out = np.empty((num_sequences, length), dtype=np.int64)
    low32 = np.uint64((1 << _PROB_BITS) - 1)
    v = np.uint64(vocab_size)
    out[:, 0] = (_hash(seed, _TAG_START, seq_ids) % v).astype(np.int64)
    for t in range(1, length):
        h = _hash(seed, _TAG_BRANCH, seq_ids, t)
        u_mix, u_pick = h >> np.uint64(_PROB_BITS), h & low32
        branch = np.searchsorted(branch_cdf, u_pick, side="right")
        nxt = successors[out[:, t - 1], branch]
        uniform = u_mix < uniform_threshold
        if uniform.any():
            u = _hash(seed, _TAG_UNIFORM, seq_ids[uniform], t) % v
            nxt[uniform] = u.astype(np.int64)
        out[:, t] = nxt
    return out


class TokenDataset(Dataset):
    """Fixed-length next-token examples: item ``i`` is ``(input_ids, targets)``, two int64 tensors of ``seq_len``.

    ``targets`` is ``input_ids`` shifted by one token. All ``num_sequences`` sequences are generated up front (a
    thousand sequences of 32 tokens take a few milliseconds) and are the same on every rank and in every run.
    """

    def __init__(self, num_sequences: int, seq_len: int, vocab_size: int = 256, seed: int = 0, *, branching: int = 8,
                 smoothing: float = 0.1) -> None:
        if num_sequences < 1 or seq_len < 1:
            raise ValueError("num_sequences and seq_len must be positive")
        self.num_sequences = num_sequences
        self.vocab_size = vocab_size
        self.tokens = torch.from_numpy(_sample(vocab_size, seed, branching, smoothing, num_sequences, seq_len + 1))

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            index += self.num_sequences
        if not 0 <= index < self.num_sequences:
            raise IndexError(index)
        row = self.tokens[index]
        return row[:-1].clone(), row[1:].clone()

    @property
    def uniform_loss(self) -> float:
        """Cross-entropy of a uniform guess, ``log(vocab_size)``: roughly where an untrained model starts."""
        return math.log(self.vocab_size)
