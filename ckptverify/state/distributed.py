"""Where this process stands in ``torch.distributed``, and how ranks agree on the coordinator's value
(:class:`Group`): one lookup shared by every module that needs it."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Group", "rank_world", "torch_group"]


def rank_world(*, env_fallback: bool = False) -> tuple[int, int]:
    """``(rank, world_size)`` of the initialized default group, else (with ``env_fallback``) ``RANK``/``WORLD_SIZE``
    from the environment, else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if env_fallback:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return 0, 1


@dataclass(frozen=True)
class Group:
    """How ranks agree: ``coordinator`` (this rank decides), ``broadcast(obj)``, ``barrier()``, and optionally
    ``gather(obj)`` (every rank's ``obj``; enables sharing a background verification among nodes). ``Group()``: one
    process."""

    coordinator: bool = True
    broadcast: Callable[[Any], Any] | None = None
    barrier: Callable[[], None] | None = None
    rank: int = 0
    gather: Callable[[Any], list[Any]] | None = None

    def share(self, make: Callable[[], Any]) -> Any:
        """``make()`` as the coordinator computes it, on every rank."""
        value = make() if self.coordinator else None
        return value if self.broadcast is None else self.broadcast(value)

    def gathered(self, mine: Any) -> list[Any]:
        """Every rank's ``mine``, in rank order (this rank's alone without ``gather``)."""
        return [mine] if self.gather is None else self.gather(mine)


def torch_group(process_group: Any = None) -> Group:
    """``process_group`` (default: the default group) as a :class:`Group`; a single process when ``torch.distributed``
    is not initialized or the group has one rank."""
    import sys

    if "torch.distributed" not in sys.modules:
        return Group()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
        return Group()
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=process_group)
        return box[0]

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, obj, group=process_group)
        return out

    rank = dist.get_rank(process_group)
    return Group(coordinator=rank == 0, broadcast=broadcast, barrier=lambda: dist.barrier(group=process_group),
                 rank=rank, gather=gather)
