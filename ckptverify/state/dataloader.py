"""Save and restore a data loader's position, whatever keeps it.

Two kinds of loader can resume at the exact next batch:

* torchdata's ``StatefulDataLoader`` (``pip install 'ckptverify[data]'``), which keeps its own state, prefetching and
  worker state included. torchdata is optional and never imported here: a loader of that type can only exist
  if its module is already loaded.
* a standard ``torch.utils.data.DataLoader`` whose ``sampler`` (or ``batch_sampler.sampler``) is a
  :class:`~ckptverify.state.sampler.ResumableSampler`. With ``num_workers > 0`` the loader draws indices
  ahead of the training loop, so the loop must report consumption (``sampler.track(loader)``).

:func:`loader_state` returns ``{"kind": ..., "state": ...}`` and :func:`restore_loader` puts it back into a
loader of the same kind; any other loader raises :class:`~ckptverify.errors.UsageError`. The state holds only
this rank's position: a caller saving it through DCP must key it by rank (DCP deduplicates equal keys across
ranks).

**Random streams in the workers are state too.** A ``Dataset`` that augments in ``__getitem__`` (noise, crops,
masking) draws from the global streams of the worker process that fetches the sample: torch's, ``random``'s
and numpy's. Torch seeds them once per worker when the loader's iterator starts (``base_seed + worker_id``
for torch and ``random``, numpy from ``(base_seed, worker_id)``; ``base_seed`` is drawn from the main
process's generator, or the loader's ``generator``), so a batch's noise depends on which worker fetched it and
on all that worker drew before: a resumed run, whose workers start afresh, draws other noise. torchdata's
``StatefulDataLoader`` saves ``base_seed`` but not where each worker's streams have got to, so it has the same
gap for a map-style dataset.

:func:`check_loader` (called by ``TrainState(dataloader=loader)``) therefore makes a loader with workers whose
sampler is a :class:`~ckptverify.state.sampler.ResumableSampler` (``reseed_workers=True``, the default)
re-seed per batch. The contract:

* before each batch, the worker seeds torch's default CPU generator, ``random`` and ``numpy.random`` from
  ``(base_seed, epoch, slot of the batch's first sample in the epoch's global order)``; the dataset receives
  plain ``int`` indices, and ``torch.initial_seed()`` in ``__getitem__`` is that batch seed (a generator the
  dataset makes from it, ``np.random.default_rng(torch.initial_seed())``, is covered too);
* what a batch draws is then a function of its position in the epoch only, not of the worker that fetched it,
  how far workers prefetched, ``num_workers`` or ``prefetch_factor``;
* ``base_seed`` is the one torch drew for the epoch's iterator (so ``torch.manual_seed`` and the loader's
  ``generator`` still choose it); the sampler's state saves it (``worker_seed``), and the workers started in
  the resumed epoch re-seed from the saved one (persistent workers keep it for the rest of the run);
* the user's ``worker_init_fn`` still runs once per worker, first; the per-batch seeding then replaces whatever
  it seeded in the global streams. Randomness from anywhere else (``os.urandom``, the clock, a generator the
  dataset creates once per worker, another library's own generator) is not reproduced.

This draws other random numbers than torch's own worker seeding would (the streams are re-seeded per batch
instead of running on per worker); ``ResumableSampler(..., reseed_workers=False)`` keeps torch's seeding, and
with it a resume that reproduces the indices but not the workers' noise. The per-batch seeding needs
automatic batching (``batch_size`` set, the loader's default), costs a few microseconds per batch, and is
installed in workers started after the ``TrainState`` is created.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckptverify.errors import UsageError
from ckptverify.state.sampler import Drawn, ResumableSampler, _is_stateful_dataloader

__all__ = [
    "KIND_RESUMABLE_SAMPLER",
    "KIND_STATEFUL_DATALOADER",
    "WorkerSeeding",
    "batch_seed",
    "check_loader",
    "find_resumable_sampler",
    "loader_state",
    "restore_loader",
]

KIND_STATEFUL_DATALOADER = "torchdata.StatefulDataLoader"
KIND_RESUMABLE_SAMPLER = "ckptverify.ResumableSampler"

_SUPPORTED = (
    "supported loaders are torchdata's StatefulDataLoader (pip install 'ckptverify[data]'), and "
    "torch.utils.data.DataLoader whose sampler (or batch_sampler.sampler) is a "
    "ckptverify.state.sampler.ResumableSampler"
)
#: Added for a loader over an IterableDataset, which has no sampler to make resumable.
_ITERABLE = (
    "; this loader reads an IterableDataset, which draws no indices from a sampler, so a ResumableSampler cannot "
    "apply: read it through torchdata's StatefulDataLoader and give the dataset state_dict() and "
    "load_state_dict() methods that save and restore its position (the loader calls them in each worker; "
    "docs/state.md, Iterable datasets)"
)


def _refusal(loader: Any) -> str:
    """Why ``loader``'s position cannot be saved, and the ways that can (the one way for an IterableDataset)."""
    from torch.utils.data import IterableDataset

    iterable = isinstance(getattr(loader, "dataset", None), IterableDataset)
    return f"{_SUPPORTED}{_ITERABLE if iterable else ''}"


