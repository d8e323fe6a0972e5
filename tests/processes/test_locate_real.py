"""The locate analysis on op logs of real runs: the user's DDP script (``user_scripts/locate_ddp_train.py``) on 2
gloo ranks, each run rebuilt from its seeds, logged by a dispatch-mode op logger (``locate_worker.py``). Planted
on rank 0 only: an activation kernel that is nondeterministic by itself; the same kind of difference made in
numpy outside the dispatcher; and nothing (the clean run stays clean)."""

from __future__ import annotations

import pickle

import pytest
from helpers.locate_worker import _load_script, run_logged
from helpers.multiproc import spawn_ranks

from ckptverify.resume.locate.ops import locate
from ckptverify.trace.kernel import rerun

pytestmark = pytest.mark.timeout(900)

STEP = 1
RUNS = 4  # two per side


def _logs(tmp_path, plant: str) -> tuple[dict, dict]:
    spawn_ranks(run_logged, 2, str(tmp_path), plant, RUNS, STEP)
    per_rank = {}
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            per_rank[rank] = pickle.load(f)  # written by this test's own ranks
    half = RUNS // 2
    return ({r: logs[:half] for r, logs in per_rank.items()}, {r: logs[half:] for r, logs in per_rank.items()})


def test_clean_ddp_run_stays_clean(tmp_path):
    a, b = _logs(tmp_path, "")
    assert all(len(run) > 100 for logs in a.values() for run in logs)
    got = locate(a, b, step=STEP, state_equal=True)
    assert got.origin is None and got.receivers == () and got.within_side == (), got.sentence()


def test_nondeterministic_kernel_on_rank_0_and_rank_1_receiving_it_through_the_allreduce(tmp_path):
    a, b = _logs(tmp_path, "noisy-op")
    got = locate(a, b, step=STEP, state_equal=True)
    assert got.origin is not None, got.sentence()
    assert (got.origin.kind, got.origin.rank, got.origin.op, got.origin.phase, got.origin.module) == \
        ("op", 0, "locate_demo.scaled_gelu.default", "forward", "module.block"), got.sentence()
    assert got.origin.repeats_differing == 2
    assert len(got.receivers) == 1, got.sentence()
    r = got.receivers[0]
    assert (r.rank, r.op, r.via.collective, r.via.group, r.via.senders) == \
        (1, "c10d.allreduce_.default", "allreduce_", (0, 1), (0,))
    # Both sides vary run to run, born on rank 0 (rank 1 only receives it).
    assert {(v.side, v.rank) for v in got.within_side} == {("a", 0), ("b", 0)}
    # The last rung: the origin op's inputs captured in one more run, and the op re-run alone on them.
    o = got.origin
    key = (o.step, o.phase, o.module, o.op, o.occurrence)
    spawn_ranks(run_logged, 2, str(tmp_path), "noisy-op", 1, STEP, (0, key))
    _load_script()  # registers the script's custom op in this process, as the re-run needs
    kernel = rerun(tmp_path / "capture.pt", runs=4)
    assert kernel.nondeterministic and kernel.mechanism == "none", kernel.sentence()
    assert "no documented mechanism" in kernel.sentence()
    # The same op on rank 1, where the script calls it without noise, is deterministic alone.
    (tmp_path / "capture.pt").unlink()
    spawn_ranks(run_logged, 2, str(tmp_path), "noisy-op", 1, STEP, (1, key))
    kernel = rerun(tmp_path / "capture.pt", runs=4)
    assert not kernel.nondeterministic, kernel.sentence()


def test_numpy_outside_the_dispatcher_on_rank_0_is_untraced(tmp_path):
    a, b = _logs(tmp_path, "numpy")
    got = locate(a, b, step=STEP, state_equal=True)
    assert got.origin is not None, got.sentence()
    # The numpy array enters the dispatcher as the input of the op that lifts it into a tensor, in module.block,
    # right after the block's linear layer: the difference shows there, one hop after numpy made it.
    assert (got.origin.kind, got.origin.rank, got.origin.module) == ("untraced", 0, "module.block"), got.sentence()
    assert got.last_equal is not None and got.last_equal.module == "module.block.fc", got.sentence()
    assert [(r.rank, r.via.senders) for r in got.receivers] == [(1, (0,))]
    assert "probe the code" in got.sentence()
