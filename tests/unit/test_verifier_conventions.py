"""One verify-after-save path: one result type (:class:`ckptverify.Verification`) from the stamper, the background
verifier, the verifier process and the integrations; one event vocabulary in ``events.jsonl``; the verifier
process runs only the jobs it imports; ``runs`` needs nothing from ``verifier``."""

from __future__ import annotations

import ast
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import faults as inj

import ckptverify as cv
from ckptverify.errors import UsageError, VerifyFailedWarning
from ckptverify.options import VerifyOptions
from ckptverify.ownfiles import events as ev
from ckptverify.ownfiles.events import EVENTS_FILE, EVENTS_SCHEMA_VERSION, read_events
from ckptverify.verifier import background
from ckptverify.verifier.background import AfterSave, BackgroundVerifier, Task
from ckptverify.verifier.jobs import CHECK_SAVED, JOBS, STAMP
from ckptverify.verifier.stamper import verify_and_stamp
from ckptverify.verifier.verification import Verification, event_of, unverified
from ckptverify.verifier.worker import VerifierProcess, serve

PACKAGE = Path(cv.__file__).resolve().parent


@pytest.fixture
def verifier(monkeypatch: pytest.MonkeyPatch) -> Any:
    fresh = BackgroundVerifier(settle=0.05, isolation="thread")
    monkeypatch.setattr(background, "_default", fresh)
    yield fresh
    fresh.before_verify = None
    fresh.close(timeout=60)


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64, 32), value), "b": torch.arange(32.0) + value}


def _lines(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / EVENTS_FILE).read_text().splitlines()]


# ---------------------------------------------------------------------- the event vocabulary, as written


def test_a_save_writes_version_2_checkpoint_events_with_the_verification_fields(tmp_path: Path,
                                                                                 verifier: BackgroundVerifier) -> None:
    run = tmp_path / "run"
    cv.save(_state(1.0), run / "step_1", verify="inline", events=run)
    verifier.before_verify = lambda p: inj.flip_in_tensor_payload(p, "w") and None
    with pytest.warns(VerifyFailedWarning):
        cv.save(_state(2.0), run / "step_2", verify="inline", events=run)
    raw = _lines(run)
    assert [(e["event"], e["schema_version"], e["step"]) for e in raw] == [
        ("checkpoint-verified", EVENTS_SCHEMA_VERSION, 1), ("checkpoint-failed", EVENTS_SCHEMA_VERSION, 2)]
    passed, failed = raw
    assert passed["verdict"] == "passed" and passed["passed"] is True and passed["bytes_checked"] > 64 * 32 * 4
    assert "checked_bytes" not in passed and passed["stamped"] and passed["stamp"].endswith("ckptverify.verified.json")
    assert failed["passed"] is False and failed["errors"] and failed["summary"]["error"] >= 1
    # The fields are a Verification's: the event reads back as the result the callback saw.
    back = Verification.from_dict(failed)
    assert back.verdict == "failed" and back.first_error == failed["first_error"]
    assert back.errors == tuple(failed["errors"])


def test_the_integrations_and_a_save_name_the_same_verdict_with_the_same_event(tmp_path: Path) -> None:
    from ckptverify.integrations import Verifier

    folder = tmp_path / "ckpts" / "step_3"
    cv.save(_state(3.0), folder)
    verdict = Verifier(fingerprint=False).after_save(folder, step=3)
    assert isinstance(verdict, Verification) and verdict.passed and verdict.bytes_checked > 0
    (event,) = read_events(tmp_path / "ckpts")
    assert event["event"] == "checkpoint-verified" and event["schema_version"] == EVENTS_SCHEMA_VERSION
    assert event["bytes_checked"] == verdict.bytes_checked and "checked_bytes" not in event
    assert event["verdict"] == "passed" and event["message"] == verdict.message


@pytest.mark.parametrize(("result", "name"), [
    (Verification(path="p", step=1, verdict="passed"), "checkpoint-verified"),
    (Verification(path="p", step=1, verdict="failed"), "checkpoint-failed"),
    (unverified("p", 1, "deleted", "removed while it was being verified"), "checkpoint-deleted"),
    (unverified("p", 1, "cut-short", "not verified within the 1 s waited"), "checkpoint-cut-short"),
    (unverified("p", 1, "changed", "its files changed while it was being verified"), "checkpoint-unverified"),
    (unverified("p", 1, "error", "PermissionError"), "checkpoint-unverified"),
])
def test_each_result_has_one_event_name(result: Verification, name: str) -> None:
    assert event_of(result) == name and name in ev.VERIFICATION_EVENTS


