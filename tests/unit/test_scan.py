"""``scan RUN_DIR``: every checkpoint of a run, its state, and the newest good one."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from helpers import faults as inj

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.cli import main
from ckptverify.formats.rundir import find_checkpoints, step_of
from ckptverify.runs.scan import scan_run_dir


@pytest.mark.parametrize(("name", "step"), [
    ("step-100", 100), ("step_7", 7), ("checkpoint-250", 250), ("iter_0000300", 300), ("global_step12", 12),
    ("epoch=0-step=40.ckpt", 40), ("epoch=3.ckpt", None), ("last.ckpt", None), ("42", 42), ("best", None),
])
def test_step_is_read_from_the_names_frameworks_use(name: str, step: int | None) -> None:
    assert step_of(name) == step


def _dcp(path: Path, value: float) -> Path:
    dcp.save({"w": torch.full((64, 64), value), "step": int(value)}, checkpoint_id=str(path))
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    ckpts = run / "checkpoint"
    _dcp(ckpts / "step-10", 10.0)
    fingerprint_checkpoint(_dcp(ckpts / "step-20", 20.0))
    bad = _dcp(ckpts / "step-30", 30.0)
    inj.flip_in_tensor_payload(bad, "w")
    torn = _dcp(ckpts / "step-40", 40.0)
    os.remove(torn / ".metadata")
    torch.save({"w": torch.ones(2)}, run / "last.ckpt")
    (run / "logs").mkdir()
    (run / "logs" / "events.txt").write_text("not a checkpoint")
    return run


def test_scan_names_each_state_and_the_newest_good_checkpoint(run_dir: Path) -> None:
    report = scan_run_dir(run_dir)
    states = {r["path"]: r["state"] for r in report.stats["checkpoints"]}
    assert states == {"checkpoint/step-10": "intact", "checkpoint/step-20": "verified",
                      "checkpoint/step-30": "corrupt", "checkpoint/step-40": "incomplete",
                      "last.ckpt": "intact"}
    assert [r["step"] for r in report.stats["checkpoints"]] == [None, 10, 20, 30, 40]
    assert report.stats["newest_good"] == {"path": "checkpoint/step-20", "step": 20}
    assert report.exit_code == 1 and [f.location.file for f in report.errors] == ["checkpoint/step-30"]
    assert report.coverage[0].count == 5
    shutil.rmtree(run_dir / "checkpoint" / "step-30")
    assert scan_run_dir(run_dir).exit_code == 0


def test_scan_cli_text_and_json(run_dir: Path) -> None:
    text = CliRunner().invoke(main, ["scan", str(run_dir)], env={"COLUMNS": "200"})
    assert text.exit_code == 1 and "newest good: checkpoint/step-20 (step 20)" in text.output
    as_json = CliRunner().invoke(main, ["scan", "--json", str(run_dir)])
    data = json.loads(as_json.output)
    assert as_json.exit_code == 1 and data["stats"]["newest_good"]["step"] == 20
    empty = run_dir.parent / "empty"
    empty.mkdir()
    assert CliRunner().invoke(main, ["scan", str(empty)]).exit_code == 2
    assert json.loads(CliRunner().invoke(main, ["scan", "--json", str(empty)]).output)["exit_code"] == 2


def test_the_walk_follows_no_link_and_opens_no_special_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _dcp(run / "step_1", 1.0)
    outside = _dcp(tmp_path / "outside" / "step_2", 2.0)
    os.symlink(outside, run / "step_2")
    os.mkfifo(run / "step_3.pt")  # would block a reader forever
    os.symlink("/dev/zero", run / "step_4.pt")
    found = find_checkpoints(run)
    assert [c.path for c in found] == ["step_1"]
    assert scan_run_dir(run).exit_code == 0


def test_composite_checkpoints_check_their_dcp_parts_and_side_files(tmp_path: Path) -> None:
    run = tmp_path / "out"
    ck = run / "checkpoint-5"
    _dcp(ck / "pytorch_model_fsdp_0", 1.0)
    _dcp(ck / "optimizer_0", 2.0)
    (ck / "trainer_state.json").write_text("{}")
    (found,) = find_checkpoints(run)
    assert (found.format, found.step, sorted(found.parts)) == ("composite", 5, ["optimizer_0", "pytorch_model_fsdp_0"])
    (row,) = scan_run_dir(run).stats["checkpoints"]
    assert row["state"] == "intact" and "optimizer_0/: intact" in row["reason"]
    (ck / "trainer_state.json").write_text("{torn")
    (row,) = scan_run_dir(run).stats["checkpoints"]
    assert row["state"] == "corrupt" and "json-invalid" in row["reason"]
    inj.flip_in_tensor_payload(ck / "optimizer_0", "w")
    (ck / "trainer_state.json").write_text("{}")
    (row,) = scan_run_dir(run).stats["checkpoints"]
    assert row["state"] == "corrupt" and "optimizer_0/: corrupt" in row["reason"]


def test_metrics_file_has_prometheus_gauges(run_dir: Path, tmp_path: Path) -> None:
    metrics = tmp_path / "ckptverify.prom"
    result = CliRunner().invoke(main, ["scan", "--json", "--metrics-file", str(metrics), str(run_dir)])
    assert result.exit_code == 1
    lines = [ln for ln in metrics.read_text().splitlines() if not ln.startswith("#")]
    values = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines}
    assert values["ckptverify_passed"] == 0 and values["ckptverify_last_good_step"] == 20
    assert values["ckptverify_corrupt_checkpoints"] == 1 and values["ckptverify_checkpoints"] == 5
    assert all(f'target="{run_dir}"' in ln for ln in lines)
    good = run_dir / "checkpoint" / "step-20"
    ok = CliRunner().invoke(main, ["verify", "--no-progress", "--metrics-file", str(metrics), str(good)])
    assert ok.exit_code == 0
    text = metrics.read_text()
    assert 'ckptverify_passed{command="verify"' in text and "ckptverify_bytes_checked" in text
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckptverify-metrics-")]
    bad = CliRunner().invoke(main, ["verify", "--metrics-file", str(tmp_path / "no" / "dir.prom"), str(good)])
    assert bad.exit_code == 2


# ------------------------------------------------------------------------------------ the quarantine


def _quarantined_run(tmp_path: Path, *, recovered_to: int | None) -> Path:
    """A production run directory whose step_4 failed verification and was moved aside, as the job moves it
    (:func:`~ckptverify.runs.latest.move_aside`), with good checkpoints of steps 2 and ``recovered_to`` (none
    when ``None``) outside the quarantine."""
    from ckptverify.runs.latest import move_aside

    run = tmp_path / "run"
    fingerprint_checkpoint(_dcp(run / "step_2", 2.0))
    inj.flip_in_tensor_payload(_dcp(run / "step_4", 4.0), "w")
    move_aside(run, "step_4")
    if recovered_to is not None:
        fingerprint_checkpoint(_dcp(run / f"step_{recovered_to}", float(recovered_to)))
    return run


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("recovered_to", [4, 6])
def test_a_quarantined_corrupt_checkpoint_of_a_recovered_job_is_a_warning_and_scan_passes(
        tmp_path: Path, recovered_to: int) -> None:
    run = _quarantined_run(tmp_path, recovered_to=recovered_to)
    before = _tree(run / "quarantine")
    report = scan_run_dir(run)
    rows = {r["path"]: r for r in report.stats["checkpoints"]}
    (moved,) = [p for p in rows if p.startswith("quarantine/")]
    assert rows[moved]["state"] == "corrupt" and rows[moved]["quarantined"]
    assert rows[moved]["handled_by"] == {"path": f"step_{recovered_to}", "step": recovered_to}
    assert "handled: the job moved it aside and recovered" in rows[moved]["reason"]
    assert all(r["handled_by"] is None for p, r in rows.items() if p != moved)
    assert report.exit_code == 0 and not report.errors
    assert [f.location.file for f in report.warnings] == [moved]
    assert _tree(run / "quarantine") == before  # judged, never moved, changed or deleted

    text = CliRunner().invoke(main, ["scan", str(run)], env={"COLUMNS": "250"})
    assert text.exit_code == 0 and "handled: the job moved it aside and recovered" in text.output, text.output
    as_json = CliRunner().invoke(main, ["scan", "--json", str(run)])
    data = json.loads(as_json.output)
    assert as_json.exit_code == 0 and data["passed"]
    (row,) = [r for r in data["stats"]["checkpoints"] if r["quarantined"]]
    assert row["handled_by"]["step"] == recovered_to
    (finding,) = [f for f in data["findings"] if f["severity"] == "warning"]
    assert "handled" in finding["message"]
    # Monitoring clears: the gauge an alert reads counts no corrupt checkpoint that was handled.
    from ckptverify.render.metrics import render_metrics

    gauges = render_metrics(report, now=0.0)
    assert re.search(r"^ckptverify_corrupt_checkpoints\{[^}]*\} 0$", gauges, re.M), gauges
    assert re.search(r"^ckptverify_passed\{[^}]*\} 1$", gauges, re.M), gauges
    assert "(quarantined, handled)" in text.output


def test_a_quarantined_corrupt_checkpoint_the_job_has_not_got_past_still_fails(tmp_path: Path) -> None:
    run = _quarantined_run(tmp_path, recovered_to=None)
    report = scan_run_dir(run)
    (row,) = [r for r in report.stats["checkpoints"] if r["quarantined"]]
    assert row["state"] == "corrupt" and row["handled_by"] is None and "handled" not in row["reason"]
    assert report.exit_code == 1 and [f.location.file for f in report.errors] == [row["path"]]


def test_a_corrupt_checkpoint_outside_the_quarantine_fails_even_with_a_newer_good_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    inj.flip_in_tensor_payload(_dcp(run / "step_4", 4.0), "w")
    fingerprint_checkpoint(_dcp(run / "step_6", 6.0))
    report = scan_run_dir(run)
    assert report.exit_code == 1 and [f.location.file for f in report.errors] == ["step_4"]
    assert all(r["handled_by"] is None for r in report.stats["checkpoints"])
    assert CliRunner().invoke(main, ["scan", str(run)]).exit_code == 1


def test_a_checkpoint_too_large_for_the_walks_budget_is_measured_in_part_and_says_so(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    import ckptverify.formats.rundir as rundir

    big = tmp_path / "step_2"
    (big / "a" / "b").mkdir(parents=True)
    for i in range(6):
        (big / "a" / "b" / f"{i}.distcp").write_bytes(b"x" * 10)
    (big / ".metadata").write_bytes(b"m")
    small = tmp_path / "step_1"
    small.mkdir()
    (small / ".metadata").write_bytes(b"m")
    (small / "0.distcp").write_bytes(b"y" * 7)
    notes: list = []
    whole = {c.path: c.size for c in find_checkpoints(tmp_path, notes=notes)}
    assert whole == {"step_1": 8, "step_2": 61} and notes == []

    monkeypatch.setattr(rundir, "MAX_ENTRIES", 8)  # the run's folders and files, then a few entries of step_2
    cut = {c.path: c.size for c in find_checkpoints(tmp_path, notes=notes)}
    assert cut["step_1"] == 8 and cut["step_2"] < 61
    assert [(n.kind, n.path) for n in notes] == [("budget", "step_2")]
    assert "ran out while measuring step_2" in notes[0].detail
