"""A run directory that hides checkpoints from the walk, changes under it, or holds files that look like what
they are not: what ``scan``, ``latest``, ``load(pick=...)`` and ``prune`` make of it.

- what the walk could not see (a sibling folder that spends its budget, a folder too big to read, a folder it
  cannot list) is said, fails ``scan``, stops ``latest`` from picking an older checkpoint and ``prune`` from
  deleting anything; a sibling folder full of plain files does not hide the checkpoints at all;
- a checkpoint removed by retention while ``scan`` verifies it is ``deleted``, not corrupt;
- a folder adopted with ``fingerprint`` is verified by ``scan`` and ``latest`` as by ``verify``;
- a newer weights-only DCP export is passed over by ``load(pick="latest-verified")``;
- Megatron Core's ``integrity.json`` is read as the framework's integrity record.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from helpers import faults as inj

import ckptverify as cv
import ckptverify.formats.rundir as rundir
import ckptverify.runs.scan as scan_mod
from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.cli import main
from ckptverify.errors import CkptVerifyError
from ckptverify.formats.rundir import find_checkpoints
from ckptverify.runs.latest import latest_verified
from ckptverify.runs.prune import prune
from ckptverify.runs.scan import scan_run_dir
from ckptverify.safeparse.paths import WalkNote


def _dcp(path: Path, value: float) -> Path:
    dcp.save({"w": torch.full((64, 64), value), "step": int(value)}, checkpoint_id=str(path))
    fingerprint_checkpoint(path)
    return path


def _empty_files(folder: Path, n: int, suffix: str = ".log") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        os.close(os.open(folder / f"e{i:06d}{suffix}", os.O_CREAT | os.O_WRONLY, 0o644))


@pytest.fixture
def small_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk's bounds scaled down, so that a test folder of a few hundred entries exceeds them."""
    monkeypatch.setattr(rundir, "MAX_ENTRIES", 60)
    monkeypatch.setattr(rundir, "MAX_FOLDER_ENTRIES", 300)
    monkeypatch.setattr(rundir, "MAX_NAMES", 1200)


# ---- a huge sibling folder ---------------------------------------------------------------------------------


def test_a_sibling_folder_of_plain_files_beyond_the_budget_hides_nothing(tmp_path: Path, small_walk: None) -> None:
    # torchtitan's layout, with a sibling sorted after `checkpoint/` that holds more entries than the budget.
    run = tmp_path / "run"
    _dcp(run / "checkpoint" / "step-10", 10.0)
    _dcp(run / "checkpoint" / "step-20", 20.0)
    _empty_files(run / "tb_logs", 250)  # > MAX_ENTRIES (60), < MAX_FOLDER_ENTRIES (300)
    report = scan_run_dir(run)
    assert report.passed and report.stats["newest_good"]["path"] == "checkpoint/step-20"
    assert latest_verified(run).step == 20
    notes: list[WalkNote] = []
    found = find_checkpoints(run, notes=notes)
    assert [c.path for c in found] == ["checkpoint/step-10", "checkpoint/step-20"] and notes == []


def test_checkpoint_files_beyond_the_budget_fail_scan_and_stop_latest_and_prune(tmp_path: Path,
                                                                                 small_walk: None) -> None:
    run = tmp_path / "run"
    _dcp(run / "step_10", 10.0)
    _dcp(run / "step_20", 20.0)
    # 100 files whose names announce a checkpoint: each is examined, and they spend the budget.
    _empty_files(run / "exports" / "a", 100, suffix=".pt")
    _dcp(run / "exports" / "z" / "deeper" / "step_30", 30.0)  # below a folder the budget leaves unvisited
    notes: list[WalkNote] = []
    find_checkpoints(run, notes=notes)
    assert [n.kind for n in notes] == ["budget"] and "exports/z" in notes[0].detail

    report = scan_run_dir(run)
    assert not report.passed
    (unseen,) = [f for f in report.errors if f.check == "scan-unseen"]
    assert "exports/z" in unseen.message and "point the command at the folder" in unseen.message
    assert report.stats["unseen"][0]["kind"] == "budget"

    found = latest_verified(run)
    assert found.path is None and found.unseen and found.report is not None and not found.report.passed
    assert any(s["state"] == "unseen" for s in found.skipped)
    assert any(f.check == "latest-unseen" and "not picked: step_20" in f.message for f in found.report.errors), \
        [(f.check, f.message) for f in found.report.findings]

    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(CkptVerifyError, match="prune deleted nothing"):
        prune(run, keep=1)
    assert sorted(p.name for p in run.iterdir()) == before and (run / "step_10" / ".metadata").exists()