def test_a_checkpoint_removed_before_its_turn_is_a_deleted_event_not_a_failure(tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    cv.save(_state(1.0), run / "step_1")
    fresh = BackgroundVerifier(settle=0.05, isolation="thread")
    try:
        fresh.before_verify = lambda p: shutil.rmtree(p)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            inline = AfterSave(verify=VerifyOptions(when="inline"), events=run)
            result = fresh.verify_now(run / "step_1", step=1, options=inline)
    finally:
        fresh.close(timeout=30)
    assert result.verdict == "unverified" and result.deleted and not result.passed
    assert [e["event"] for e in read_events(run)] == ["checkpoint-deleted"]


def test_a_failing_callback_or_event_log_is_a_warning_and_the_verification_stands(tmp_path: Path) -> None:
    class _Unwritable:
        def emit(self, event: str, **fields: Any) -> None:
            raise PermissionError(13, "Permission denied", "events.jsonl")

    def callback(result: Verification) -> None:
        raise RuntimeError("the user's callback broke")

    cv.save(_state(1.0), tmp_path / "step_1")
    fresh = BackgroundVerifier(settle=0.05, isolation="thread")
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            result = fresh.verify_now(tmp_path / "step_1", step=1, options=AfterSave(
                verify=VerifyOptions(when="inline"), on_verified=callback, events=_Unwritable()))
    finally:
        fresh.close(timeout=30)
    assert result.passed and result.stamped and fresh.last() == result
    messages = [str(w.message) for w in said]
    assert any(m.startswith("cannot append the checkpoint-verified event for ") and "Permission denied" in m
               for m in messages), messages
    assert "the on_verified callback failed: RuntimeError: the user's callback broke" in messages


# ---------------------------------------------------------------------- one result type


def test_the_former_result_types_are_gone() -> None:
    import ckptverify.integrations as integrations
    import ckptverify.integrations._core as core
    import ckptverify.verifier.stamper as stamper

    assert not hasattr(stamper, "Outcome") and not hasattr(core, "Verdict") and not hasattr(integrations, "Verdict")
    assert not hasattr(integrations, "Verification") and Verification is cv.Verification


def test_a_verification_reads_back_as_itself() -> None:
    result = Verification(path="/c", step=2, verdict="passed", bytes_checked=7, manifest=True, message="m")
    again = Verification.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result and again.bytes_checked == 7


def test_a_verification_refuses_what_is_not_one() -> None:
    for bad in ({"step": 1, "verdict": "passed"}, {"path": "p", "step": 1, "verdict": "fine"}, ["p"],
                {"path": "p", "step": 1, "passed": True},
                {"path": "p", "step": 1, "verdict": "unverified", "no_verdict": "sleepy"}):
        with pytest.raises(TypeError):
            Verification.from_dict(bad)  # type: ignore[arg-type]


def test_a_verification_without_a_verdict_says_error_unless_told_why() -> None:
    assert Verification(path="p", step=None, verdict="unverified").no_verdict == "error"
    assert Verification(path="p", step=None, verdict="unverified", no_verdict="deleted").deleted


def test_a_verification_read_from_someone_elses_stamp_keeps_only_values_of_the_right_type() -> None:
    from ckptverify.verifier.verification import from_stamp

    got = from_stamp("/c", 4, {"passed": False, "summary": {"error": 1}, "seconds": True, "bytes_checked": "9",
                               "throttled_s": 1.5, "deep": 1, "errors": ["x", {"check": "zip-crc", "message": "m"}],
                               "coverage": [3, {"check": "zip-crc"}]})
    assert (got.verdict, got.stamped, got.first_error) == ("failed", True, "zip-crc: m")
    assert (got.seconds, got.bytes_checked, got.throttled_s, got.deep) == (0.0, 0, 1.5, True)
    assert got.errors == ({"check": "zip-crc", "message": "m"},) and got.coverage == ({"check": "zip-crc"},)


def test_the_stamper_returns_a_verification(tmp_path: Path) -> None:
    cv.save(_state(1.0), tmp_path / "step_1")
    result = verify_and_stamp(str(tmp_path / "step_1"), step=1)
    assert isinstance(result, Verification) and result.passed and result.stamped and result.report is not None
    assert result.bytes_checked == result.report.stats["bytes"] > 0
    gone = verify_and_stamp(str(tmp_path / "nothing"), step=2)
    assert gone.verdict == "unverified" and gone.no_verdict == "deleted"


# ---------------------------------------------------------------------- the verifier process runs named jobs


def test_a_task_names_a_job_the_verifier_imports() -> None:
    import inspect

    from ckptverify.verifier.saved import saved_job

    assert inspect.unwrap(JOBS[CHECK_SAVED]) is saved_job
    with pytest.raises(UsageError, match="no such verification job"):
        Task(job="ckptverify.integrations._core:saved_job", args={}, done=lambda r, w: None)


class _Lines:
    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_a_request_naming_code_is_refused_and_imports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    imported: list[str] = []
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name))
    requests = [
        json.dumps({"job": "ckptverify.examples.demo:main", "args": {}}),  # a module string: no such job
        json.dumps({"call": "ckptverify.examples.demo:main", "args": {}}),  # the former protocol
        json.dumps({"job": CHECK_SAVED, "args": ["not", "an", "object"]}),
        json.dumps({"job": ["check-saved"], "args": {}}),
    ]
    out = _Lines()
    serve(requests, out)
    answers = [json.loads(x) for x in out.text.splitlines()]
    assert len(answers) == 4
    assert "no such verification job" in answers[0]["call_error"]
    assert "protocol_error" in answers[1]
    assert "not an object" in answers[2]["call_error"] and "no such verification job" in answers[3]["call_error"]
    assert imported == []


