"""`replay` and the rank it names (the jobs, and what replay may blame: tests/processes/test_replay_verdicts.py).

Which rank a suspected fault is pinned on (DDP on two ranks, and the rule itself), and that without recorded
inputs no cause and no rank is named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.replay_jobs import losses_run, verdict_of

from ckptverify.hardware.inject import BitFlip
from ckptverify.replay.causes import _origin

# ------------------------------------------------------------------------------------ DDP: which rank


@pytest.mark.slow
def test_ddp_a_fault_seen_in_a_rank_own_loss_names_that_rank(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fault = BitFlip(kind="activation", name="fc1", step=5, rank=1, element=5, bit=20)
    verdict = verdict_of(tmp_path, monkeypatch, env={"REPLAY_NOISE": "index", "REPLAY_LOSS": "local"}, nproc=2,
                         fault=fault)
    assert verdict["kind"] == "hardware-fault-suspected", verdict
    # Rank 0 differs too (the averaged gradients), first at metric.grad_norm; only rank 1's own loss differs.
    assert (verdict["step"], verdict["rank"], verdict["site"]) == (5, 1, "metric.loss"), verdict
    assert verdict["candidate_ranks"] == [1]


@pytest.mark.slow
def test_ddp_a_fault_seen_only_in_reduced_values_names_no_rank(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    fault = BitFlip(kind="activation", name="fc1", step=5, rank=1, element=5, bit=20)
    verdict = verdict_of(tmp_path, monkeypatch, env={"REPLAY_NOISE": "index", "REPLAY_LOSS": "reduced"}, nproc=2,
                         fault=fault)
    assert verdict["kind"] == "hardware-fault-suspected" and verdict["step"] == 5, verdict
    assert verdict["rank"] is None and verdict["host"] is None, verdict
    assert verdict["candidate_ranks"] == [0, 1], verdict
    assert "cannot tell which rank" in verdict["message"] and "level module" in verdict["message"]


# ------------------------------------------------------------------------------------ the rank rule


def test_the_origin_rank_is_named_only_when_the_evidence_singles_it_out() -> None:
    every = lambda rank, site: True  # noqa: E731
    # Only rank 1 differs: the others computed the step as the replay did.
    assert _origin({0: [], 1: ["grad.*"]}, 2, every) == ((1,), 1, None)
    # Every rank differs, but only rank 1's own loss does: the rest arrived through the all-reduce.
    assert _origin({0: ["metric.grad_norm", "grad.*"], 1: ["metric.grad_norm", "metric.loss", "grad.*"]}, 2,
                   every) == ((1,), 1, "metric.loss")
    # Every rank differs alike: no rank named, all are candidates.
    assert _origin({0: ["metric.loss", "grad.*"], 1: ["metric.loss", "grad.*"]}, 2, every) == ((0, 1), None, None)
    # A site the other rank does not record singles out nobody.
    only0 = lambda rank, site: not (rank == 1 and site == "metric.aux")  # noqa: E731
    assert _origin({0: ["metric.aux", "grad.*"], 1: ["grad.*"]}, 2, only0) == ((0, 1), None, None)
    # Two of four ranks differ: they are the candidates, neither is named.
    assert _origin({0: [], 1: ["grad.*"], 2: ["grad.*"], 3: []}, 4, every) == ((1, 2), None, None)
    # One rank: it is the one.
    assert _origin({0: ["metric.loss"]}, 1, every) == ((0,), 0, None)
    # A rank whose trace is missing cannot be cleared.
    assert _origin({0: ["grad.*"]}, 2, every) == ((0, 1), None, None)


def test_without_recorded_inputs_a_difference_names_no_cause_and_no_rank(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptverify.replay.causes import judge

    prod = losses_run(tmp_path / "prod", {0: {4: 1.0, 5: 2.0}, 1: {4: 1.5, 5: 2.5}}, 2, monkeypatch, level="metrics")
    rep = losses_run(tmp_path / "rep", {0: {4: 1.0, 5: 2.0}, 1: {4: 1.5, 5: 2.25}}, 2, monkeypatch, level="metrics")
    j = judge(prod, rep, start=3, end=5, world=2, production_start=0)
    # Only rank 1's loss differs, but the inputs of step 5 are not recorded: no hardware verdict.
    assert (j.kind, j.step, j.rank, j.candidate_ranks) == ("undetermined", 5, None, (1,)), j
    assert 'trace="state"' in j.message
    # Steps recorded in one run only, all common steps equal: undetermined, not an error.
    short = losses_run(tmp_path / "short", {0: {4: 1.0}, 1: {4: 1.5}}, 2, monkeypatch, level="metrics")
    j = judge(prod, short, start=3, end=5, world=2, production_start=0)
    assert j.kind == "undetermined" and j.rank is None and "cannot be judged" in j.message, j
