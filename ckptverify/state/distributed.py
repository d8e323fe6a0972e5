"""Where this process stands in ``torch.distributed``: one lookup shared by every module that needs it."""

from __future__ import annotations

import os


def rank_world(*, env_fallback: bool = False) -> tuple[int, int]:
    """``(rank, world_size)`` of the initialized default group, else (with ``env_fallback``) ``RANK``/``WORLD_SIZE``
    from the environment, else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if env_fallback:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return 0, 1
