"""What every producer script shares: a fresh gloo group of N CPU ranks, and the report it prints.

Producers run as their own processes (``python tests/frameworks/produce_X.py OUT``), never inside pytest, so a
framework's import side effects, logging setup and process groups stay out of the test process. Each writes
its checkpoints under ``OUT`` and ends by writing ``OUT/produced.json``: a map from a checkpoint's name (what
the tests ask for) to its path relative to ``OUT``, plus what the producer knows about it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Only after success: leave without interpreter teardown, which can abort around the gloo threads a
    # destroyed group leaves alive (see tests/dist_exit.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world: int, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` CPU ranks joined by a gloo group; raise if any fails."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True)


def write_produced(out: Path, produced: dict[str, dict[str, Any]]) -> None:
    for name, entry in produced.items():
        if not (out / entry["path"]).exists():
            raise SystemExit(f"producer bug: {name} -> {entry['path']} was not written")
    (out / "produced.json").write_text(json.dumps(produced, indent=2, sort_keys=True))


def out_dir() -> Path:
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} OUT_DIR")
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out
