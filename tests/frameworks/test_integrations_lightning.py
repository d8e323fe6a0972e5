"""ckptverify's Lightning callback (``VerifyCheckpointsCallback``) in real ``pytorch_lightning`` training runs on CPU.

The single device runs (``.ckpt`` files) run in this process; the ``ModelParallelStrategy`` runs (DCP folders
with ``meta.pt``) run ``tests/frameworks/lightning_integration.py``'s model in ranks of their own
(``tests/helpers/lightning_model_parallel.py``), because a distributed strategy sets up a process group.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

pl = pytest.importorskip("pytorch_lightning", reason="pip install -e '.[lightning]' (see docs/integrations.md)")

import torch  # noqa: E402
from helpers.lightning_model_parallel import save_flip_resume  # noqa: E402
from helpers.multiproc import spawn_ranks  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ckptverify.audit.adopt import file_manifest_path  # noqa: E402
from ckptverify.errors import CheckpointRefusedError, VerifyFailedWarning  # noqa: E402
from ckptverify.integrations.lightning import VerifyCheckpointsCallback  # noqa: E402
from ckptverify.options import VerifyOptions  # noqa: E402
from ckptverify.ownfiles.events import read_events  # noqa: E402
from ckptverify.runs.stamp import read_stamp, stamp_path  # noqa: E402
from ckptverify.verifier import background  # noqa: E402
from ckptverify.verifier.background import BackgroundVerifier  # noqa: E402
from frameworks import harness as h  # noqa: E402

RAISE = VerifyOptions(on_failure="raise")
BACKGROUND_RAISE = VerifyOptions(when="background", on_failure="raise")


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        return DataLoader(TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)),
                          batch_size=4)


class DamagingIO(TorchCheckpointIO):
    """Writes like Lightning's own plugin, then flips one bit of the file saved at ``step``: storage that
    corrupts what it is given."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        if checkpoint["global_step"] == self.step:
            h.flip_in_zip_member(Path(path))


