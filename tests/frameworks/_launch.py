"""What every producer script shares: a fresh gloo group of N CPU ranks, and the report it prints.

Producers run as their own processes (``python tests/frameworks/produce_X.py OUT``), never inside pytest, so a
framework's import side effects, logging setup and process groups stay out of the test process. Each writes
its checkpoints under ``OUT`` and ends by writing ``OUT/produced.json``: a map from a checkpoint's name (what
the tests ask for) to its path relative to ``OUT``, plus what the producer knows about it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the shared helpers
from helpers.multiproc import spawn_ranks


def spawn(world: int, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` CPU ranks joined by a gloo group, with the environment
    torchrun gives (``RANK``, ``WORLD_SIZE``, ...); raise if any fails."""
    spawn_ranks(fn, world, *args, launcher_env=True)


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
