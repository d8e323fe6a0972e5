"""ckptverify's ``VerifiedCheckpointManager`` (torchtitan 0.3's ``CheckpointManager`` saving through the hashing
writer) around a small FSDP2 model on CPU: ``tests/frameworks/torchtitan_integration.py`` runs every stage in one
job of WORLD gloo ranks, and these tests read what each rank saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan", reason="pip install -e '.[torchtitan]' (see docs/integrations.md)")

from ckptverify.audit.verify import verify_checkpoint
from ckptverify.ownfiles.events import read_events
from ckptverify.ownfiles.manifest import MANIFEST_FILE
from ckptverify.runs.stamp import read_stamp

WORKER = Path(__file__).resolve().parent / "torchtitan_integration.py"


def run_job(out: Path, world: int) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(WORKER), str(out), str(world)], env=env, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("torchtitan")
    return out, run_job(out, 1)


def check_saves(out: Path, results: list[dict[str, Any]], stage: str, changed_later: tuple[int, ...] = ()) -> None:
    """Every save of ``stage`` verified against its manifest, on every rank, with no warning; its stamp passed,
    and current unless the job damaged the checkpoint afterwards (``changed_later``: then it is stale)."""
    for result in results:
        entry = result[stage]
        assert entry["error"] is None and entry["warnings"] == [], entry
        assert [v["step"] for v in entry["verdicts"]] == [2, 4]
        for verdict in entry["verdicts"]:
            assert verdict["passed"] and verdict["manifest"] and verdict["bytes_checked"] > 0, verdict
            assert any(c["check"] == "manifest-digest" and c["count"] > 0 for c in verdict["coverage"]), verdict
    for step in (2, 4):
        folder = out / stage / f"step-{step}"
        assert (folder / MANIFEST_FILE).is_file()  # written by the hashing writer, during the save
        stamp = read_stamp(folder)
        assert stamp is not None and stamp.passed and stamp.step == step, stamp
        assert stamp.current is (step not in changed_later), stamp
    assert len(list(read_events(out / stage, "checkpoint-verified"))) == 2
    assert list(read_events(out / stage, "checkpoint-failed")) == []


def test_each_synchronous_save_carries_its_manifest_and_a_passed_stamp(job: Any) -> None:
    check_saves(*job, "sync", changed_later=(4,))  # the job flips a bit of step-4 after it was verified


def test_each_asynchronous_save_is_verified_once_torchtitan_waits_for_it(job: Any) -> None:
    check_saves(*job, "async")


def test_the_manifest_holds_the_logical_fingerprints_taken_in_memory(job: Any) -> None:
    out, _ = job
    report = verify_checkpoint(out / "sync" / "step-2", deep=True)
    assert report.passed, [f.to_dict() for f in report.errors]
    fingerprinted = [c.count for c in report.coverage if c.check == "fingerprint"]
    assert fingerprinted and fingerprinted[0] > 10, report.coverage  # every tensor rebuilt and compared


def test_a_save_damaged_on_its_way_to_disk_stops_training_when_asked_to_raise(job: Any) -> None:
    out, results = job
    for result in results:
        error = result["damaged"]["error"]
        assert error is not None and error["type"] == "CheckpointRefusedError", result["damaged"]
        assert "damaged/step-2 fails verification" in error["message"] and ".distcp" in error["message"]
        assert result["damaged_step"] == 2  # stopped at the damaged save
    assert not (out / "damaged" / "step-4").exists()
    stamp = read_stamp(out / "damaged" / "step-2")
    assert stamp is not None and not stamp.passed


def test_resume_skips_a_flipped_newest_checkpoint_with_a_warning_naming_its_file(job: Any) -> None:
    out, results = job
    for result in results:
        entry = result["load_newest"]
        assert entry["error"] is None and entry["loaded"] is True, entry
        assert result["restored_step"]["sync-1"] == 2  # step-4 fails: step-2 was loaded
    (warned,) = results[0]["load_newest"]["warnings"]
    assert "step-4 fails verification" in warned and results[0]["fault"] in warned
    assert any(e["path"].endswith("step-4") for e in read_events(out / "sync", "resume-refused"))


def test_loading_a_flipped_checkpoint_by_step_is_refused_before_anything_is_loaded(job: Any) -> None:
    _, results = job
    for result in results:
        entry = result["load_4"]
        assert entry["error"] is not None and entry["error"]["type"] == "CheckpointRefusedError", entry
        assert "refusing to resume" in entry["error"]["message"] and result["fault"] in entry["error"]["message"]
        assert result["untouched"]["sync4"] is True and result["restored_step"]["sync4"] == 0


def test_loading_a_clean_checkpoint_restores_it_with_no_warning(job: Any) -> None:
    _, results = job
    for result in results:
        entry = result["load_2"]
        assert entry["error"] is None and entry["warnings"] == [] and entry["loaded"] is True, entry
        assert result["restored_step"]["sync2"] == 2 and result["untouched"]["sync2"] is False


def test_resume_is_refused_when_no_checkpoint_verifies(job: Any) -> None:
    _, results = job
    for result in results:
        entry = result["load_damaged_newest"]
        assert entry["error"] is not None and "none of the 1 checkpoint(s)" in entry["error"]["message"], entry
        assert result["untouched"]["damaged-1"] is True and result["restored_step"]["damaged-1"] == 0


def test_background_saves_return_pending_and_are_stamped_once_close_waits(job: Any) -> None:
    out, results = job
    for result in results:
        assert [(v["step"], v["pending"]) for v in result["background"]["pending"]] == [(2, True), (4, True)]
    check_saves(out, results, "background")


def test_a_background_failure_stops_training_at_the_next_save_on_every_rank(job: Any) -> None:
    out, results = job
    for result in results:
        error = result["background_damaged"]["error"]
        assert error is not None and error["type"] == "CheckpointRefusedError", result["background_damaged"]
        assert "in the background" in error["message"] and "background_damaged/step-2 fails verification" \
            in error["message"] and ".distcp" in error["message"]
        assert result["background_damaged_step"] == 4  # raised at the save after the damaged one
    assert any("background_damaged/step-2 fails verification" in w
               for w in results[0]["background_damaged"]["warnings"])
    assert not read_stamp(out / "background_damaged" / "step-2").passed  # type: ignore[union-attr]
    (failed,) = read_events(out / "background_damaged", "checkpoint-failed")
    assert failed["step"] == 2


def check_retention(out: Path, results: list[dict[str, Any]]) -> None:
    """``keep_latest_k=2`` purged ``step-2`` before its turn came: an event, no warning, no failure, no error."""
    for result in results:
        entry = result["retention"]
        assert entry["error"] is None and entry["warnings"] == [], entry
    # rank 0 holds the verdicts: step 2's says deleted; the others passed
    assert [(v["step"], v.get("deleted", False), v["passed"]) for v in results[0]["retention"]["verdicts"]] == [
        (2, True, False), (4, False, True), (6, False, True), (8, False, True)]
    (deleted,) = read_events(out / "retention", "checkpoint-deleted")
    assert deleted["path"] == str(out / "retention" / "step-2") and deleted["step"] == 2
    assert [e["step"] for e in read_events(out / "retention", "checkpoint-verified")] == [4, 6, 8]
    assert list(read_events(out / "retention", "checkpoint-failed")) == []
    assert sorted(p.name for p in (out / "retention").iterdir() if p.is_dir()) == ["step-4", "step-6", "step-8"]


def test_a_checkpoint_keep_latest_k_purges_before_its_verification_is_an_event_not_a_failure(job: Any) -> None:
    check_retention(*job)


@pytest.mark.slow
def test_two_ranks_save_verify_and_refuse_together(tmp_path: Path) -> None:
    results = run_job(tmp_path, 2)
    check_saves(tmp_path, results, "sync", changed_later=(4,))
    check_saves(tmp_path, results, "async")
    check_saves(tmp_path, results, "background")
    check_retention(tmp_path, results)
    for result in results:
        assert result["background_damaged"]["error"]["type"] == "CheckpointRefusedError"
        assert result["background_damaged_step"] == 4
        assert result["damaged"]["error"]["type"] == "CheckpointRefusedError"
        assert result["load_4"]["error"]["type"] == "CheckpointRefusedError"
        assert result["untouched"]["sync4"] is True
        assert result["restored_step"] == {"sync-1": 2, "sync4": 0, "sync2": 2, "damaged-1": 0}
    assert results[1]["load_newest"]["warnings"] == []  # warned once, by rank 0
