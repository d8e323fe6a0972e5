"""`replay` on a real fault and on the input causes planted before it (the jobs, and what replay may blame:
tests/processes/test_replay_verdicts.py).

A flipped activation with equal inputs is a suspected fault of its rank, and each input cause planted before
that same fault is named as that cause, not as the hardware.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.replay_jobs import FAULT, not_hardware, verdict_of

# ------------------------------------------------------------------------------------ a real fault


@pytest.mark.slow
def test_a_flipped_activation_with_equal_inputs_is_a_suspected_fault_of_its_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = verdict_of(tmp_path, monkeypatch, env={"REPLAY_NOISE": "index"}, fault=FAULT)
    assert verdict["kind"] == "hardware-fault-suspected", verdict
    assert (verdict["step"], verdict["rank"], verdict["candidate_ranks"]) == (5, 0, [0]), verdict
    assert verdict["site"].startswith("metric.") and verdict["host"], verdict
    assert "agreed" not in verdict["message"] and "other ranks" not in verdict["message"]  # a job of one rank


@pytest.mark.slow
@pytest.mark.parametrize(("plant", "kind", "step", "site"), [
    ("data", "data", 4, "batch.0"),                        # the loader is not in the TrainState
    ("rng", "rng", 4, "rng.torch_cpu"),                    # re-seeded after run.restore
    ("scheduler", "scheduler", 4, "metric.lr"),            # OneCycleLR not in the TrainState
    ("buffer", "hidden-state", 4, "buffer.calls"),         # a persistent=False buffer drives the forward
    ("restore", "restore-mismatch", 4, None),              # a load_state_dict that drops what it is given
])
def test_an_input_cause_before_a_real_fault_is_named_as_that_cause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plant: str, kind: str, step: int, site: str) -> None:
    """The same fault as above is planted at step 5; the planted cause shows first and is what is named."""
    verdict = verdict_of(tmp_path, monkeypatch, env={"REPLAY_NOISE": "index", "REPLAY_PLANT": plant}, fault=FAULT)
    not_hardware(verdict)
    assert (verdict["kind"], verdict["step"]) == (kind, step), verdict
    assert site is None or verdict["site"] == site, verdict
    assert "nothing about the hardware" in verdict["message"]
