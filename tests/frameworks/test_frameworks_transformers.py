"""transformers Trainer ``checkpoint-N`` folders (tiny GPT-2 from a config, CPU, no downloads) judged by ckptverify.

None of these is DCP: each folder is read through its files' own formats (safetensors, torch.save, JSON).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from frameworks import harness as h

pytestmark = pytest.mark.slow  # each framework's producer runs once per session: 15-60 s

hf = h.fixture("transformers")


@pytest.mark.parametrize("name", ["checkpoint-2", "checkpoint-4"])
def test_checkpoint_folder_verifies_clean(hf: h.Built, name: str) -> None:
    # Weights (safetensors) and JSON carry no checksum; optimizer.pt, scheduler.pt, rng_state.pth and
    # training_args.bin are torch.save archives (zip CRC-32) and must be checked.
    h.assert_clean(h.verify(hf.path(name)), uncheckable=("*.safetensors", "*.json"))


def test_flipped_byte_in_weights_after_fingerprint_is_caught(hf: h.Built, tmp_path: Path) -> None:
    ckpt = hf.copy("checkpoint-4", tmp_path / "checkpoint-4")
    adopted = h.fingerprint(ckpt, "--trust-uncheckable")
    assert adopted["exit_code"] == 0, h.describe(adopted)
    tensor = h.flip_in_safetensors(ckpt / "model.safetensors")
    report = h.verify(ckpt)
    assert report["exit_code"] == 1, h.describe(report)
    assert any(f["location"].get("fqn", "").endswith(tensor) for f in h.findings(report, "error")), \
        h.describe(report)


def test_diff_of_two_checkpoints_names_the_weights(hf: h.Built) -> None:
    report = h.diff(hf.path("checkpoint-2"), hf.path("checkpoint-4"))
    assert report["exit_code"] == 1, h.describe(report)
    differing = h.named(report, "diff-tensor")
    assert any(fqn.endswith("transformer.h.0.attn.c_attn.weight") for fqn in differing), h.describe(report)


def test_verify_of_the_output_dir_points_at_scan(hf: h.Built) -> None:
    report = h.verify(hf.path("checkpoint-4").parent)
    assert report["exit_code"] == 2, h.describe(report)
    assert "scan" in report.get("error", ""), h.describe(report)
