"""torchtitan 0.3 ``CheckpointManager`` checkpoints (FSDP2, 2 ranks and a 1-rank reshard), judged by ckptverify."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import faults as inj

from frameworks import harness as h

pytestmark = pytest.mark.slow  # each framework's producer runs once per session: 15-60 s

titan = h.fixture("torchtitan")


@pytest.mark.parametrize("name", ["ws2-step2", "ws2-step4", "ws1-step4"])
def test_every_step_folder_verifies_clean(titan: h.Built, name: str) -> None:
    h.assert_clean(h.verify(titan.path(name)))


def test_flipped_payload_bit_is_caught_and_localized(titan: h.Built, tmp_path: Path) -> None:
    ckpt = titan.copy("ws2-step4", tmp_path / "step-4")
    fault = inj.flip_in_tensor_payload(ckpt)
    h.assert_flip_localized(h.verify(ckpt), fault)


def test_diff_of_two_steps_names_every_trained_tensor(titan: h.Built) -> None:
    report = h.diff(titan.path("ws2-step2"), titan.path("ws2-step4"))
    assert report["exit_code"] == 1, h.describe(report)
    # Every tensor moves between steps 2 and 4: parameters, AdamW moments and step counts, the train state.
    assert h.named(report, "diff-tensor") == h.tensor_fqns(titan.path("ws2-step4"))
    assert "lr_scheduler.last_epoch" in h.named(report, "diff-value")


def test_diff_of_one_rank_and_two_rank_saves_of_the_same_state_passes(titan: h.Built) -> None:
    report = h.diff(titan.path("ws2-step4"), titan.path("ws1-step4"))
    assert report["exit_code"] == 0, h.describe(report)
    assert h.covered(report, "diff-tensor") == len(h.tensor_fqns(titan.path("ws1-step4")))


def test_verify_of_the_run_directory_points_at_scan(titan: h.Built) -> None:
    report = h.verify(titan.path("ws2-step4").parent)
    assert report["exit_code"] == 2, h.describe(report)
    assert "scan" in report.get("error", ""), h.describe(report)