def fit(out: Path, callback: VerifyCheckpointsCallback, *, max_steps: int = 4, ckpt_path: Path | None = None,
        model: Regressor | None = None, top_k: int = -1, plugins: list[Any] | None = None) -> tuple[Any, list[str]]:
    """Train with ``ModelCheckpoint`` every 2 steps into ``out``; return the trainer and ckptverify's warnings."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out, plugins=plugins,
                         callbacks=[ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=2,
                                                    save_top_k=top_k), callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model or Regressor(), ckpt_path=ckpt_path)
    return trainer, ours(caught)


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    """Warnings ckptverify raised (see harness.ckptverify_warnings)."""
    return h.ckptverify_warnings(caught)


def events(out: Path, name: str) -> list[dict[str, Any]]:
    return list(read_events(out, name))


def test_every_saved_checkpoint_carries_a_current_passed_stamp_and_no_warning(tmp_path: Path) -> None:
    verify = VerifyCheckpointsCallback()
    _, warned = fit(tmp_path, verify)
    assert warned == []
    for step in (2, 4):
        ckpt = tmp_path / f"step={step}.ckpt"
        stamp = read_stamp(ckpt)
        assert stamp is not None and stamp.passed and stamp.current, stamp
        assert stamp.step == step
        assert stamp.data["bytes_checked"] == ckpt.stat().st_size
        # every byte of a .ckpt is under a CRC-32: no manifest unless asked (fingerprint=True)
        assert not stamp.data["manifest"] and not os.path.exists(file_manifest_path(str(ckpt)))
    assert [v.path for v in verify.verdicts] == [str(tmp_path / "step=2.ckpt"), str(tmp_path / "step=4.ckpt")]
    for verdict in verify.verdicts:
        crc = [c for c in verdict.coverage if c["check"] == "zip-crc"]
        assert crc and crc[0]["count"] > 10, verdict.coverage  # every record of the file was checked
    assert len(events(tmp_path, "checkpoint-verified")) == 2
    assert events(tmp_path, "checkpoint-failed") == []


def test_a_checkpoint_damaged_on_its_way_to_disk_gets_a_failed_stamp_a_warning_and_an_event(tmp_path: Path) -> None:
    verify = VerifyCheckpointsCallback()
    _, warned = fit(tmp_path, verify, plugins=[DamagingIO(step=2)])
    assert len(warned) == 1 and "step=2.ckpt" in warned[0] and "zip-crc" in warned[0], warned
    bad, good = read_stamp(tmp_path / "step=2.ckpt"), read_stamp(tmp_path / "step=4.ckpt")
    assert bad is not None and not bad.passed and bad.current
    assert bad.data["errors"][0]["check"] == "zip-crc"
    assert good is not None and good.passed
    (failed,) = events(tmp_path, "checkpoint-failed")
    assert failed["path"] == str(tmp_path / "step=2.ckpt") and failed["step"] == 2
    assert failed["errors"][0]["location"]["file"] == "step=2.ckpt"


def test_on_failure_raise_stops_training_at_the_damaged_save(tmp_path: Path) -> None:
    with pytest.raises(CheckpointRefusedError, match=r"step=2\.ckpt fails verification"):
        fit(tmp_path, VerifyCheckpointsCallback(verify=RAISE), plugins=[DamagingIO(step=2)])
    assert not (tmp_path / "step=4.ckpt").exists()  # no training past the damaged save


def test_resume_from_a_flipped_checkpoint_is_refused_before_any_state_is_loaded(tmp_path: Path) -> None:
    fit(tmp_path, VerifyCheckpointsCallback())
    member = h.flip_in_zip_member(tmp_path / "step=2.ckpt")
    assert read_stamp(tmp_path / "step=2.ckpt").current is False  # type: ignore[union-attr]  # rewritten since
    model = Regressor()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = None
    with pytest.raises(CheckpointRefusedError, match=r"refusing to resume: .*step=2\.ckpt fails verification") as exc:
        trainer, _ = fit(tmp_path / "resumed", VerifyCheckpointsCallback(), model=model,
                         ckpt_path=tmp_path / "step=2.ckpt")
    assert member.split("/")[-1] in str(exc.value)  # the damaged record is named
    assert trainer is None
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))  # nothing loaded
    (refused,) = events(tmp_path, "resume-refused")
    assert refused["path"] == str(tmp_path / "step=2.ckpt")


def test_resume_from_a_clean_checkpoint_continues_and_stamps_what_it_saves(tmp_path: Path) -> None:
    fit(tmp_path, VerifyCheckpointsCallback())
    out = tmp_path / "resumed"
    verify = VerifyCheckpointsCallback()
    trainer, warned = fit(out, verify, max_steps=6, ckpt_path=tmp_path / "step=2.ckpt")
    assert warned == []
    assert trainer.global_step == 6
    assert [v.step for v in verify.verdicts] == [4, 6] and all(v.passed for v in verify.verdicts)
    (resumed,) = events(tmp_path, "resume-verified")
    assert resumed["bytes_checked"] == (tmp_path / "step=2.ckpt").stat().st_size


def test_async_checkpoint_io_is_checked_after_the_file_is_written(tmp_path: Path) -> None:
    verify = VerifyCheckpointsCallback()
    _, warned = fit(tmp_path, verify, plugins=[AsyncCheckpointIO()])
    assert warned == []  # a file still being written would fail: none was read early
    assert sorted(v.step for v in verify.verdicts) == [2, 4]
    for step in (2, 4):
        stamp = read_stamp(tmp_path / f"step={step}.ckpt")
        assert stamp is not None and stamp.passed and stamp.current


def test_async_checkpoint_io_damage_is_caught_in_the_writing_thread(tmp_path: Path) -> None:
    verify = VerifyCheckpointsCallback()
    _, warned = fit(tmp_path, verify, plugins=[AsyncCheckpointIO(DamagingIO(step=4))])
    assert len(warned) == 1 and "step=4.ckpt" in warned[0], warned
    stamp = read_stamp(tmp_path / "step=4.ckpt")
    assert stamp is not None and not stamp.passed


def test_top_k_retention_removes_the_stamp_and_manifest_beside_a_removed_checkpoint(tmp_path: Path) -> None:
    verify = VerifyCheckpointsCallback(fingerprint=True)
    fit(tmp_path, verify, top_k=1)
    assert [v.manifest for v in verify.verdicts] == [True, True]  # checked against the manifest beside
    assert os.path.isfile(file_manifest_path(str(tmp_path / "step=4.ckpt")))
    assert not (tmp_path / "step=2.ckpt").exists()
    assert not os.path.exists(stamp_path(tmp_path / "step=2.ckpt"))
    assert not os.path.exists(file_manifest_path(str(tmp_path / "step=2.ckpt")))
    assert read_stamp(tmp_path / "step=4.ckpt").passed  # type: ignore[union-attr]


def test_the_strategy_is_left_as_it_was_after_fit_and_after_a_refused_resume(tmp_path: Path) -> None:
    trainer, _ = fit(tmp_path, VerifyCheckpointsCallback())
    for name in ("save_checkpoint", "load_checkpoint", "remove_checkpoint"):
        assert name not in vars(trainer.strategy), name
    (tmp_path / "not-a-checkpoint.ckpt").write_bytes(b"junk")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[VerifyCheckpointsCallback()])
    with pytest.raises(CheckpointRefusedError, match=r"not-a-checkpoint\.ckpt"):
        trainer.fit(Regressor(), ckpt_path=tmp_path / "not-a-checkpoint.ckpt")
    for name in ("save_checkpoint", "load_checkpoint", "remove_checkpoint"):
        assert name not in vars(trainer.strategy), name


# -- verify="background": the save returns at once; the verdict comes from the background verifier


class WaitForBackground(pl.Callback):
    """Before the save of ``step``, wait until the background verifier has finished what is queued: the
    earlier save's verdict is in by then, as it would be in a run whose steps take longer than a verification."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step - 1:
            assert background.wait_for_verifications(timeout=120)