def find_resumable_sampler(loader: Any) -> ResumableSampler | None:
    """The :class:`ResumableSampler` driving ``loader`` (its ``sampler`` or ``batch_sampler.sampler``), if any."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, ResumableSampler):
        return sampler
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if isinstance(inner, ResumableSampler):
        return inner
    return None


def check_loader(loader: Any) -> None:
    """Refuse, when the training state is created, a loader whose position cannot be saved; make the worker
    randomness of a ``ResumableSampler``-driven loader with workers part of its state (see the module
    docstring)."""
    sampler = find_resumable_sampler(loader)
    if sampler is not None:
        _seed_workers_per_batch(loader, sampler)
        return
    if _is_stateful_dataloader(loader):
        return
    raise UsageError(f"TrainState(dataloader=...) cannot save the position of a {_describe(loader)}: "
                     f"{_refusal(loader)}")


# ------------------------------------------------------------------------------------ workers' random streams

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit words whose outputs look independent."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def batch_seed(base_seed: int, epoch: int, slot: int) -> int:
    """The 64-bit seed of the batch whose first sample is at ``slot`` of ``epoch``'s global order."""
    return _mix(_mix(_mix(base_seed & _MASK64) ^ (epoch & _MASK64)) ^ (slot & _MASK64))


def _seed_streams(seed: int) -> None:
    import torch

    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is installed with the package
        return
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])


def _seed_workers_per_batch(loader: Any, sampler: ResumableSampler) -> None:
    if not sampler.reseed_workers or not (getattr(loader, "num_workers", 0) or 0) > 0:
        return
    if getattr(loader, "batch_sampler", None) is None:
        return  # no automatic batching: the fetcher calls dataset[i] directly, there is no batch to seed
    current = getattr(loader, "worker_init_fn", None)
    if isinstance(current, WorkerSeeding) and current.sampler is sampler:
        return
    loader.worker_init_fn = WorkerSeeding(sampler, current)
    sampler._tag = True


class WorkerSeeding:
    """A loader's ``worker_init_fn`` that makes the worker re-seed its global random streams before each batch
    (see the module docstring); it calls the user's ``worker_init_fn`` (``user_fn``) first."""

    def __init__(self, sampler: ResumableSampler, user_fn: Callable[[int], None] | None) -> None:
        self.sampler = sampler
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        from torch.utils.data import get_worker_info

        if self.user_fn is not None:
            self.user_fn(worker_id)
        info = get_worker_info()
        if info is None:  # pragma: no cover - torch calls worker_init_fn in a worker only
            return
        # The main process set the saved base seed before starting the workers of the resumed epoch.
        saved = self.sampler._resume_worker_seed
        base = saved if saved is not None else info.seed - worker_id
        _reseed_each_batch(info.dataset, base)


