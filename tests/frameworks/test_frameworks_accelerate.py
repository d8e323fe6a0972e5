"""accelerate 1.15 checkpoints judged by ckptverify: ``save_fsdp_model``/``save_fsdp_optimizer`` DCP folders (2 ranks
and resharded to 1) and ``Accelerator.save_state`` folders (safetensors + torch.save + pickled RNG states)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import faults as inj

from frameworks import harness as h

pytestmark = pytest.mark.slow  # each framework's producer runs once per session: 15-60 s

acc = h.fixture("accelerate")

DCP = [f"ws{ws}-{what}-step{s}" for ws, steps in ((2, (2, 4)), (1, (4,))) for s in steps
       for what in ("model", "optimizer")]


@pytest.mark.parametrize("name", DCP)
def test_fsdp_dcp_folder_verifies_clean(acc: h.Built, name: str) -> None:
    h.assert_clean(h.verify(acc.path(name)))


@pytest.mark.parametrize("what", ["model", "optimizer"])
def test_flipped_payload_bit_is_caught_and_localized(acc: h.Built, tmp_path: Path, what: str) -> None:
    ckpt = acc.copy(f"ws2-{what}-step4", tmp_path / what)
    fault = inj.flip_in_tensor_payload(ckpt)
    h.assert_flip_localized(h.verify(ckpt), fault)


@pytest.mark.parametrize("what", ["model", "optimizer"])
def test_diff_of_two_steps_names_every_trained_tensor(acc: h.Built, what: str) -> None:
    report = h.diff(acc.path(f"ws2-{what}-step2"), acc.path(f"ws2-{what}-step4"))
    assert report["exit_code"] == 1, h.describe(report)
    assert h.named(report, "diff-tensor") == h.tensor_fqns(acc.path(f"ws2-{what}-step4"))


@pytest.mark.parametrize("what", ["model", "optimizer"])
def test_diff_of_one_rank_and_two_rank_saves_of_the_same_state_passes(acc: h.Built, what: str) -> None:
    report = h.diff(acc.path(f"ws2-{what}-step4"), acc.path(f"ws1-{what}-step4"))
    assert report["exit_code"] == 0, h.describe(report)
    assert h.covered(report, "diff-tensor") == len(h.tensor_fqns(acc.path(f"ws1-{what}-step4")))


# ---- Accelerator.save_state folders -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["state-step2", "state-step4"])
def test_save_state_folder_verifies_clean(acc: h.Built, name: str) -> None:
    # model.safetensors and the pickled RNG states carry no checksum; optimizer.bin and scheduler.bin are
    # torch.save archives (zip CRC-32) and must be checked.
    h.assert_clean(h.verify(acc.path(name)), uncheckable=("*.safetensors", "random_states_*.pkl"))


@pytest.mark.parametrize("file", ["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_1.pkl"])
def test_flipped_byte_in_save_state_file_after_fingerprint_is_caught(acc: h.Built, tmp_path: Path,
                                                                     file: str) -> None:
    ckpt = acc.copy("state-step4", tmp_path / "state")
    adopted = h.fingerprint(ckpt, "--trust-uncheckable")
    assert adopted["exit_code"] == 0, h.describe(adopted)
    if file.endswith(".safetensors"):
        h.flip_in_safetensors(ckpt / file)
    elif file.endswith(".bin"):
        h.flip_in_zip_member(ckpt / file)
    else:
        h.flip_middle_byte(ckpt / file)
    report = h.verify(ckpt)
    assert report["exit_code"] == 1, h.describe(report)
    assert any(f["location"].get("file") == file for f in h.findings(report, "error")), h.describe(report)


def test_diff_of_two_save_states_names_the_weights(acc: h.Built) -> None:
    report = h.diff(acc.path("state-step2"), acc.path("state-step4"))
    assert report["exit_code"] == 1, h.describe(report)
    differing = h.named(report, "diff-tensor")
    for weight in ("0.weight", "4.bias"):  # model.safetensors names; optimizer.bin's moments may follow
        assert any(fqn.endswith(weight) for fqn in differing), h.describe(report)