def test_background_saves_are_stamped_once_fit_ends_with_no_warning(tmp_path: Path,
                                                                    queue: BackgroundVerifier) -> None:
    verify = VerifyCheckpointsCallback(verify="background")
    _, warned = fit(tmp_path, verify)
    assert warned == [] and queue.pending() == []
    for step in (2, 4):
        ckpt = tmp_path / f"step={step}.ckpt"
        stamp = read_stamp(ckpt)
        assert stamp is not None and stamp.passed and stamp.current and stamp.step == step, stamp
        assert stamp.data["bytes_checked"] == ckpt.stat().st_size
        assert not os.path.exists(file_manifest_path(str(ckpt)))  # all under CRC-32s: nothing fingerprinted
    assert [(v.step, v.passed, v.pending) for v in verify.verdicts] == [(2, True, False), (4, True, False)]
    assert all(sum(c["count"] for c in v.coverage if c["check"] == "zip-crc") > 10 for v in verify.verdicts)
    assert [e["step"] for e in events(tmp_path, "checkpoint-verified")] == [2, 4]
    assert events(tmp_path, "checkpoint-failed") == []


def test_a_damaged_background_save_is_a_warning_a_failed_stamp_and_an_event(tmp_path: Path,
                                                                           queue: BackgroundVerifier) -> None:
    verify = VerifyCheckpointsCallback(verify="background")
    _, warned = fit(tmp_path, verify, plugins=[DamagingIO(step=2)])
    assert len(warned) == 1 and "step=2.ckpt" in warned[0] and "zip-crc" in warned[0], warned
    bad = read_stamp(tmp_path / "step=2.ckpt")
    assert bad is not None and not bad.passed and bad.current and bad.data["errors"][0]["check"] == "zip-crc"
    assert read_stamp(tmp_path / "step=4.ckpt").passed  # type: ignore[union-attr]
    (failed,) = events(tmp_path, "checkpoint-failed")
    assert failed["step"] == 2 and failed["errors"][0]["location"]["file"] == "step=2.ckpt"
    assert [v.passed for v in verify.verdicts] == [False, True]