class _ReseedEachBatch:
    """``dataset.__getitems__`` in a worker: seed the streams for the batch, then fetch it as torch would."""

    def __init__(self, dataset: Any, base_seed: int, fetch: Callable[[list[int]], Any] | None) -> None:
        self.dataset, self.base_seed, self.fetch = dataset, base_seed, fetch

    def __call__(self, indices: Sequence[Any]) -> Any:
        first = indices[0] if len(indices) else None
        if isinstance(first, Drawn):
            _seed_streams(batch_seed(self.base_seed, first.epoch, first.slot))
            indices = [int(i) for i in indices]
        if self.fetch is not None:
            return self.fetch(list(indices))
        return [self.dataset[i] for i in indices]


def _reseed_each_batch(dataset: Any, base_seed: int) -> None:
    # torch's map-style fetcher calls dataset.__getitems__(indices) when the dataset has one (an instance
    # attribute counts), else dataset[i] for each index; a dataset's own __getitems__ is kept and called.
    fetch = getattr(dataset, "__getitems__", None) or None
    if isinstance(fetch, _ReseedEachBatch):
        fetch.base_seed = base_seed
        return
    hook = _ReseedEachBatch(dataset, base_seed, fetch)
    try:
        dataset.__getitems__ = hook
    except (AttributeError, TypeError):  # a dataset with __slots__: a subclass of the same layout holds it
        cls = type(dataset)
        dataset.__class__ = type(cls.__name__, (cls,), {"__slots__": (), "__getitems__":
                                                         lambda self, indices: hook(indices)})


def _describe(loader: Any) -> str:
    cls = type(loader)
    return f"{cls.__module__}.{cls.__qualname__}"


def loader_state(loader: Any) -> dict[str, Any]:
    """This rank's position in ``loader``, as ``{"kind": ..., "state": ...}``."""
    if _is_stateful_dataloader(loader):
        sampler = find_resumable_sampler(loader)
        if sampler is not None and sampler.tracking:
            raise UsageError(
                "the StatefulDataLoader's ResumableSampler was tracked; a StatefulDataLoader accounts for "
                "prefetching itself, so iterate it directly instead of through sampler.track()"
            )
        return {"kind": KIND_STATEFUL_DATALOADER, "state": loader.state_dict()}
    sampler = find_resumable_sampler(loader)
    if sampler is not None:
        workers = getattr(loader, "num_workers", 0) or 0
        if workers > 0 and not sampler.tracking and sampler.drawn_this_pass > 0:
            raise UsageError(
                f"the DataLoader has {workers} worker(s) and draws indices ahead of the training loop, but the "
                "loop did not report consumption: iterate with `for batch in sampler.track(loader)` (or call "
                "sampler.advance(n) after each batch) so the saved position counts consumed samples"
            )
        return {"kind": KIND_RESUMABLE_SAMPLER, "state": sampler.state_dict()}
    raise UsageError(f"cannot save the position of a {_describe(loader)}: {_refusal(loader)}")


def restore_loader(loader: Any, state: Mapping[str, Any]) -> None:
    """Restore a position saved by :func:`loader_state` into a freshly built loader of the same kind.

    Call it before iterating the loader: the next batch is then the one an uninterrupted run would have
    produced next.
    """
    if not isinstance(state, Mapping) or "kind" not in state or "state" not in state:
        raise UsageError("loader state must be a mapping with 'kind' and 'state', as made by loader_state()")
    kind = state["kind"]
    if _is_stateful_dataloader(loader):
        expected = KIND_STATEFUL_DATALOADER
    elif find_resumable_sampler(loader) is not None:
        expected = KIND_RESUMABLE_SAMPLER
    else:
        raise UsageError(f"cannot restore the position of a {_describe(loader)}: {_refusal(loader)}")
    if kind != expected:
        raise UsageError(f"loader state of kind {kind!r} cannot be restored into a {_describe(loader)} ({expected})")
    if expected == KIND_STATEFUL_DATALOADER:
        loader.load_state_dict(dict(state["state"]))
    else:
        sampler = find_resumable_sampler(loader)
        assert sampler is not None
        sampler.load_state_dict(state["state"])