def test_the_verifier_process_runs_the_check_saved_job(tmp_path: Path) -> None:
    folder = tmp_path / "step_1"
    cv.save(_state(1.0), folder)
    child = VerifierProcess("normal")
    try:
        answer = child.run(CHECK_SAVED, {"root": str(folder), "step": 1, "fingerprint": False, "jobs": 1,
                                         "deep": False, "settle": 0.05})
        with pytest.raises(RuntimeError, match="no such verification job"):
            child.run("os:system", {"command": "true"})
    finally:
        child.close()
    result = Verification.from_dict(answer["verification"])
    assert answer["event"] == "checkpoint-verified" and result.passed and result.stamped and result.bytes_checked > 0


@pytest.mark.parametrize("damaged", [False, True])
def test_a_saved_checkpoint_whose_files_change_while_it_is_checked_gets_no_verdict_and_no_stamp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: bool) -> None:
    from ckptverify.audit import verify as audit_verify
    from ckptverify.runs.stamp import stamp_path
    from ckptverify.verifier.saved import check_saved

    folder = tmp_path / "step_1"
    cv.save(_state(1.0), folder)
    if damaged:
        (folder / ".metadata").write_bytes(b"not a pickle")
    real = audit_verify.verify_checkpoint

    def verify_while_a_file_arrives(*args: Any, **kwargs: Any) -> Any:
        report = real(*args, **kwargs)
        (folder / "late.json").write_text("{}")  # the framework still writing beside the save
        return report

    monkeypatch.setattr(audit_verify, "verify_checkpoint", verify_while_a_file_arrives)
    result, _ = check_saved(str(folder), 1, False)
    assert result.verdict == "unverified" and result.no_verdict == "changed", result
    assert event_of(result) == ev.CHECKPOINT_UNVERIFIED and not Path(stamp_path(str(folder))).exists()


def test_a_background_check_of_a_save_already_deleted_is_deleted_and_tidies_ckptverifys_files(tmp_path: Path) -> None:
    from ckptverify.runs.stamp import stamp_path
    from ckptverify.verifier.saved import check_saved

    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    Path(stamp_path(str(folder))).write_text("{}")  # retention removed the checkpoint's files, not ckptverify's
    result, extra = check_saved(str(folder), 1, "auto", settle=0.0)
    assert result.deleted and event_of(result) == ev.CHECKPOINT_DELETED and extra == {}
    assert not folder.exists()
    gone, _ = check_saved(str(tmp_path / "never-there"), 2, "auto", settle=0.0)
    assert gone.deleted


def test_an_answer_to_another_request_is_not_taken_for_this_one(tmp_path: Path) -> None:
    folder = tmp_path / "step_1"
    cv.save(_state(1.0), folder)
    args = {"path": str(folder), "step": 1, "deep": False, "jobs": 1, "settle": 0.05}
    child = VerifierProcess("normal")
    try:
        assert Verification.from_dict(child.run(STAMP, args)).passed
        proc = child._proc
        # a stray request ahead of ours: its answer comes first and names another checkpoint
        stray = {"path": str(tmp_path / "elsewhere"), "step": 9, "deep": False, "jobs": 1, "settle": 0.05}
        proc.stdin.write(json.dumps({"job": STAMP, "args": stray}) + "\n")
        proc.stdin.flush()
        with pytest.raises(RuntimeError, match="answered another request"):
            child.run(STAMP, args)
        assert proc.poll() is not None  # that process is done with; the next request starts a new one
        assert Verification.from_dict(child.run(STAMP, args)).passed and child._proc is not proc
    finally:
        child.close()


# ---------------------------------------------------------------------- layering


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_runs_imports_nothing_of_the_verifier_and_the_worker_no_importlib() -> None:
    for module in sorted((PACKAGE / "runs").glob("*.py")):
        assert not [n for n in _imports(module) if n.startswith("ckptverify.verifier")], module
    for name in ("worker.py", "background.py", "jobs.py"):
        assert "importlib" not in _imports(PACKAGE / "verifier" / name), name
    assert "ckptverify.integrations" not in {n.rsplit(".", 1)[0] for n in _imports(PACKAGE / "verifier" / "jobs.py")}
