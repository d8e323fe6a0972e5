"""PyTorch Lightning 2.6 checkpoints judged by ckptverify: ``ModelParallelStrategy`` (FSDP2) DCP folders with
``meta.pt``, on 2 ranks and resharded to 1, and the default strategy's single-file ``.ckpt``."""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

import pytest
from helpers import faults as inj
from helpers.multiproc import spawn_ranks

from frameworks import harness as h

pytestmark = pytest.mark.slow  # the producer's jobs run once for this module: 15-60 s


def _two_rank_job(rank: int, world: int, out: str) -> None:
    from frameworks import produce_lightning

    produce_lightning.stage_ws2(Path(out))


def _one_rank_jobs(rank: int, world: int, out: str) -> None:
    from frameworks import produce_lightning

    produce_lightning.stage_ws1(Path(out))
    produce_lightning.stage_plain(Path(out))


@pytest.fixture(scope="module")
def lightning(tmp_path_factory: pytest.TempPathFactory) -> h.Built:
    """``tests/frameworks/produce_lightning.py``'s checkpoints, written by its own stages, each in ranks of its own
    (never in pytest): the 2-rank job, then the 1-rank jobs (the resharded resume, then the default strategy's),
    forked from the fork server with torchrun's environment rather than a fresh interpreter per stage and rank
    (Lightning takes the group it finds and starts no processes of its own). What the script's ``main`` writes to
    ``produced.json`` is the map below."""
    try:
        importlib.metadata.version("pytorch-lightning")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"pytorch-lightning is not installed: {h.INSTALL_HINT}")
    out = tmp_path_factory.mktemp("frameworks") / "lightning"
    out.mkdir()
    start = time.monotonic()
    spawn_ranks(_two_rank_job, 2, str(out), launcher_env=True)
    spawn_ranks(_one_rank_jobs, 1, str(out), launcher_env=True)
    produced = {
        "ws2-step2": {"path": "ws2/checkpoints/step=2.ckpt", "world_size": 2, "step": 2},
        "ws2-step4": {"path": "ws2/checkpoints/step=4.ckpt", "world_size": 2, "step": 4},
        "ws1-step4": {"path": "ws1/checkpoints/step=4.ckpt", "world_size": 1, "step": 4},
        "plain-step2": {"path": "plain/checkpoints/step=2.ckpt", "world_size": 1, "step": 2},
        "plain-step4": {"path": "plain/checkpoints/step=4.ckpt", "world_size": 1, "step": 4},
    }
    from frameworks._launch import write_produced

    write_produced(out, produced)  # fails if a checkpoint was not written
    return h.Built("lightning", out, time.monotonic() - start, json.loads((out / "produced.json").read_text()))

DCP = ["ws2-step2", "ws2-step4", "ws1-step4"]


@pytest.mark.parametrize("name", DCP)
def test_dcp_folder_verifies_with_no_error(lightning: h.Built, name: str) -> None:
    report = h.verify(lightning.path(name))
    assert report["exit_code"] == 0, h.describe(report)
    assert not h.findings(report, "error"), h.describe(report)
    assert h.covered(report, "zip-crc") > 0


@pytest.mark.parametrize("name", DCP)
def test_dcp_folder_verifies_clean_with_meta_pt(lightning: h.Built, name: str) -> None:
    h.assert_clean(h.verify(lightning.path(name)))


def test_flipped_payload_bit_is_caught_and_localized(lightning: h.Built, tmp_path: Path) -> None:
    ckpt = lightning.copy("ws2-step4", tmp_path / "step=4.ckpt")
    fault = inj.flip_in_tensor_payload(ckpt)
    h.assert_flip_localized(h.verify(ckpt), fault)


def test_flipped_byte_in_meta_pt_after_fingerprint_is_caught(lightning: h.Built, tmp_path: Path) -> None:
    ckpt = lightning.copy("ws2-step4", tmp_path / "step=4.ckpt")
    adopted = h.fingerprint(ckpt)
    assert adopted["exit_code"] == 0, h.describe(adopted)
    h.flip_in_zip_member(ckpt / "meta.pt")
    report = h.verify(ckpt)
    assert report["exit_code"] == 1, h.describe(report)
    assert any(f["location"].get("file") == "meta.pt" for f in h.findings(report, "error")), h.describe(report)


def test_diff_of_two_steps_names_every_trained_tensor(lightning: h.Built) -> None:
    report = h.diff(lightning.path("ws2-step2"), lightning.path("ws2-step4"))
    assert report["exit_code"] == 1, h.describe(report)
    assert h.named(report, "diff-tensor") == h.tensor_fqns(lightning.path("ws2-step4"))


def test_diff_of_one_rank_and_two_rank_saves_of_the_same_state_passes(lightning: h.Built) -> None:
    # meta.pt's values are compared too; the 1-rank job saved with `save_checkpoint`, outside the
    # ModelCheckpoint callback, so only the 2-rank save holds the callback's state: ignored by name.
    report = h.cli("diff", lightning.path("ws2-step4"), lightning.path("ws1-step4"), "--no-progress",
                   "--ignore", "meta.pt:callbacks.*")
    assert report["exit_code"] == 0, h.describe(report)
    assert h.covered(report, "diff-tensor") == len(h.tensor_fqns(lightning.path("ws1-step4")))


def test_diff_of_two_steps_compares_meta_pt(lightning: h.Built) -> None:
    report = h.diff(lightning.path("ws2-step2"), lightning.path("ws2-step4"))
    assert any("global_step" in fqn for fqn in h.named(report, "diff-value") | h.named(report, "diff-tensor")), \
        h.describe(report)


# ---- the default strategy's single .ckpt file (a torch.save archive) --------------------------------------


@pytest.mark.parametrize("name", ["plain-step2", "plain-step4"])
def test_plain_ckpt_file_verifies_clean(lightning: h.Built, name: str) -> None:
    h.assert_clean(h.verify(lightning.path(name)))


def test_flipped_byte_in_plain_ckpt_file_is_caught(lightning: h.Built, tmp_path: Path) -> None:
    ckpt = lightning.copy("plain-step4", tmp_path / "step=4.ckpt")
    record = h.flip_in_zip_member(ckpt)
    report = h.verify(ckpt)
    assert report["exit_code"] == 1, h.describe(report)
    assert any(record in str(f["location"]) for f in h.findings(report, "error")), h.describe(report)


def test_diff_of_two_plain_ckpt_files_names_the_weights(lightning: h.Built) -> None:
    report = h.diff(lightning.path("plain-step2"), lightning.path("plain-step4"))
    assert report["exit_code"] == 1, h.describe(report)
    differing = h.named(report, "diff-tensor")
    for weight in ("net.0.weight", "net.4.bias"):  # under the archive's "state_dict"; optimizer moments too
        assert any(fqn.endswith(weight) for fqn in differing), h.describe(report)