def test_a_folder_with_more_entries_than_the_walk_reads_is_said(tmp_path: Path, small_walk: None) -> None:
    run = tmp_path / "run"
    _dcp(run / "step_10", 10.0)
    _empty_files(run / "cache", 400)  # > MAX_FOLDER_ENTRIES (300)
    notes: list[WalkNote] = []
    assert [c.path for c in find_checkpoints(run, notes=notes)] == ["step_10"]
    assert [(n.kind, n.path, n.entries) for n in notes] == [("folder-cap", "cache", 300)]
    report = scan_run_dir(run)
    assert not report.passed and any(f.check == "scan-unseen" and "move cache out" in f.message
                                     for f in report.errors)
    assert latest_verified(run).path is None
    result = CliRunner().invoke(main, ["scan", str(run), "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["stats"]["unseen"][0]["path"] == "cache"


def test_a_folder_the_walk_reaches_with_its_names_budget_spent_is_said(tmp_path: Path, small_walk: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rundir, "MAX_NAMES", 100)
    run = tmp_path / "run"
    _dcp(run / "step_10", 10.0)
    _empty_files(run / "zz_cache", 150)  # < MAX_FOLDER_ENTRIES (300), > the names left once step_10 is listed
    left = 100 - 2 - len(os.listdir(run / "step_10"))
    notes: list[WalkNote] = []
    assert [c.path for c in find_checkpoints(run, notes=notes)] == ["step_10"]
    assert [(n.kind, n.path, n.entries) for n in notes] == [("folder-cap", "zz_cache", left)]
    assert "had read 100 names in all" in notes[0].detail


# ---- a folder the account cannot list ----------------------------------------------------------------------


def _unlistable(monkeypatch: pytest.MonkeyPatch, blocked: Path) -> None:
    """``os.scandir`` (and ``os.listdir``) of ``blocked`` raise ``PermissionError``, as for an account without
    read permission on it (as root, ``chmod`` does not stop listing)."""
    real_scandir, real_listdir = os.scandir, os.listdir

    def scandir(path: object = ".") -> object:
        if os.path.abspath(os.fspath(path)) == str(blocked):  # type: ignore[arg-type]
            raise PermissionError(13, "Permission denied", os.fspath(path))  # type: ignore[arg-type]
        return real_scandir(path)  # type: ignore[arg-type]

    def listdir(path: object = ".") -> list[str]:
        if os.path.abspath(os.fspath(path)) == str(blocked):  # type: ignore[arg-type]
            raise PermissionError(13, "Permission denied", os.fspath(path))  # type: ignore[arg-type]
        return real_listdir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)


def test_an_unlistable_checkpoint_folder_fails_scan_and_is_never_passed_over(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _dcp(run / "step_10", 10.0)
    _dcp(run / "step_20", 20.0)
    _unlistable(monkeypatch, run / "step_20")
    notes: list[WalkNote] = []
    assert [c.path for c in find_checkpoints(run, notes=notes)] == ["step_10"]
    assert [(n.kind, n.path) for n in notes] == [("unlisted", "step_20")]
    assert "PermissionError" in notes[0].detail

    report = scan_run_dir(run)
    assert not report.passed
    (unseen,) = [f for f in report.errors if f.check == "scan-unseen"]
    assert "step_20" in unseen.message and "Permission denied" in unseen.message and "permission" in unseen.message

    found = latest_verified(run)  # step_20 may be newer than step_10: step_10 is not picked
    assert found.path is None and [s["path"] for s in found.skipped if s["state"] == "unseen"] == ["step_20"]
    with pytest.raises(CkptVerifyError, match=r"prune deleted nothing.*step_20"):
        prune(run, keep=1)
    assert (run / "step_10" / ".metadata").exists()


def test_an_unlistable_folder_with_an_older_step_is_a_warning_and_the_pick_stands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _dcp(run / "step_10", 10.0)
    _dcp(run / "step_20", 20.0)
    _unlistable(monkeypatch, run / "step_10")
    found = latest_verified(run)
    assert found.step == 20 and found.report is not None and found.report.passed
    assert [u["path"] for u in found.unseen] == ["step_10"]
    assert any(f.check == "latest-unseen" and f.severity.value == "warning" for f in found.report.findings)


@pytest.mark.skipif(os.geteuid() == 0, reason="root lists any folder whatever its mode")
def test_a_folder_without_read_permission_is_said(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _dcp(run / "step_10", 10.0)
    _dcp(run / "step_20", 20.0)
    (run / "step_20").chmod(0)
    try:
        notes: list[WalkNote] = []
        find_checkpoints(run, notes=notes)
        assert [(n.kind, n.path) for n in notes] == [("unlisted", "step_20")]
        assert not scan_run_dir(run).passed
    finally:
        (run / "step_20").chmod(0o755)


def test_lost_and_found_is_not_entered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _dcp(run / "step_10", 10.0)
    (run / "lost+found").mkdir()
    _unlistable(monkeypatch, run / "lost+found")  # root-only on a real file system
    notes: list[WalkNote] = []
    assert [c.path for c in find_checkpoints(run, notes=notes)] == ["step_10"] and notes == []


# ---- retention during scan ---------------------------------------------------------------------------------


def test_a_checkpoint_deleted_during_scan_is_deleted_not_corrupt(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    for step in (10, 20, 30):
        _dcp(run / f"step_{step}", float(step))
    inj.flip_in_tensor_payload(run / "step_30", "w")  # really corrupt: must stay corrupt
    victim = run / "step_20"
    import ckptverify.audit.verify as verify_mod

    real = verify_mod.verify_checkpoint

    def retention_meanwhile(path: object, **kwargs: object) -> object:
        if os.path.abspath(os.fspath(path)) == str(victim):  # type: ignore[arg-type]
            # Retention's rmtree has taken the shards while the verification runs; the rest goes soon after.
            for shard in victim.glob("*.distcp"):
                shard.unlink()
            threading.Timer(0.2, shutil.rmtree, args=(victim,)).start()
        return real(path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(verify_mod, "verify_checkpoint", retention_meanwhile)
    monkeypatch.setattr(scan_mod, "SETTLE_SECONDS", 1.0)
    report = scan_run_dir(run)
    rows = {r["path"]: r for r in report.stats["checkpoints"]}
    assert rows["step_20"]["state"] == "deleted" and "removed while it was being verified" in rows["step_20"]["reason"]
    assert rows["step_30"]["state"] == "corrupt" and rows["step_10"]["state"] == "verified"
    assert not any(f.check == "scan" and "step_20" in f.message for f in report.errors)


def test_a_checkpoint_gone_before_scan_reaches_it_is_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _dcp(run / "step_10", 10.0)
    _dcp(run / "step_20", 20.0)
    real_judge = scan_mod._judge_bytes

    def judge_after_rmtree(root: str, cand: rundir.Candidate, jobs: int | None, deep: bool) -> object:
        if cand.path == "step_10":
            shutil.rmtree(run / "step_10")
        return real_judge(root, cand, jobs, deep)

    monkeypatch.setattr(scan_mod, "_judge_bytes", judge_after_rmtree)
    report = scan_run_dir(run)
    rows = {r["path"]: r["state"] for r in report.stats["checkpoints"]}
    assert rows == {"step_10": "deleted", "step_20": "verified"} and report.passed


# ---- a folder adopted with `fingerprint` -------------------------------------------------------------------


def test_a_folder_adopted_with_fingerprint_is_verified_by_scan_and_latest_as_by_verify(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    run = tmp_path / "run"
    _dcp(run / "checkpoint-10", 10.0)
    hf = run / "checkpoint-20"
    hf.mkdir(parents=True)
    save_file({"w": torch.full((64, 64), 20.0)}, str(hf / "model.safetensors"))  # safetensors: no checksum
    (hf / "config.json").write_text(json.dumps({"model_type": "toy"}))
    assert scan_run_dir(run).stats["checkpoints"][1]["state"] == "uncheckable"
    _, manifest = fingerprint_checkpoint(hf, trust_uncheckable=True)
    assert manifest is not None and verify_checkpoint(hf).passed and verify_checkpoint(hf).stats["manifest"]
    rows = {r["path"]: r["state"] for r in scan_run_dir(run).stats["checkpoints"]}
    assert rows == {"checkpoint-10": "verified", "checkpoint-20": "verified"}
    assert latest_verified(run, use_stamps=False).path == str(hf)
    inj.flip_bit(hf, "model.safetensors", (hf / "model.safetensors").stat().st_size - 3, 0)
    assert {r["path"]: r["state"] for r in scan_run_dir(run).stats["checkpoints"]}["checkpoint-20"] == "corrupt"


# ---- a weights-only DCP export -----------------------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                        torch.nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _train_state(seed: int) -> cv.TrainState:
    torch.manual_seed(seed)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100)
    return cv.TrainState(model=model, optimizer=opt, scheduler=sched)


def _step(state: cv.TrainState, n: int) -> None:
    for _ in range(n):
        x = torch.randn(32, 8)
        loss = torch.nn.functional.mse_loss(state.model(x), x[:, :4])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
        state.optimizers[0].step()
        state.schedulers[0].step()
        state.optimizers[0].zero_grad()
        state.counters.step += 1


def test_pick_passes_over_a_newer_weights_only_dcp_export(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = _train_state(0)
    _step(state, 10)
    cv.save(state, run / "step_10")
    saved = {k: v.clone() for k, v in state.model.state_dict().items()}
    _step(state, 10)
    # What `dcp.save(model.state_dict())` or a framework's weights export writes: DCP, verifiable, no TrainState.
    dcp.save(state.model.state_dict(), checkpoint_id=str(run / "step_20"))
    assert verify_checkpoint(run / "step_20").passed

    fresh = _train_state(1)
    report = cv.load(fresh, run, pick="latest-verified")
    assert report.stats["picked"] == str(run / "step_10") and report.stats["step"] == 10
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in saved.items())
    assert fresh.counters.step == 10
    (skipped,) = report.stats["skipped"]
    assert skipped["path"] == "step_20" and skipped["state"] == "other-format"
    assert "without the TrainState's keys" in skipped["reason"]
    # Retention keeps what load restores, behind the newer export.
    kept = {k["path"]: k["why"] for k in prune(run, keep=1, dry_run=True).kept}
    assert "load restores" in kept["step_10"]


# ---- Megatron Core's integrity.json ------------------------------------------------------------------------


def _megatron_like(path: Path) -> Path:
    """A DCP save with Megatron Core's side files, and its integrity record written as
    ``dist_checkpointing.validation.save_integrity_manifest`` writes it (every file but itself, sorted)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 8))
    dcp.save({"model": model.state_dict(), "iteration": 4}, checkpoint_id=str(path))
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}
    (path / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=2))
    return path


def _checks(report: object) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in report.findings:  # type: ignore[attr-defined]
        out.setdefault(f.check, []).append(f.location.file or "")
    return out


def test_integrity_json_is_megatrons_record_not_a_planted_file(tmp_path: Path) -> None:
    ckpt = _megatron_like(tmp_path / "iter_0000004")
    report = verify_checkpoint(ckpt)
    checks = _checks(report)
    assert "file-unreferenced" not in checks and report.passed, checks
    assert any(c.check == "integrity-record" and c.count == len(json.loads(
        (ckpt / "integrity.json").read_text())["files"]) for c in report.coverage)


def test_a_digest_mismatch_names_the_file(tmp_path: Path) -> None:
    ckpt = _megatron_like(tmp_path / "iter_0000004")
    inj.flip_bit(ckpt, "metadata.json", 2, 0)  # JSON: no checksum of its own; only the record sees it
    report = verify_checkpoint(ckpt)
    assert not report.passed and _checks(report)["integrity-mismatch"] == ["metadata.json"]


def test_a_listed_file_that_is_absent_is_an_error(tmp_path: Path) -> None:
    ckpt = _megatron_like(tmp_path / "iter_0000004")
    record = json.loads((ckpt / "integrity.json").read_text())
    record["files"]["common.pt"] = "0" * 64
    (ckpt / "integrity.json").write_text(json.dumps(record))
    report = verify_checkpoint(ckpt)
    assert not report.passed and _checks(report)["integrity-missing"] == ["common.pt"]


def test_a_file_the_record_leaves_out_or_cannot_read_is_reported(tmp_path: Path) -> None:
    from ckptverify.checks.sidefiles import check_integrity_record

    ckpt = _megatron_like(tmp_path / "iter_0000004")
    record = json.loads((ckpt / "integrity.json").read_text())
    del record["files"]["metadata.json"]
    os.symlink("/etc/hostname", ckpt / "common.pt")
    record["files"]["common.pt"] = "0" * 64
    (ckpt / "integrity.json").write_text(json.dumps(record))
    findings, _ = check_integrity_record(str(ckpt), "integrity.json")
    said = {(f.check, f.location.file) for f in findings}
    assert said == {("integrity-unlisted", "metadata.json"), ("integrity-missing", "common.pt")}, findings
    assert "common.pt is listed in integrity.json but cannot be read" in " ".join(f.message for f in findings)


def test_a_side_file_of_another_format_is_an_error(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from ckptverify.checks.sidefiles import check_side_files

    save_file({"w": torch.ones(2)}, str(tmp_path / "meta.pt"))
    findings, _, usable = check_side_files(str(tmp_path), ["meta.pt"])
    assert usable == ["meta.pt"] and [f.message for f in findings if f.check == "side-file"] == [
        "meta.pt should be Lightning's torch.save file, but its content is safetensors"]


def test_a_byte_flipped_in_integrity_json_after_fingerprint_is_caught(tmp_path: Path) -> None:
    ckpt = _megatron_like(tmp_path / "iter_0000004")
    fingerprint_checkpoint(ckpt)
    assert verify_checkpoint(ckpt).passed
    raw = (ckpt / "integrity.json").read_bytes()
    at = raw.index(b'"algorithm"') - 2  # whitespace of the indentation: the JSON still parses, same digests
    assert raw[at:at + 1] == b" "
    (ckpt / "integrity.json").write_bytes(raw[:at] + b"\t" + raw[at + 1:])
    report = verify_checkpoint(ckpt)
    assert not report.passed
    assert any(f.location.file == "integrity.json" for f in report.errors), _checks(report)


@pytest.mark.parametrize("content", [
    "[1, 2, 3]",
    '{"algorithm": "md5", "files": {}}',
    '{"algorithm": "sha256", "files": ["a", "b"]}',
    '{"algorithm": "sha256", "files": {"../../etc/passwd": "' + "0" * 64 + '"}}',
    '{"algorithm": "sha256", "files": {".metadata": 12}}',
    '{"algorithm": ["sha256"], "files": {}}',
    "[" * 100_000 + "]" * 100_000,
    '{"algorithm": "sha256", "files": {' + ", ".join(f'"f{i}": "{"0" * 64}"' for i in range(100_001)) + "}}",
], ids=["list", "md5", "files-list", "traversal", "digest-int", "algorithm-list", "deep", "huge"])
def test_a_hostile_integrity_json_is_a_finding_not_a_traceback(tmp_path: Path, content: str) -> None:
    ckpt = _megatron_like(tmp_path / "iter_0000004")
    (ckpt / "integrity.json").write_text(content)
    report = verify_checkpoint(ckpt)
    assert not report.passed
    assert any(f.location.file == "integrity.json" and f.check in ("integrity-invalid", "json-invalid")
               for f in report.errors), _checks(report)
    result = CliRunner().invoke(main, ["verify", str(ckpt), "--json"])
    assert (result.exit_code == 1 and result.exception is None) or isinstance(result.exception, SystemExit)


def test_a_dangling_link_where_a_shard_should_be_is_not_opened(tmp_path: Path) -> None:
    from ckptverify.checks.structure import check_files, stat_files
    from ckptverify.dcp.layout import Layout

    os.symlink(tmp_path / "gone", tmp_path / "__0_0.distcp")  # points inside the checkpoint, at nothing
    findings = check_files(str(tmp_path), Layout(), stat_files(str(tmp_path), ["__0_0.distcp"]), unreferenced=False)
    assert [(f.check, f.message.split(";")[0]) for f in findings] == [
        ("file-unsafe", "__0_0.distcp cannot be examined (No such file or directory)")]


def test_verify_refuses_fewer_than_one_job(tmp_path: Path) -> None:
    from ckptverify.errors import UsageError

    with pytest.raises(UsageError, match="--jobs must be at least 1, got 0"):
        verify_checkpoint(tmp_path, jobs=0)
