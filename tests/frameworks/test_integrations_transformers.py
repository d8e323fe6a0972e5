"""ckptverify's transformers integration (``VerifyCheckpointsCallback``, ``verified_resume_checkpoint``) in real
``Trainer`` runs: a tiny GPT-2 built from a config, CPU, one process, no downloads."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

transformers = pytest.importorskip("transformers", reason="pip install -e '.[transformers]' (see docs/integrations.md)")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from ckptverify.errors import CheckpointRefusedError, VerifyFailedWarning  # noqa: E402
from ckptverify.integrations.transformers import (  # noqa: E402
    VerifyCheckpointsCallback,
    verified_resume_checkpoint,
    verify_before_resume,
)
from ckptverify.options import VerifyOptions  # noqa: E402
from ckptverify.ownfiles.events import read_events  # noqa: E402
from ckptverify.runs.stamp import read_stamp  # noqa: E402
from ckptverify.verifier import background  # noqa: E402
from ckptverify.verifier.background import BackgroundVerifier  # noqa: E402
from frameworks import harness as h  # noqa: E402

RAISE = VerifyOptions(on_failure="raise")
BACKGROUND_RAISE = VerifyOptions(when="background", on_failure="raise")


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seq: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class DamageOnSave(TrainerCallback):
    """Flips one bit of ``optimizer.pt`` in ``checkpoint-{step}`` as soon as it is saved: storage that corrupts
    what it is given (runs before ckptverify's callback, which comes after it in the list)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            h.flip_in_zip_member(Path(args.output_dir) / f"checkpoint-{self.step}" / "optimizer.pt")


def train(out: Path, callbacks: list[Any], *, max_steps: int = 4, resume: str | None = None,
          **extra: Any) -> tuple[Any, list[str]]:
    """Train 2 steps per save into ``out``; return the trainer and the warnings ckptverify raised."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, use_cpu=True, report_to=[], seed=0, disable_tqdm=True,
                             logging_strategy="no", **extra)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    return trainer, ours(caught)


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    """Warnings ckptverify raised (see harness.ckptverify_warnings)."""
    return h.ckptverify_warnings(caught)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, VerifyCheckpointsCallback, list[str]]:
    """One clean 4-step run (``checkpoint-2``, ``checkpoint-4``); tests copy what they damage."""
    out = tmp_path_factory.mktemp("hf") / "run"
    verify = VerifyCheckpointsCallback()
    _, warned = train(out, [verify])
    return out, verify, warned


@pytest.fixture
def queue(monkeypatch: pytest.MonkeyPatch) -> Any:
    """conftest's ``queue`` (a fresh process-wide background verifier, short settle time, closed after the test),
    verifying in its worker thread at normal priority: these tests are about what the callback does with
    background verdicts, not about the verifier process (``tests/unit/test_background_verify.py`` and
    ``tests/frameworks/test_integrations_core.py`` run that), and a verifier process imports torch anew for each
    test."""
    fresh = BackgroundVerifier(settle=0.05, isolation="thread", priority="normal")
    monkeypatch.setattr(background, "_default", fresh)
    yield fresh
    fresh.before_verify = None
    fresh.close(timeout=60)


def copy_run(run: tuple[Path, Any, Any], dst: Path) -> Path:
    import shutil

    shutil.copytree(run[0], dst)
    return dst


def test_every_saved_checkpoint_carries_a_current_passed_stamp_and_no_warning(run: Any) -> None:
    out, verify, warned = run
    assert warned == []
    for step in (2, 4):
        stamp = read_stamp(out / f"checkpoint-{step}")
        assert stamp is not None and stamp.passed and stamp.current and stamp.step == step, stamp
    assert [v.step for v in verify.verdicts] == [2, 4]
    for verdict in verify.verdicts:
        crc = sum(c["count"] for c in verdict.coverage if c["check"] == "zip-crc")
        assert crc > 10 and verdict.bytes_checked > 0, verdict  # optimizer.pt, scheduler.pt, rng_state.pth, ...
        # the weights (safetensors: no checksum of their own) are covered by the manifest written at the save
        assert verdict.manifest and verdict.unchecked == (), verdict
        assert (out / f"checkpoint-{verdict.step}" / "ckptverify.manifest.json").is_file()
    assert len(list(read_events(out, "checkpoint-verified"))) == 2
    assert list(read_events(out, "checkpoint-failed")) == []


def test_a_checkpoint_damaged_on_its_way_to_disk_gets_a_failed_stamp_a_warning_and_an_event(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _, warned = train(out, [DamageOnSave(step=2), VerifyCheckpointsCallback()])
    assert len(warned) == 1 and "checkpoint-2" in warned[0] and "optimizer.pt" in warned[0], warned
    bad, good = read_stamp(out / "checkpoint-2"), read_stamp(out / "checkpoint-4")
    assert bad is not None and not bad.passed and good is not None and good.passed
    (failed,) = read_events(out, "checkpoint-failed")
    assert failed["step"] == 2 and failed["errors"][0]["location"]["file"] == "optimizer.pt"


def test_on_failure_raise_stops_training_at_the_damaged_save(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(CheckpointRefusedError, match=r"checkpoint-2 fails verification.*optimizer\.pt"):
        train(out, [DamageOnSave(step=2), VerifyCheckpointsCallback(verify=RAISE)])
    assert not (out / "checkpoint-4").exists()


def test_resume_skips_a_flipped_newest_checkpoint_and_names_its_file(run: Any, tmp_path: Path) -> None:
    out = copy_run(run, tmp_path / "run")
    h.flip_in_zip_member(out / "checkpoint-4" / "optimizer.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        picked = verified_resume_checkpoint(out)
    assert picked == str(out / "checkpoint-2")
    (warned,) = ours(caught)
    assert "checkpoint-4" in warned and "optimizer.pt" in warned
    (refused,) = read_events(out, "resume-refused")
    assert refused["path"] == str(out / "checkpoint-4")
    with pytest.raises(CheckpointRefusedError, match=r"refusing to resume: .*checkpoint-4 .*optimizer\.pt"):
        verify_before_resume(out / "checkpoint-4")


def test_resume_is_refused_when_no_checkpoint_verifies(run: Any, tmp_path: Path) -> None:
    out = copy_run(run, tmp_path / "run")
    for step in (2, 4):
        h.flip_in_zip_member(out / f"checkpoint-{step}" / "scheduler.pt", bit=1)
    with pytest.raises(CheckpointRefusedError, match=r"none of the 2 checkpoint\(s\)"), warnings.catch_warnings():
        warnings.simplefilter("ignore", VerifyFailedWarning)
        verified_resume_checkpoint(out)
    assert verified_resume_checkpoint(tmp_path / "empty-run") is None  # nothing to resume from: a fresh start


def test_resume_from_the_verified_checkpoint_continues_and_stamps_what_it_saves(run: Any, tmp_path: Path) -> None:
    out = copy_run(run, tmp_path / "run")
    picked = verified_resume_checkpoint(out)
    assert picked == str(out / "checkpoint-4")
    verify = VerifyCheckpointsCallback()
    trainer, warned = train(out, [verify], max_steps=6, resume=picked)
    assert warned == []
    assert trainer.state.global_step == 6
    assert [v.step for v in verify.verdicts] == [6] and verify.verdicts[0].passed
    stamp = read_stamp(out / "checkpoint-6")
    assert stamp is not None and stamp.passed and stamp.current


def test_a_flip_in_the_weights_is_refused_at_resume_naming_the_tensor(run: Any, tmp_path: Path) -> None:
    out = copy_run(run, tmp_path / "run")
    tensor = h.flip_in_safetensors(out / "checkpoint-4" / "model.safetensors")
    with pytest.raises(CheckpointRefusedError, match=r"checkpoint-4 fails verification") as exc:
        verify_before_resume(out / "checkpoint-4")
    assert "model.safetensors" in str(exc.value) and tensor in str(exc.value)


# -- verify="background": on_save returns at once; the verdict comes from the background verifier


class WaitForBackground(TrainerCallback):
    """Before the save of ``step`` (``on_step_end`` comes before it), wait until the background verifier has
    finished what is queued, as it has in a run whose steps take longer than a verification."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            assert background.wait_for_verifications(timeout=120)


def test_background_saves_are_fingerprinted_and_stamped_by_the_end_of_training(tmp_path: Path,
                                                                               queue: BackgroundVerifier) -> None:
    out = tmp_path / "run"
    verify = VerifyCheckpointsCallback(verify="background")
    _, warned = train(out, [verify])
    assert warned == [] and queue.pending() == []
    for step in (2, 4):
        stamp = read_stamp(out / f"checkpoint-{step}")
        assert stamp is not None and stamp.passed and stamp.current and stamp.step == step, stamp
        assert stamp.data["manifest"] and (out / f"checkpoint-{step}" / "ckptverify.manifest.json").is_file()
    assert [(v.step, v.passed, v.pending) for v in verify.verdicts] == [(2, True, False), (4, True, False)]
    for verdict in verify.verdicts:  # the weights (safetensors) are covered by the manifest written in the background
        assert verdict.manifest and verdict.unchecked == () and verdict.bytes_checked > 0, verdict
    assert [e["step"] for e in read_events(out, "checkpoint-verified")] == [2, 4]
    assert all(e["fingerprint"].startswith("manifest written") for e in read_events(out, "checkpoint-verified"))


def test_a_damaged_background_save_is_a_warning_a_failed_stamp_and_an_event(tmp_path: Path,
                                                                           queue: BackgroundVerifier) -> None:
    out = tmp_path / "run"
    _, warned = train(out, [DamageOnSave(step=2), VerifyCheckpointsCallback(verify="background")])
    assert len(warned) == 1 and "checkpoint-2" in warned[0] and "optimizer.pt" in warned[0], warned
    assert not read_stamp(out / "checkpoint-2").passed  # type: ignore[union-attr]
    assert read_stamp(out / "checkpoint-4").passed  # type: ignore[union-attr]
    (failed,) = read_events(out, "checkpoint-failed")
    assert failed["step"] == 2 and failed["errors"][0]["location"]["file"] == "optimizer.pt"


def test_background_on_failure_raise_stops_training_at_the_next_save(tmp_path: Path,
                                                                     queue: BackgroundVerifier) -> None:
    out = tmp_path / "run"
    with pytest.raises(CheckpointRefusedError, match=r"in the background: .*checkpoint-2 fails verification"):
        train(out, [DamageOnSave(step=2), WaitForBackground(step=4), VerifyCheckpointsCallback(
            verify=BACKGROUND_RAISE)], max_steps=8)
    assert (out / "checkpoint-4").is_dir() and not (out / "checkpoint-6").exists()  # stopped at the next save


def test_a_checkpoint_rotated_away_before_its_verification_is_an_event_not_a_failure(
        tmp_path: Path, queue: BackgroundVerifier) -> None:
    def hold_until_removed(path: str) -> None:  # checkpoint-2 waits its turn until save_total_limit removed it
        deadline = time.monotonic() + 60
        while path.endswith("checkpoint-2") and os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)

    queue.before_verify = hold_until_removed
    out = tmp_path / "run"
    verify = VerifyCheckpointsCallback(verify=BACKGROUND_RAISE)
    _, warned = train(out, [verify], save_total_limit=1)
    assert warned == []
    (deleted,) = read_events(out, "checkpoint-deleted")
    assert deleted["path"] == str(out / "checkpoint-2") and deleted["step"] == 2
    assert list(read_events(out, "checkpoint-failed")) == []
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-4"]
    assert read_stamp(out / "checkpoint-4").passed  # type: ignore[union-attr]
