"""Save and restore a data loader's position, whatever keeps it.

Two kinds resume at the exact next batch: torchdata's ``StatefulDataLoader`` (never imported here: one can only
exist if its module is loaded), and a ``DataLoader`` whose sampler is a
:class:`~ckptverify.state.sampler.ResumableSampler` (with workers, the loop must report consumption via
``sampler.track(loader)``). Others raise :class:`~ckptverify.errors.UsageError`. The state is this rank's only:
key it by rank in DCP (which deduplicates equal keys).

**Worker random streams are state too.** Torch seeds each worker once per iterator, so augmentation noise depends
on which worker fetched a batch and what it drew before; a resume draws other noise (torchdata has the same gap).
So :func:`check_loader` makes a ``ResumableSampler``-driven loader with workers (``reseed_workers=True``, default)
re-seed torch's CPU generator, ``random`` and ``numpy.random`` before each batch from ``(base_seed, epoch, slot of
the batch's first sample)``; ``torch.initial_seed()`` in ``__getitem__`` is that seed. A batch's draws then depend
only on its position. ``base_seed`` is still torch's draw (``manual_seed`` and ``generator`` choose it) and is
saved (``worker_seed``). ``worker_init_fn`` runs first, then is overridden for the global streams; other
randomness (``os.urandom``, per-worker generators) is not reproduced. This differs from torch's own seeding
(``reseed_workers=False`` keeps it, without reproducible noise); it needs automatic batching, costs microseconds
per batch, and applies to workers started after the ``TrainState`` is created.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ckptverify.errors import UsageError
from ckptverify.fingerprint.spec import LANES, MASK64, mix
from ckptverify.state.sampler import Drawn, ResumableSampler, is_stateful_dataloader

__all__ = ["KIND_RESUMABLE_SAMPLER", "KIND_STATEFUL_DATALOADER", "WorkerSeeding", "batch_seed", "check_loader",
           "find_resumable_sampler", "loader_state", "restore_loader"]

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


def find_resumable_sampler(loader: Any) -> ResumableSampler | None:
    """The :class:`ResumableSampler` driving ``loader`` (its ``sampler`` or ``batch_sampler.sampler``), if any."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(sampler, ResumableSampler):
            return sampler
    return None


def _kind(loader: Any, refused: str) -> tuple[str, ResumableSampler | None]:
    """What keeps ``loader``'s position, and its :class:`ResumableSampler` if any; :class:`UsageError` starting with
    ``refused`` when nothing does, naming the ways that work (the one way for an IterableDataset)."""
    sampler = find_resumable_sampler(loader)
    if is_stateful_dataloader(loader):
        return KIND_STATEFUL_DATALOADER, sampler
    if sampler is not None:
        return KIND_RESUMABLE_SAMPLER, sampler
    iterable = isinstance(getattr(loader, "dataset", None), IterableDataset)
    raise UsageError(f"{refused} the position of a {_describe(loader)}: {_SUPPORTED}{_ITERABLE if iterable else ''}")


def check_loader(loader: Any) -> None:
    """Refuse, at ``TrainState`` creation, a loader whose position cannot be saved; install per-batch worker seeding
    for a ``ResumableSampler``-driven loader with workers (see the module docstring)."""
    _, sampler = _kind(loader, "TrainState(dataloader=...) cannot save")
    if sampler is None or not sampler.reseed_workers or not (getattr(loader, "num_workers", 0) or 0) > 0:
        return
    if getattr(loader, "batch_sampler", None) is None:
        return  # no automatic batching: the fetcher calls dataset[i] directly, there is no batch to seed
    current = getattr(loader, "worker_init_fn", None)
    if isinstance(current, WorkerSeeding) and current.sampler is sampler:
        return
    loader.worker_init_fn = WorkerSeeding(sampler, current)
    sampler._tag = True


# ------------------------------------------------------------------------------------ workers' random streams

def batch_seed(base_seed: int, epoch: int, slot: int) -> int:
    """The 64-bit seed of the batch whose first sample is at ``slot`` of ``epoch``'s global order."""
    seed = 0
    for value in (base_seed, epoch, slot):
        # splitmix64: the golden-ratio step, then its finalizer (the fingerprint's second lane mixer).
        seed = mix(((seed ^ (value & MASK64)) + 0x9E3779B97F4A7C15) & MASK64, LANES[1])
    return seed


