"""Training functions for ``resume-check``: the language-model trainer of ``tests/user_scripts/llm_stream_train.py``
with one bug planted, named by the function (``train_<plant>_<ranks>_<parallel>``).

The trainer reads its bug from ``PLANT``, ``PLANT_RANKS`` and ``PARALLEL``, module globals set from the environment
when it is imported. A rank runs every job of a launch in one process (see ``ckptverify.resume.launch``), so these
functions set the globals before each call instead: several planted jobs then share one launch per run, each with
its own bug, checkpoints, traces and verdict. ``run`` is handed on untouched: the TrainState, its ``run.restore``
and the variables the harness reads are the trainer's own, in its own frame.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[1] / "user_scripts" / "llm_stream_train.py"
PLANTS = ("", "rng", "data", "scheduler", "held", "restore", "accum", "replaced-loader", "noisy")


def _trainer() -> Any:
    module = sys.modules.get("llm_stream_train")
    if module is None:
        spec = importlib.util.spec_from_file_location("llm_stream_train", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["llm_stream_train"] = module
        spec.loader.exec_module(module)
    return module


def name(plant: str, ranks: str, parallel: str) -> str:
    """The function of this module that runs the trainer with ``plant`` on ``ranks`` under ``parallel``."""
    return f"train_{(plant or 'clean').replace('-', '_')}_{ranks}_{parallel}"


def _planted(plant: str, ranks: str, parallel: str) -> Any:
    def train(run: Any) -> None:
        trainer = _trainer()
        trainer.PLANT, trainer.PLANT_RANKS, trainer.PARALLEL = plant, ranks, parallel
        trainer.train(run)

    train.__name__ = train.__qualname__ = name(plant, ranks, parallel)
    return train


for _plant in PLANTS:
    for _ranks in ("1", "all"):
        for _parallel in ("ddp", "fsdp2"):
            globals()[name(_plant, _ranks, _parallel)] = _planted(_plant, _ranks, _parallel)
