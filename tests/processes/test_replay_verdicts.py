"""`replay` names the cause of the first difference between production and two agreeing replays.

A replay whose inputs differ from production's (the batch, a random stream, a hyperparameter, the restored
state) says nothing about the hardware; hardware is suspected only when the inputs of a step are equal and a
computed value differs, and a rank is named only when the evidence singles it out. The jobs are the user
scripts in `tests/user_scripts/replay_*.py` (own Dataset, DataLoader with two workers and noise augmentation,
AdamW, OneCycleLR, gradient clipping, dropout, an EMA; DDP on two ranks), started as users start them
(tests/helpers/replay_jobs.py).

Here: noise in the data pipeline is data or nondeterminism, never hardware. A real fault, and the input causes
planted before it, are in tests/processes/test_replay_planted_causes.py; which rank is named, in
tests/processes/test_replay_ranks.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.replay_jobs import SCRIPTS, not_hardware, verdict_of

# ------------------------------------------------------------------------------------ inputs, not hardware


@pytest.mark.slow
def test_worker_noise_of_a_dataset_defined_in_the_script_is_never_blamed_on_the_hardware(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = verdict_of(tmp_path, monkeypatch, env={}, script=SCRIPTS / "replay_noisy.py")
    not_hardware(verdict)
    # Reproduced once the workers' augmentation resumes exactly; until then the batch is named as the cause.
    assert verdict["kind"] in ("data", "reproduced"), verdict
    if verdict["kind"] == "data":
        assert (verdict["step"], verdict["rank"]) == (4, 0) and verdict["site"].startswith("batch")
        assert "nothing about the hardware" in verdict["message"]


@pytest.mark.slow
def test_worker_noise_is_a_data_cause_at_the_first_replayed_step(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = verdict_of(tmp_path, monkeypatch, env={"REPLAY_NOISE": "worker"})
    not_hardware(verdict)
    assert verdict["kind"] in ("data", "reproduced"), verdict
    if verdict["kind"] == "data":
        assert (verdict["step"], verdict["rank"], verdict["site"]) == (4, 0, "batch.0"), verdict
        # The loader's position is equal: the samples themselves differ, which points at the augmentation.
        assert "samples at the same position differ" in verdict["message"], verdict
        assert verdict["candidate_ranks"] is None


@pytest.mark.slow
def test_noise_no_seed_fixes_is_nondeterminism_of_the_data_pipeline(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = verdict_of(tmp_path, monkeypatch, env={"REPLAY_NOISE": "urandom"})
    not_hardware(verdict)
    assert verdict["kind"] == "nondeterministic" and verdict["step"] == 4, verdict
    assert verdict["site"].startswith("batch") and "data pipeline" in verdict["message"], verdict


@pytest.mark.slow
def test_a_trace_without_inputs_cannot_tell_data_from_a_fault(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = verdict_of(tmp_path, monkeypatch, env={"REPLAY_NOISE": "worker"}, trace="metrics")
    not_hardware(verdict)
    assert verdict["kind"] in ("undetermined", "reproduced"), verdict
    if verdict["kind"] == "undetermined":
        assert verdict["step"] == 4 and verdict["rank"] is None and verdict["candidate_ranks"] == [0]
        assert 'trace="state"' in verdict["message"]