class WorkerSeeding:
    """``worker_init_fn`` re-seeding a worker's global streams before each batch; calls ``user_fn`` first."""

    def __init__(self, sampler: ResumableSampler, user_fn: Callable[[int], None] | None) -> None:
        self.sampler = sampler
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        if self.user_fn is not None:
            self.user_fn(worker_id)
        info = get_worker_info()
        if info is None:  # pragma: no cover - torch calls worker_init_fn in a worker only
            return
        # The main process set the saved base seed before starting the workers of the resumed epoch.
        saved = self.sampler._resume_worker_seed
        base = saved if saved is not None else info.seed - worker_id
        dataset = info.dataset
        # torch's fetcher calls __getitems__ when present (instance attributes count); a dataset's own is kept.
        fetch = getattr(dataset, "__getitems__", None) or None
        if isinstance(fetch, _ReseedEachBatch):
            fetch.base_seed = base
            return
        hook = _ReseedEachBatch(dataset, base, fetch)
        try:
            dataset.__getitems__ = hook
        except (AttributeError, TypeError):  # a dataset with __slots__: a subclass of the same layout holds it
            cls = type(dataset)
            dataset.__class__ = type(cls.__name__, (cls,), {"__slots__": (), "__getitems__":
                                                             lambda self, indices: hook(indices)})


class _ReseedEachBatch:
    """``dataset.__getitems__`` in a worker: seed the streams for the batch, then fetch it as torch would."""

    def __init__(self, dataset: Any, base_seed: int, fetch: Callable[[list[int]], Any] | None) -> None:
        self.dataset, self.base_seed, self.fetch = dataset, base_seed, fetch

    def __call__(self, indices: Sequence[Any]) -> Any:
        first = indices[0] if len(indices) else None
        if isinstance(first, Drawn):
            seed = batch_seed(self.base_seed, first.epoch, first.slot)
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
            indices = [int(i) for i in indices]
        if self.fetch is not None:
            return self.fetch(list(indices))
        return [self.dataset[i] for i in indices]


def _describe(loader: Any) -> str:
    cls = type(loader)
    return f"{cls.__module__}.{cls.__qualname__}"


def loader_state(loader: Any) -> dict[str, Any]:
    """This rank's position in ``loader``, as ``{"kind": ..., "state": ...}``."""
    kind, sampler = _kind(loader, "cannot save")
    if kind == KIND_STATEFUL_DATALOADER:
        if sampler is not None and sampler.tracking:
            raise UsageError("the StatefulDataLoader's ResumableSampler was tracked; a StatefulDataLoader accounts for "
                             "prefetching itself, so iterate it directly instead of through sampler.track()")
        return {"kind": kind, "state": loader.state_dict()}
    assert sampler is not None
    workers = getattr(loader, "num_workers", 0) or 0
    if workers > 0 and not sampler.tracking and sampler.drawn_this_pass > 0:
        raise UsageError(f"the DataLoader has {workers} worker(s) and draws indices ahead of the training loop, "
                         "but the loop did not report consumption: iterate with `for batch in "
                         "sampler.track(loader)` (or call sampler.advance(n) after each batch) so the saved "
                         "position counts consumed samples")
    return {"kind": kind, "state": sampler.state_dict()}


def restore_loader(loader: Any, state: Mapping[str, Any]) -> None:
    """Restore a :func:`loader_state` position into a fresh loader of the same kind; call before iterating, so the next
    batch is the one an uninterrupted run would produce."""
    if not isinstance(state, Mapping) or "kind" not in state or "state" not in state:
        raise UsageError("loader state must be a mapping with 'kind' and 'state', as made by loader_state()")
    expected, sampler = _kind(loader, "cannot restore")
    if state["kind"] != expected:
        raise UsageError(f"loader state of kind {state['kind']!r} cannot be restored into a {_describe(loader)} "
                         f"({expected})")
    if sampler is None or expected == KIND_STATEFUL_DATALOADER:
        loader.load_state_dict(dict(state["state"]))
    else:
        sampler.load_state_dict(state["state"])