def test_background_on_failure_raise_stops_training_at_the_next_save(tmp_path: Path,
                                                                     queue: BackgroundVerifier) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[DamagingIO(step=2)],
                         callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2,
                                                    save_top_k=-1),
                                    WaitForBackground(step=4), VerifyCheckpointsCallback(verify=BACKGROUND_RAISE)])
    with pytest.raises(CheckpointRefusedError, match=r"earlier checkpoint failed verification in the background: "
                                                     r"checkpoint saved at .*step=2\.ckpt fails verification"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", VerifyFailedWarning)
        trainer.fit(Regressor())
    assert trainer.global_step == 4 and not (tmp_path / "step=6.ckpt").exists()  # stopped at the next save
    for name in ("save_checkpoint", "load_checkpoint", "remove_checkpoint"):
        assert name not in vars(trainer.strategy), name


def test_background_on_failure_raise_at_the_last_save_raises_when_fit_ends(tmp_path: Path,
                                                                           queue: BackgroundVerifier) -> None:
    with pytest.raises(CheckpointRefusedError, match=r"in the background: .*step=4\.ckpt fails verification"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", VerifyFailedWarning)
        fit(tmp_path, VerifyCheckpointsCallback(verify=BACKGROUND_RAISE), plugins=[DamagingIO(step=4)])
    assert not read_stamp(tmp_path / "step=4.ckpt").passed  # type: ignore[union-attr]


def test_a_checkpoint_top_k_removes_before_its_verification_is_an_event_not_a_failure(
        tmp_path: Path, queue: BackgroundVerifier) -> None:
    def hold_until_removed(path: str) -> None:  # step=2.ckpt waits its turn until retention has removed it
        deadline = time.monotonic() + 60
        while path.endswith("step=2.ckpt") and os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)

    queue.before_verify = hold_until_removed
    verify = VerifyCheckpointsCallback(verify=BACKGROUND_RAISE, fingerprint=True)
    _, warned = fit(tmp_path, verify, top_k=1)
    assert warned == []
    (deleted,) = events(tmp_path, "checkpoint-deleted")
    assert deleted["path"] == str(tmp_path / "step=2.ckpt") and deleted["step"] == 2 and deleted["deleted"]
    assert events(tmp_path, "checkpoint-failed") == []
    assert sorted(os.listdir(tmp_path)) == ["events.jsonl", "step=4.ckpt", "step=4.ckpt.ckptverify.manifest.json",
                                            "step=4.ckpt.ckptverify.verified.json"]
    assert [(v.deleted, v.passed) for v in verify.verdicts] == [(True, False), (False, True)]


# -- ModelParallelStrategy: DCP folders, in their own processes


def results(out: Path, world: int, stage: str) -> list[dict[str, Any]]:
    found = []
    for rank in range(world):
        f = out / f"{stage}-rank{rank}.json"
        assert f.exists(), f"rank {rank} wrote no result for {stage}"
        found.append(json.loads(f.read_text()))
    return found


def check_dcp_run(tmp_path: Path, world: int) -> None:
    # One launch of `world` ranks (forked from the fork server, as torchrun would start them: their own
    # processes and process group) runs the save, the resume from a flipped step 2 and the resume from step 4
    # in turn; see helpers/lightning_model_parallel.py.
    spawn_ranks(save_flip_resume, world, str(tmp_path), launcher_env=True)
    (saved, *others) = results(tmp_path, world, "save")
    assert saved["error"] is None and saved["warnings"] == [], saved
    stamps = json.loads((tmp_path / "stamps.json").read_text())  # read by rank 0 before it flipped a bit
    for step in (2, 4):
        folder = tmp_path / "checkpoints" / f"step={step}.ckpt"
        assert (folder / "meta.pt").is_file() and (folder / "ckptverify.manifest.json").is_file()
        stamp = stamps[str(step)]
        assert stamp is not None and stamp["passed"] and stamp["current"] and stamp["manifest"], stamp
    fourth = read_stamp(tmp_path / "checkpoints" / "step=4.ckpt")
    assert fourth is not None and fourth.passed and fourth.current and fourth.data["manifest"], fourth
    assert [v["step"] for v in saved["verdicts"]] == [2, 4]
    assert all(v["manifest"] and v["bytes_checked"] > 0 for v in saved["verdicts"])
    for other in others:  # every rank got rank 0's verdicts
        assert [v["passed"] for v in other["verdicts"]] == [True, True] and other["warnings"] == []

    fault = json.loads((tmp_path / "fault.json").read_text())  # rank 0 flipped a bit of step=2.ckpt here
    for result in results(tmp_path, world, "refused"):
        assert result["error"] is not None and result["error"]["type"] == "CheckpointRefusedError", result
        assert fault["file"] in result["error"]["message"] and "step=2.ckpt" in result["error"]["message"]
        assert result["untouched"] is True and result["global_step"] == 0

    for result in results(tmp_path, world, "resumed"):
        assert result["error"] is None and result["warnings"] == [], result
        assert result["global_step"] == 6 and [v["passed"] for v in result["verdicts"]] == [True]


def test_model_parallel_dcp_folders_are_fingerprinted_stamped_and_a_flipped_one_refused(tmp_path: Path) -> None:
    check_dcp_run(tmp_path, world=1)


@pytest.mark.slow
def test_two_rank_model_parallel_ranks_agree_on_every_verdict(tmp_path: Path) -> None:
    check_dcp_run(tmp_path, world=2)
