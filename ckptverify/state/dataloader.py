"""Save and restore a data loader's position, whatever keeps it.

Two kinds of loader can resume at the exact next batch:

* torchdata's ``StatefulDataLoader`` (``pip install torchdata``), which keeps its own state, prefetching and
  worker state included. torchdata is optional and never imported here: a loader of that type can only exist
  if its module is already loaded.
* a standard ``torch.utils.data.DataLoader`` whose ``sampler`` (or ``batch_sampler.sampler``) is a
  :class:`~ckptverify.state.sampler.ResumableSampler`. With ``num_workers > 0`` the loader draws indices
  ahead of the training loop, so the loop must report consumption (``sampler.track(loader)``).

:func:`loader_state` returns ``{"kind": ..., "state": ...}`` and :func:`restore_loader` puts it back into a
loader of the same kind; any other loader raises :class:`~ckptverify.errors.UsageError`. The state holds only
this rank's position: a caller saving it through DCP must key it by rank (DCP deduplicates equal keys across
ranks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptverify.errors import UsageError
from ckptverify.state.sampler import ResumableSampler, _is_stateful_dataloader

__all__ = [
    "KIND_RESUMABLE_SAMPLER",
    "KIND_STATEFUL_DATALOADER",
    "check_loader",
    "find_resumable_sampler",
    "loader_state",
    "restore_loader",
]

KIND_STATEFUL_DATALOADER = "torchdata.StatefulDataLoader"
KIND_RESUMABLE_SAMPLER = "ckptverify.ResumableSampler"

_SUPPORTED = (
    "supported loaders are torchdata's StatefulDataLoader, and torch.utils.data.DataLoader whose sampler (or "
    "batch_sampler.sampler) is a ckptverify.state.sampler.ResumableSampler"
)


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
    """Refuse, when the training state is created, a loader whose position cannot be saved."""
    if _is_stateful_dataloader(loader) or find_resumable_sampler(loader) is not None:
        return
    raise UsageError(f"TrainState(dataloader=...) cannot save the position of a {_describe(loader)}: {_SUPPORTED}")


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
    raise UsageError(f"cannot save the position of a {_describe(loader)}: {_SUPPORTED}")


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
        raise UsageError(f"cannot restore the position of a {_describe(loader)}: {_SUPPORTED}")
    if kind != expected:
        raise UsageError(f"loader state of kind {kind!r} cannot be restored into a {_describe(loader)} ({expected})")
    if expected == KIND_STATEFUL_DATALOADER:
        loader.load_state_dict(dict(state["state"]))
    else:
        sampler = find_resumable_sampler(loader)
        assert sampler is not None
        sampler.load_state_dict(state["state"])
