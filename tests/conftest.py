"""Shared fixtures: real DCP checkpoints, built once per session, handed out as fresh copies.

``tests/`` is put on ``sys.path`` so test modules import the shared helpers as ``from helpers import ...``
(``tests/helpers/``: starting ranks, planting faults, building checkpoints); so is each folder of test files
(``unit``, ``processes``, ``fuzz``, ``gpu``; ``frameworks`` is a package), so that one test module imports
another by its basename.

Hypothesis runs under the ``ci`` profile unless ``HYPOTHESIS_PROFILE`` names another: the same examples every
run (derandomized, no example database), so CI and the README's test command are steady; no deadline (a
loaded machine is slow, not wrong); a failure prints the blob that reproduces it. ``HYPOTHESIS_PROFILE=dev``
explores new examples and keeps failures in the local database. Each test's own ``@settings`` still sets its
example count.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# One intra-op thread for torch in each test worker and in every process it starts (set before torch is imported):
# the suite runs one worker per core, and torch's default (a thread per core, spinning between small ops) made two
# workers on two cores fight over them, costing several times the CPU of the work itself. Tests about thread
# counts set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Bytecode caching on for the workers and every process they start, where the environment turned it off
# (PYTHONDONTWRITEBYTECODE): otherwise each of the suite's few hundred processes compiles the package from source.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# tests/ for the shared modules, and each folder of test files, so that a test module imports another by its
# basename wherever the two are and whichever file pytest was given (basenames are unique across folders).
TESTS_DIR = Path(__file__).resolve().parent
for folder in (TESTS_DIR, *(TESTS_DIR / kind for kind in ("unit", "processes", "fuzz", "gpu"))):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from helpers import ckpt_factory  # noqa: E402

# Every event ckptverify writes in a test, in this process or a job it starts, must read back (events.py).
os.environ["CKPTVERIFY_STRICT_EVENTS"] = "1"

# The files whose tests take longest, longest first (seconds summed per file, measured on the 2-core machine:
# 100 down to 25). They start first so that no long file is left for the end of a parallel run, when the other
# worker has nothing left to do; every other file follows in collection order. Only the order depends on this.
# The README's command passes --no-loadscope-reorder, which keeps xdist from re-sorting files by test count.
START_FIRST = (
    "test_cluster_verify.py", "test_diagnosis.py", "test_production_resume.py", "test_production.py",
    "test_gpu_scripts.py", "test_replay_planted_causes.py", "test_parts_among_nodes.py",
    "test_harness_user_script.py", "test_save_commit.py", "test_bench_items.py", "test_replay_verdicts.py",
    "test_verdict_ranks_ddp.py", "test_ladder.py", "test_integrations_torchtitan.py", "test_replay_ranks.py",
    "test_verify_faults.py", "test_remote_verify.py", "test_cli_json_user_output.py", "test_fingerprint.py",
    "test_cluster_commands.py", "test_parts_torchrun_job.py", "test_integrations_accelerate.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(START_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


def pytest_collection_finish(session: pytest.Session) -> None:
    # What collection imported (torch, the frameworks, ckptverify, the test modules) lives for the whole session:
    # out of the collector's sight, the automatic full collections during tests walk the tests' own objects, not
    # hundreds of thousands of torch's.
    gc.freeze()


settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")


class CheckpointStore:
    """Clean checkpoints of every layout, each built at most once, on first request.

    The sources are never handed to tests directly; use :meth:`copy` (or the ``fresh_ckpt`` fixture).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}

    def source(self, layout: str) -> Path:
        if layout not in ckpt_factory.LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}")
        if layout == "safetensors" and not ckpt_factory.safetensors_supported():
            pytest.skip("this torch cannot write the safetensors layout")
        if layout not in self._built:
            if layout in ckpt_factory.MULTI_RANK:
                # Both two-rank layouts come from one pair of processes: spawning is the slow part.
                todo = tuple(lay for lay in sorted(ckpt_factory.MULTI_RANK) if lay not in self._built)
            else:
                todo = (layout,)
            self._built.update(ckpt_factory.build_all(self.root, todo))
        return self._built[layout]

    def copy(self, layout: str, dst: Path) -> Path:
        return ckpt_factory.copy_checkpoint(self.source(layout), dst)


@pytest.fixture(scope="session")
def ckpt_store(tmp_path_factory: pytest.TempPathFactory) -> CheckpointStore:
    return CheckpointStore(tmp_path_factory.mktemp("ckpt-sources"))


@pytest.fixture
def fresh_ckpt(ckpt_store: CheckpointStore, tmp_path: Path) -> Callable[..., Path]:
    """``fresh_ckpt(layout, name=None)``: a private, writable copy of a clean checkpoint."""
    counter = iter(range(1_000_000))

    def make(layout: str, name: str | None = None) -> Path:
        return ckpt_store.copy(layout, tmp_path / (name or f"{layout}-{next(counter)}"))

    return make


@pytest.fixture
def queue(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh process-wide background verifier (short settle time), closed after the test."""
    from ckptverify.verifier import background

    fresh = background.BackgroundVerifier(settle=0.05)
    monkeypatch.setattr(background, "_default", fresh)
    yield fresh
    fresh.before_verify = None
    fresh.close(timeout=60)
