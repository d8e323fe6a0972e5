"""A map-style sampler that shards like ``DistributedSampler`` and resumes at the exact next index.

:class:`ResumableSampler` yields exactly ``DistributedSampler``'s indices per epoch and remembers this rank's
position. **Position counts consumed samples**: a loader with workers draws ahead, so use
``for batch in sampler.track(loader)`` (or :meth:`~ResumableSampler.advance`); otherwise indices drawn count,
which is right with ``num_workers=0`` or torchdata's ``StatefulDataLoader`` (:meth:`~ResumableSampler.track`
refuses the latter; ``loader_state`` refuses an untracked loader with workers).

**Resuming**: the next pass starts at the saved position; ``set_epoch`` with the loaded epoch keeps it, another
epoch starts at 0; a state saved at an epoch's end resumes to an empty pass. Worker random streams are re-seeded
per batch (see :mod:`ckptverify.state.dataloader`). **Changing replicas**: after ``C = p * R`` consumed samples,
``R'`` replicas continue exactly when ``R'`` divides ``C``, else :class:`UsageError`. The epoch's tail follows the
new count (padding without ``drop_last``; with it, a change that ends the epoch elsewhere is refused).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch.utils.data import Sampler

from ckptverify.errors import UsageError
from ckptverify.state.distributed import rank_world

__all__ = ["SAMPLER_STATE_VERSION", "Drawn", "ResumableSampler", "epoch_indices", "is_stateful_dataloader",
           "num_samples_per_replica"]

#: Version of the :meth:`ResumableSampler.state_dict` layout.
SAMPLER_STATE_VERSION = 1

_T = TypeVar("_T")

_STATE_KEYS = ("version", "epoch", "position", "seed", "num_replicas", "rank", "dataset_len", "shuffle", "drop_last")
#: Optional key: the base seed of the saved epoch's workers.
_WORKER_SEED = "worker_seed"
#: Attribute set on a DataLoader iterator: the base seed its workers re-seed each batch from.
_ITER_SEED_ATTR = "_ckptverify_worker_seed"


class Drawn(int):
    """An ``int`` index carrying its epoch and slot in the epoch's global order (``position * num_replicas + rank``) for
    per-batch worker seeding; the dataset receives plain ints."""

    epoch: int
    slot: int

    def __new__(cls, index: int, epoch: int, slot: int) -> Drawn:
        obj = super().__new__(cls, index)
        obj.epoch = epoch
        obj.slot = slot
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return Drawn, (int(self), self.epoch, self.slot)


def _int(value: Any, name: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def num_samples_per_replica(dataset_len: int, num_replicas: int, drop_last: bool) -> int:
    """How many indices each rank yields per epoch (``DistributedSampler.num_samples``)."""
    if drop_last and dataset_len % num_replicas != 0:
        return math.ceil((dataset_len - num_replicas) / num_replicas)
    return math.ceil(dataset_len / num_replicas)


def epoch_indices(dataset_len: int, num_replicas: int, rank: int, *, epoch: int, shuffle: bool, seed: int,
                  drop_last: bool) -> list[int]:
    """One rank's indices for one epoch, as ``DistributedSampler`` computes them."""
    num_samples = num_samples_per_replica(dataset_len, num_replicas, drop_last)
    total_size = num_samples * num_replicas
    if shuffle:
        indices = torch.randperm(dataset_len, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        indices = list(range(dataset_len))
    # Padded by repeating it (without drop_last) or cut, to num_samples per rank.
    indices = (indices * math.ceil(total_size / max(len(indices), 1)))[:total_size]
    return indices[rank:total_size:num_replicas]


def is_stateful_dataloader(obj: Any) -> bool:
    """Whether ``obj`` is a torchdata ``StatefulDataLoader`` (``False`` while torchdata is not imported: no such
    object can exist then)."""
    mod = sys.modules.get("torchdata.stateful_dataloader")
    cls = getattr(mod, "StatefulDataLoader", None) if mod is not None else None
    return cls is not None and isinstance(obj, cls)


class ResumableSampler(Sampler[int]):
    """``DistributedSampler``'s index order with a saved and restored position (see the module docstring).
    ``num_replicas`` and ``rank`` default to the process group, else 1 and 0."""

    def __init__(self, dataset_len: int, *, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, reseed_workers: bool = True) -> None:
        default_rank, default_replicas = rank_world()
        self.dataset_len = _int(dataset_len, "dataset_len")
        self.num_replicas = _int(default_replicas if num_replicas is None else num_replicas, "num_replicas", minimum=1)
        self.rank = _int(default_rank if rank is None else rank, "rank")
        if self.rank >= self.num_replicas:
            raise UsageError(f"rank {self.rank} is out of range for {self.num_replicas} replica(s)")
        self.shuffle = bool(shuffle)
        self.seed = _int(seed, "seed")
        self.drop_last = bool(drop_last)
        self.epoch = 0
        # Positions are indices into this rank's list for the current epoch.
        self._resume_at: int | None = None  # where the next pass starts (set by load_state_dict)
        self._pass_start = 0
        self._drawn = 0  # next index to be drawn in the current pass
        self._consumed = 0  # reported consumption (meaningful once self._tracking)
        self._tracking = False
        self._pass_id = 0
        #: Whether a registered loader re-seeds its workers per batch (see the module docstring).
        self.reseed_workers = bool(reseed_workers)
        self._tag = False  # yield Drawn indices (set when a loader with workers is registered)
        self._worker_seed: int | None = None  # base seed the current pass's workers re-seed from
        self._resume_worker_seed: int | None = None  # the saved one, for workers started in the resumed epoch
        self._handed: tuple[int, int, int] | None = None  # (epoch, start, count) of the last batch handed out
        self._cached: tuple[int, list[int]] | None = None  # (epoch, this rank's indices of that epoch)

    # ------------------------------------------------------------------------------------ sizes

    @property
    def num_samples(self) -> int:
        """Indices this rank yields in a whole epoch (``DistributedSampler.num_samples``)."""
        return num_samples_per_replica(self.dataset_len, self.num_replicas, self.drop_last)

    @property
    def total_size(self) -> int:
        """Length of the global (padded or truncated) index list of an epoch."""
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        """Indices the next pass yields: the whole epoch, or what is left of it after a resume."""
        return self.num_samples - (self._resume_at or 0)

    # ------------------------------------------------------------------------------------ position

    @property
    def position(self) -> int:
        """Samples of the current epoch this rank has consumed (see the module docstring)."""
        return self._consumed if self._tracking else self._drawn

    @property
    def tracking(self) -> bool:
        """Whether the training loop reports consumption (:meth:`track` or :meth:`advance` was used)."""
        return self._tracking

    @property
    def drawn_ahead(self) -> int:
        """Indices drawn in the current pass beyond the reported consumption (0 when not tracking)."""
        return self._drawn - self._consumed if self._tracking else 0

    @property
    def drawn_this_pass(self) -> int:
        """Indices drawn from the sampler in the current pass."""
        return self._drawn - self._pass_start

    def advance(self, n: int) -> None:
        """Report that the training loop consumed ``n`` more samples of this rank's current epoch."""
        n = _int(n, "n")
        if self._consumed + n > self._drawn:
            raise UsageError(f"advance({n}) would count {self._consumed + n} samples consumed in epoch {self.epoch}, "
                             f"but only {self._drawn} were drawn from the sampler; consumption is being counted twice")
        self._tracking = True
        self._consumed += n

    def track(self, batches: Iterable[_T], batch_size: int | None = None) -> Iterator[_T]:
        """Iterate ``batches`` (a loader over this sampler), counting each batch as consumed when handed out, as
        ``min(batch_size, samples left)``. ``batch_size`` defaults to ``batches.batch_size``."""
        if is_stateful_dataloader(batches):
            raise UsageError("do not track a StatefulDataLoader: it snapshots the sampler when it dispatches each "
                             "batch and already accounts for prefetching; iterate it directly")
        size = getattr(batches, "batch_size", None) if batch_size is None else batch_size
        if size is None:
            raise UsageError("track() needs the batch size: pass batch_size= (the loader has no batch_size attribute "
                             "or uses a custom batch_sampler)")
        size = _int(size, "batch_size", minimum=1)
        self._tracking = True
        return self._track(batches, size)

    def _track(self, batches: Iterable[_T], size: int) -> Iterator[_T]:
        it = iter(batches)  # a DataLoader draws its base seed here
        # The base seed the iterator's workers re-seed from: the saved one in the resumed epoch, else torch's draw.
        seed = getattr(it, _ITER_SEED_ATTR, None)
        if seed is None:
            seed = self._resume_worker_seed if self._resume_worker_seed is not None else getattr(it, "_base_seed", None)
            if seed is not None:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(it, _ITER_SEED_ATTR, seed)
        if isinstance(seed, int):
            self._worker_seed = seed
        for batch in it:
            start = self._consumed
            n = min(size, self.num_samples - start)
            self.advance(n)
            self._handed = (self.epoch, start, n)
            yield batch

    def last_batch(self) -> tuple[int, list[int]] | None:
        """``(epoch, indices)`` of the last batch :meth:`track` handed out (this rank's, in batch order), or ``None``.
        """
        if self._handed is None:
            return None
        epoch, start, n = self._handed
        return epoch, self._indices_of(epoch)[start:start + n]

    def _indices_of(self, epoch: int) -> list[int]:
        cached = self._cached
        if cached is None or cached[0] != epoch:
            cached = self._cached = (epoch, epoch_indices(
                self.dataset_len, self.num_replicas, self.rank, epoch=epoch, shuffle=self.shuffle, seed=self.seed,
                drop_last=self.drop_last))
        return cached[1]

    # ------------------------------------------------------------------------------------ iteration

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (seed ``seed + epoch``). A new epoch starts at 0; the current one keeps its position."""
        epoch = _int(epoch, "epoch")
        if epoch == self.epoch:
            return
        self.epoch = epoch
        self._resume_at = None
        self._pass_start = self._drawn = self._consumed = 0
        self._pass_id += 1
        # Workers started for another epoch draw from the base seed of their own iterator.
        self._resume_worker_seed = None

    def epoch_indices(self) -> list[int]:
        """This rank's full index list for the current epoch."""
        return list(self._indices_of(self.epoch))

    def __iter__(self) -> Iterator[int]:
        start = self._resume_at if self._resume_at is not None else 0
        self._resume_at = None
        self._pass_id += 1
        self._pass_start = self._drawn = self._consumed = start
        return self._iterate(self._indices_of(self.epoch)[start:], self._pass_id, start)

    def _iterate(self, indices: list[int], pass_id: int, start: int) -> Iterator[int]:
        tag, epoch, replicas, rank = self._tag, self.epoch, self.num_replicas, self.rank
        for k, index in enumerate(indices):
            if pass_id == self._pass_id:  # a stale iterator of an earlier pass no longer moves the position
                self._drawn += 1
            yield Drawn(index, epoch, (start + k) * replicas + rank) if tag else index

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into spawned workers with the loader's worker_init_fn: the index cache is rebuilt on demand.
        state = dict(self.__dict__)
        state["_cached"] = None
        return state

    # ------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {"version": SAMPLER_STATE_VERSION, "epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_replicas": self.num_replicas, "rank": self.rank, "dataset_len": self.dataset_len,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                _WORKER_SEED: self._worker_seed if self._tag else None}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the saved epoch and position. Length, ``shuffle``, ``seed`` and ``drop_last`` must match; same
        replica count requires the same rank, a different one is resharded when exact, else :class:`UsageError`. The
        saved ``worker_seed`` (optional) seeds the resumed epoch's workers."""
        if not isinstance(state_dict, Mapping):
            raise UsageError(f"sampler state must be a mapping, got {type(state_dict).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise UsageError(f"sampler state lacks {missing}")
        if state_dict["version"] != SAMPLER_STATE_VERSION:
            raise UsageError(f"sampler state version {state_dict['version']!r} is not supported (expected "
                             f"{SAMPLER_STATE_VERSION})")
        for name in ("dataset_len", "seed", "shuffle", "drop_last"):
            value = getattr(self, name)
            saved = bool(state_dict[name]) if isinstance(value, bool) else _int(state_dict[name], f"saved {name}")
            if saved != value:
                raise UsageError(f"sampler state was saved with {name}={saved}, this sampler has {value}")
        epoch = _int(state_dict["epoch"], "saved epoch")
        old_replicas = _int(state_dict["num_replicas"], "saved num_replicas", minimum=1)
        old_rank = _int(state_dict["rank"], "saved rank")
        position = _int(state_dict["position"], "saved position")
        worker_seed = state_dict.get(_WORKER_SEED)
        if worker_seed is not None:
            worker_seed = _int(worker_seed, "saved worker_seed")
        old_num_samples = num_samples_per_replica(self.dataset_len, old_replicas, self.drop_last)
        if position > old_num_samples or old_rank >= old_replicas:
            raise UsageError(f"sampler state is inconsistent: position {position} of {old_num_samples} samples per "
                             f"rank, rank {old_rank} of {old_replicas}")
        new_position, new_replicas = position, self.num_replicas
        if old_replicas == new_replicas:
            if old_rank != self.rank:
                raise UsageError(f"sampler state belongs to rank {old_rank}, this sampler is rank {self.rank}")
        elif position == old_num_samples:
            new_position = self.num_samples  # the epoch was finished
        else:
            consumed = position * old_replicas
            if consumed % new_replicas != 0:
                raise UsageError(f"cannot reshard the sampler from {old_replicas} to {new_replicas} replicas: each "
                                 f"rank consumed {position} samples, {consumed} globally, which is not divisible by "
                                 f"{new_replicas}; resuming would skip or repeat samples. Resume on {old_replicas} "
                                 f"replicas, or checkpoint at a global sample count divisible by {new_replicas}.")
            old_total = old_num_samples * old_replicas
            if self.drop_last and old_total != self.total_size:
                raise UsageError(f"cannot reshard the sampler from {old_replicas} to {new_replicas} replicas with "
                                 f"drop_last=True: the epoch would end after {self.total_size} samples instead of "
                                 f"{old_total}, so samples would be skipped or added")
            new_position = consumed // new_replicas
        self.epoch = epoch
        self._pass_id += 1
        self._resume_at = self._pass_start = self._drawn = self._consumed = new_position
        self._worker_seed = self._resume_worker_seed = worker_seed
        self._handed = None
