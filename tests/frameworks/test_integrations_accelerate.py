"""ckptverify's accelerate helpers (``save_state``, ``load_state``) around a real ``Accelerator`` on CPU.

One process in this one; the two-process job (every process waits for the others' files, all follow rank 0's
verdict) runs ``tests/frameworks/accelerate_integration.py``'s ``job`` on two gloo ranks.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate", reason="pip install -e '.[accelerate]' (see docs/integrations.md)")

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from helpers.multiproc import spawn_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptverify.errors import CheckpointRefusedError
from ckptverify.integrations import accelerate as ckv
from ckptverify.options import VerifyOptions
from ckptverify.ownfiles.events import read_events
from ckptverify.runs.stamp import read_stamp
from ckptverify.verifier import background
from ckptverify.verifier.background import BackgroundVerifier
from frameworks import harness as h

RAISE = VerifyOptions(on_failure="raise")
BACKGROUND_RAISE = VerifyOptions(when="background", on_failure="raise")


class Job:
    """A model, AdamW and a step scheduler prepared by a fresh ``Accelerator``."""

    def __init__(self, project: ProjectConfiguration | None = None) -> None:
        self.accelerator = Accelerator(cpu=True, project_config=project)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        g = torch.Generator().manual_seed(7)
        data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
        self.model, self.opt, self.loader, self.sched = self.accelerator.prepare(
            model, opt, DataLoader(data, batch_size=4), sched)

    def train(self, steps: int, save: Callable[[int], Any]) -> dict[int, list[torch.Tensor]]:
        """Train ``steps`` steps, calling ``save(step)`` every 2; return the weights at each save."""
        weights = {}
        for step, (x, y) in enumerate(self.loader, start=1):
            loss = nn.functional.mse_loss(self.model(x), y)
            self.accelerator.backward(loss)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            if step % 2 == 0:
                save(step)
                weights[step] = self.weights()
            if step == steps:
                break
        return weights

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def damaging(save_state: Callable[..., Any], step_dir: str) -> Callable[..., Any]:
    """``Accelerator.save_state``, then one bit of ``optimizer.bin`` flipped when saving into ``step_dir``:
    storage that corrupts what it is given."""
    def save(output_dir: Any = None, **kwargs: Any) -> Any:
        location = save_state(output_dir, **kwargs)
        if os.path.basename(os.fspath(location)) == step_dir:
            h.flip_in_zip_member(Path(location) / "optimizer.bin")
        return location

    return save


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    """Warnings ckptverify raised (see harness.ckptverify_warnings)."""
    return h.ckptverify_warnings(caught)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any], dict[int, list[torch.Tensor]], list[str]]:
    """A clean 4-step job that saved ``state-step2`` and ``state-step4`` through ckptverify."""
    out = tmp_path_factory.mktemp("accelerate")
    job = Job()
    verdicts: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weights = job.train(4, lambda s: verdicts.append(ckv.save_state(job.accelerator, out / f"state-step{s}")))
    return out, verdicts, weights, ours(caught)


def test_every_saved_state_carries_a_current_passed_stamp_and_no_warning(saved: Any) -> None:
    out, verdicts, _, warned = saved
    assert warned == []
    assert [v.step for v in verdicts] == [2, 4] and all(v.passed for v in verdicts)
    for verdict in verdicts:
        stamp = read_stamp(verdict.path)
        assert stamp is not None and stamp.passed and stamp.current, stamp
        crc = sum(c["count"] for c in verdict.coverage if c["check"] == "zip-crc")
        assert crc > 5 and verdict.bytes_checked > 0, verdict  # optimizer.bin, scheduler.bin, random_states_0.pkl
        assert verdict.manifest and verdict.unchecked == (), verdict  # the weights are in the manifest
    assert len(list(read_events(out, "checkpoint-verified"))) == 2
    assert list(read_events(out, "checkpoint-failed")) == []


def test_a_state_damaged_on_its_way_to_disk_gets_a_failed_stamp_a_warning_and_an_event(tmp_path: Path) -> None:
    job = Job()
    job.accelerator.save_state = damaging(job.accelerator.save_state, "state-step2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job.train(4, lambda s: ckv.save_state(job.accelerator, tmp_path / f"state-step{s}"))
    (warned,) = ours(caught)
    assert "state-step2" in warned and "optimizer.bin" in warned
    assert not read_stamp(tmp_path / "state-step2").passed  # type: ignore[union-attr]
    assert read_stamp(tmp_path / "state-step4").passed  # type: ignore[union-attr]
    (failed,) = read_events(tmp_path, "checkpoint-failed")
    assert failed["errors"][0]["location"]["file"] == "optimizer.bin"


def test_on_failure_raise_stops_at_the_damaged_save(tmp_path: Path) -> None:
    job = Job()
    job.accelerator.save_state = damaging(job.accelerator.save_state, "state-step2")
    with pytest.raises(CheckpointRefusedError, match=r"state-step2 fails verification.*optimizer\.bin"):
        job.train(4, lambda s: ckv.save_state(job.accelerator, tmp_path / f"state-step{s}", verify=RAISE))


def test_load_of_a_flipped_state_is_refused_before_anything_is_loaded(saved: Any, tmp_path: Path) -> None:
    import shutil

    bad = Path(shutil.copytree(saved[0] / "state-step4", tmp_path / "state-step4"))
    h.flip_in_zip_member(bad / "random_states_0.pkl")
    job = Job()
    before = job.weights()
    with pytest.raises(CheckpointRefusedError, match=r"refusing to resume: .*state-step4 .*random_states_0\.pkl"):
        ckv.load_state(job.accelerator, bad)
    assert all(torch.equal(p, q) for p, q in zip(job.weights(), before, strict=True))
    (refused,) = read_events(tmp_path, "resume-refused")
    assert refused["path"] == str(bad)


def test_load_of_a_clean_state_restores_the_saved_weights(saved: Any) -> None:
    out, _, weights, _ = saved
    job = Job()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verdict = ckv.load_state(job.accelerator, out / "state-step2")
    assert ours(caught) == [] and verdict.passed and verdict.bytes_checked > 0
    assert all(torch.equal(p, q) for p, q in zip(job.weights(), weights[2], strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(job.weights(), weights[4], strict=True))


def test_automatic_naming_loads_the_newest_state_that_verifies_and_keeps_the_log_out_of_checkpoints(
        tmp_path: Path) -> None:
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=3)
    job = Job(project)
    weights = job.train(6, lambda s: ckv.save_state(job.accelerator))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert len(list(read_events(tmp_path, "checkpoint-verified"))) == 3
    h.flip_in_zip_member(tmp_path / "checkpoints" / "checkpoint_2" / "scheduler.bin", bit=1)
    job2 = Job(ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verdict = ckv.load_state(job2.accelerator)
    assert verdict.path == str(tmp_path / "checkpoints" / "checkpoint_1")
    (warned,) = ours(caught)
    assert "checkpoint_2" in warned and "scheduler.bin" in warned
    assert all(torch.equal(p, q) for p, q in zip(job2.weights(), weights[4], strict=True))


def test_load_of_a_state_with_a_flip_in_its_weights_is_refused(saved: Any, tmp_path: Path) -> None:
    import shutil

    bad = Path(shutil.copytree(saved[0] / "state-step4", tmp_path / "state-step4"))
    tensor = h.flip_in_safetensors(bad / "model.safetensors")
    with pytest.raises(CheckpointRefusedError, match=r"refusing to resume: .*state-step4") as exc:
        ckv.load_state(Job().accelerator, bad)
    assert "model.safetensors" in str(exc.value) and tensor in str(exc.value)


def _rank(rank: int, world: int, out: Path, mode: str) -> None:
    from frameworks import accelerate_integration

    accelerate_integration.job(rank, world, out, mode)


def run_two_processes(out: Path, mode: str) -> list[dict[str, Any]]:
    # The script's own job on two gloo ranks started as its `spawn` starts them (spawn_ranks with torchrun's
    # environment), only from this process's fork server instead of a fresh interpreter of the script's own.
    spawn_ranks(_rank, 2, out, mode, launcher_env=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_two_processes_wait_for_each_other_and_follow_rank_0s_verdict(tmp_path: Path) -> None:
    results = run_two_processes(tmp_path, "inline")
    for rank, result in enumerate(results):
        # rank 1's random_states_1.pkl was damaged after it wrote it; rank 0 verified only once it was written
        assert result["step2"]["passed"] is True, result
        assert result["step4_error"]["type"] == "CheckpointRefusedError", result
        assert "random_states_1.pkl" in result["step4_error"]["message"]
        assert result["load_step4_error"]["type"] == "CheckpointRefusedError"
        assert result["load_step4_untouched"] is True
        assert result["load_step2_restored"] is True, (rank, result)
    assert read_stamp(tmp_path / "state-step2").passed  # type: ignore[union-attr]
    assert not read_stamp(tmp_path / "state-step4").passed  # type: ignore[union-attr]


# -- verify="background": save_state returns at once; the verdict comes from the background verifier


def test_background_states_are_fingerprinted_and_stamped_once_waited_for(tmp_path: Path,
                                                                         queue: BackgroundVerifier) -> None:
    job = Job()
    returned: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job.train(4, lambda s: returned.append(ckv.save_state(job.accelerator, tmp_path / f"state-step{s}",
                                                              verify="background")))
        arrived = ckv.wait_for_verifications(job.accelerator)
    assert ours(caught) == [] and queue.pending() == []
    assert [(v.step, v.pending, v.passed) for v in returned] == [(2, True, False), (4, True, False)]
    assert [(v.step, v.passed) for v in arrived] == [(2, True), (4, True)]
    for verdict in arrived:
        assert verdict.manifest and verdict.unchecked == () and verdict.bytes_checked > 0, verdict
        # the report came back from the verifier process whole
        assert verdict.report is not None and verdict.report.passed and verdict.report.command == "verify"
        assert verdict.report.stats["bytes"] == verdict.bytes_checked and verdict.report.coverage
        stamp = read_stamp(verdict.path)
        assert stamp is not None and stamp.passed and stamp.current and stamp.data["manifest"], stamp
    assert len(list(read_events(tmp_path, "checkpoint-verified"))) == 2
    assert ckv.wait_for_verifications(job.accelerator) == []  # each verdict is returned once


def test_a_damaged_background_state_is_a_warning_an_event_and_raised_at_the_next_save(
        tmp_path: Path, queue: BackgroundVerifier) -> None:
    job = Job()
    job.accelerator.save_state = damaging(job.accelerator.save_state, "state-step2")

    def save(step: int) -> None:
        if step == 4:  # the earlier verdict is in, as in a run whose steps take longer than a verification
            assert background.wait_for_verifications(timeout=120)
        ckv.save_state(job.accelerator, tmp_path / f"state-step{step}", verify=BACKGROUND_RAISE)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointRefusedError, match=r"in the background: .*state-step2 fails verification"
                                                         r".*optimizer\.bin") as refused:
            job.train(6, save)
    report = refused.value.report  # the findings that explain the refusal, from the verifier process
    assert report is not None and not report.passed
    assert report.errors[0].location.file == "optimizer.bin" and report.target == str(tmp_path / "state-step2")
    (warned,) = ours(caught)
    assert "state-step2" in warned and "optimizer.bin" in warned
    (failed,) = read_events(tmp_path, "checkpoint-failed")
    assert failed["errors"][0]["location"]["file"] == "optimizer.bin"
    assert not (tmp_path / "state-step6").exists()  # stopped at the save after the failure (step 4's)
    arrived = ckv.wait_for_verifications(job.accelerator)  # raised once; step 4 (written, queued) arrives clean
    assert [(v.step, v.passed) for v in arrived] == [(2, False), (4, True)]
    assert not read_stamp(tmp_path / "state-step2").passed  # type: ignore[union-attr]


def test_load_of_a_state_still_queued_waits_for_its_verification(tmp_path: Path, queue: BackgroundVerifier) -> None:
    import threading

    release = threading.Event()
    queue.before_verify = lambda p: release.wait(60)
    job = Job()
    job.train(2, lambda s: ckv.save_state(job.accelerator, tmp_path / f"state-step{s}", verify="background"))
    assert queue.pending() == [str(tmp_path / "state-step2")]
    threading.Timer(0.5, release.set).start()
    verdict = ckv.load_state(Job().accelerator, tmp_path / "state-step2")
    assert verdict.passed and verdict.manifest and verdict.unchecked == ()  # the manifest written meanwhile
    assert queue.pending() == []


@pytest.mark.slow
def test_two_processes_in_the_background_raise_together_at_the_save_after_a_failure(tmp_path: Path) -> None:
    results = run_two_processes(tmp_path, "background")
    for result in results:
        assert result["step2"]["pending"] is True and result["step4"]["pending"] is True, result
        assert result["step6_error"]["type"] == "CheckpointRefusedError", result
        assert "in the background" in result["step6_error"]["message"]
        assert "state-step4" in result["step6_error"]["message"]
        assert "random_states_1.pkl" in result["step6_error"]["message"]
        # step 6 was written, and queued, before the raise: it is verified too
        assert [(v["step"], v["passed"]) for v in result["waited"]] == [(2, True), (4, False), (6, True)], result
    assert results[0]["warnings"] == [results[0]["warnings"][0]] and "state-step4" in results[0]["warnings"][0]
    assert results[1]["warnings"] == []  # the coordinator warns; every rank raises
    assert read_stamp(tmp_path / "state-step2").passed  # type: ignore[union-attr]
    assert not read_stamp(tmp_path / "state-step4").passed  # type: ignore[union-attr]


def test_a_state_total_limit_removes_before_its_verification_is_an_event_not_a_failure(
        tmp_path: Path, queue: BackgroundVerifier) -> None:
    def hold_until_removed(path: str) -> None:  # checkpoint_0 waits its turn until retention has removed it
        deadline = time.monotonic() + 60
        while path.endswith("checkpoint_0") and os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)

    queue.before_verify = hold_until_removed
    job = Job(ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job.train(4, lambda s: ckv.save_state(job.accelerator, verify=BACKGROUND_RAISE))
        arrived = ckv.wait_for_verifications(job.accelerator)
    assert ours(caught) == []
    assert [(Path(v.path).name, v.deleted, v.passed) for v in arrived] == [("checkpoint_0", True, False),
                                                                           ("checkpoint_1", False, True)]
    (deleted,) = read_events(tmp_path, "checkpoint-deleted")
    assert deleted["path"] == str(tmp_path / "checkpoints" / "checkpoint_0") and deleted["deleted"]
    assert list(read_events(tmp_path, "checkpoint-failed")) == []
    assert os.listdir(tmp_path / "checkpoints") == ["checkpoint_1"]
    assert read_stamp(tmp_path / "checkpoints" / "checkpoint_1").passed  # type: ignore[union-attr]
