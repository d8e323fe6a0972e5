"""The command line's one house: every command has ``--json`` (the one report schema), every command that checks
has ``--metrics-file``, every command that can run long has ``--progress``, and an option name means one thing,
said by one help text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import click
import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from helpers import faults as inj

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.cli import main
from ckptverify.findings import REPORT_SCHEMA, REPORT_SCHEMA_VERSION
from ckptverify.ownfiles.manifest import MANIFEST_FILE
from ckptverify.trace.store import Cell, TraceHeader, TraceWriter

#: Every command, by its command line (``trace diff`` is a subcommand of ``trace``).
COMMANDS = ("verify", "fingerprint", "diff", "scan", "latest", "watch", "resume-check", "replay", "compare", "demo",
            "trace diff")
#: The commands that check something, and so can feed an alert.
CHECKS = ("verify", "fingerprint", "diff", "scan", "latest", "watch", "resume-check", "replay", "compare",
          "trace diff")
#: The commands that can run long (they read whole checkpoints or launch training). ``watch`` runs until
#: stopped and prints one line per result: those lines are its progress.
LONG = ("verify", "fingerprint", "diff", "scan", "latest", "resume-check", "replay", "compare", "demo")
#: The keys of a report (docs/json-schema.md).
REPORT_KEYS = {"schema", "schema_version", "tool", "command", "target", "passed", "exit_code", "summary", "coverage",
               "findings", "stats"}


def _command(name: str) -> click.Command:
    cmd: Any = main
    for part in name.split():
        cmd = cmd.commands[part]
    return cmd


def _options(name: str, *, hidden: bool = False) -> set[str]:
    return {opt for p in _command(name).params if isinstance(p, click.Option) and (hidden or not p.hidden)
            for opt in (*p.opts, *p.secondary_opts)}


def test_the_option_matrix() -> None:
    assert set(COMMANDS) == {n for n in main.commands if n != "trace"} | {"trace diff"}
    for name in COMMANDS:
        options = _options(name)
        assert "--json" in options, name
        assert ("--metrics-file" in options) == (name in CHECKS), name
        assert ({"--progress", "--no-progress"} <= options) == (name in LONG), name
        assert ("--deep" in options) == (name in ("verify", "scan", "watch")), name
    assert {"--ignore"} <= _options("diff") and {"--ignore"} <= _options("trace diff")


def test_force_means_replace_and_nothing_else() -> None:
    shown = [name for name in COMMANDS if "--force" in _options(name, hidden=True)]
    assert shown == ["fingerprint"]
    assert "replace" in (next(p for p in _command("fingerprint").params if p.name == "force").help or "").lower()


def _help(name: str, option: str) -> str:
    return next(p.help or "" for p in _command(name).params if isinstance(p, click.Option) and option in p.opts)


def test_an_option_name_has_one_help_text_and_the_defaults_say_which_commands_differ() -> None:
    shared = ("--json", "--metrics-file", "--progress", "--jobs", "--deep", "--device", "--keep", "--nproc",
              "--readers", "--rank-timeout", "--no-cluster", "--locate", "--locate-repeats")
    for option in shared:
        # One text, to which a command may add its own default or where its results are.
        texts = {_help(name, option).split(" [default:")[0] for name in COMMANDS if option in _options(name)}
        common = min(texts, key=len).rstrip(".")
        assert len(common) > 20 and all(text.startswith(common) for text in texts), (option, texts)
    assert {_help(name, "--progress") for name in LONG} == {
        "Show progress on stderr [default: on a terminal, without --json].",
        "Show progress on stderr [default: on, without --json]."}
    # No hidden option: nothing was released, so there is no old spelling to read.
    assert not [n for n in COMMANDS if any(p.hidden for p in _command(n).params if isinstance(p, click.Option))]


def test_nproc_is_ranks_per_training_run_and_readers_share_the_reading() -> None:
    # torchrun's meaning: --nproc is the ranks of each training run a command launches; the commands that share
    # the reading of a checkpoint among processes call them readers.
    assert [n for n in COMMANDS if "--nproc" in _options(n)] == ["resume-check", "compare", "demo"]
    shared = [n for n in COMMANDS if "--readers" in _options(n)]
    assert shared == ["verify", "fingerprint", "scan"]
    assert all({"--rank-timeout", "--no-cluster"} <= _options(n) for n in shared)


def _dcp(path: Path, value: float) -> Path:
    dcp.save({"w": torch.full((16, 16), value), "step": int(value)}, checkpoint_id=str(path))
    return path


@pytest.fixture
def run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    _dcp(root / "step_10", 10.0)
    fingerprint_checkpoint(_dcp(root / "step_20", 20.0))
    inj.flip_in_tensor_payload(_dcp(root / "step_30", 30.0), "w")  # the newest is corrupt
    return root


def _trace(path: Path, *, level: str = "metrics", loss_at_7: float = 0.0, extra: bool = False) -> Path:
    header = TraceHeader(run=path.name, level=level, rank=0, world_size=1)
    with TraceWriter(path, header=header, background=False) as w:
        for step in range(1, 11):
            cells = [Cell.from_float("metric.loss", "metric", step * 1.5 + (loss_at_7 if step == 7 else 0.0)),
                     Cell.from_int("counter.step", "counter", step)]
            if extra:
                cells.append(Cell.from_int("metric.wall_ms", "metric", step * 13))
            w.append(step, cells)
    return path


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "200"})


def _report(result: Any) -> dict[str, Any]:
    data = json.loads(result.stdout)
    assert set(data) >= REPORT_KEYS, sorted(REPORT_KEYS - set(data))
    assert data["schema"] == REPORT_SCHEMA and data["schema_version"] == REPORT_SCHEMA_VERSION
    assert data["exit_code"] == result.exit_code and data["passed"] == (result.exit_code == 0)
    return data


def test_every_checking_command_prints_the_one_report_schema(run: Path, tmp_path: Path) -> None:
    good, bad = str(run / "step_20"), str(run / "step_30")
    a, b = str(_trace(tmp_path / "a")), str(_trace(tmp_path / "b", loss_at_7=1.0))
    copy = tmp_path / "copy"
    shutil.copytree(run / "step_10", copy)
    cases = ((["verify"], [good], 0), (["verify"], [bad], 1), (["fingerprint"], [str(copy)], 0),
             (["diff"], [good, bad], 1), (["scan"], [str(run)], 1), (["latest"], [str(run)], 0),
             (["trace", "diff"], [a, a], 0), (["trace", "diff"], [a, b], 1))
    for words, paths, code in cases:
        result = _invoke(*words, "--json", *paths)
        assert result.exit_code == code, (words, result.output)
        assert _report(result)["command"] == " ".join(words)


def test_latest_json_is_a_report_with_the_pick_in_stats(run: Path) -> None:
    result = _invoke("latest", "--json", str(run))
    data = _report(result)
    assert result.exit_code == 0
    stats = data["stats"]
    assert stats["path"] == str(run / "step_20") and stats["step"] == 20
    assert [s["path"] for s in stats["skipped"]] == ["step_30"] and stats["quarantined"] == []
    assert {f["check"] for f in data["findings"]} == {"latest", "latest-skipped"}
    assert set(data) == REPORT_KEYS  # the one report schema, nothing besides
    none = run.parent / "none"
    shutil.copytree(run / "step_30", none / "step_30")
    data = _report(_invoke("latest", "--json", str(none)))
    assert data["stats"]["path"] is None and data["exit_code"] == 1


def _gauges(path: Path) -> dict[str, float]:
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]
    return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines}


def test_metrics_file_on_every_checking_command(run: Path, tmp_path: Path) -> None:
    prom = tmp_path / "m.prom"
    a, b = str(_trace(tmp_path / "a")), str(_trace(tmp_path / "b", loss_at_7=1.0))
    copy = tmp_path / "copy"
    shutil.copytree(run / "step_10", copy)
    cases = ((["fingerprint", str(copy)], "fingerprint", 0), (["diff", str(run / "step_10"), str(run / "step_20")],
                                                              "diff", 1),
             (["latest", str(run)], "latest", 0), (["latest", "--path-only", str(run)], "latest", 0),
             (["trace", "diff", a, b], "trace diff", 1), (["trace", "diff", a, a], "trace diff", 0))
    for args, command, code in cases:
        prom.unlink(missing_ok=True)
        result = _invoke(*args, "--metrics-file", str(prom))
        assert result.exit_code == code, (args, result.output)
        text = prom.read_text()
        assert f'ckptverify_passed{{command="{command}"' in text, text
        values = _gauges(prom)
        assert values["ckptverify_passed"] == (code == 0) and values["ckptverify_errors"] >= code, (args, text)
        if command == "latest":
            assert values["ckptverify_last_good_step"] == 20
    assert _invoke("fingerprint", "--metrics-file", str(tmp_path / "no" / "m.prom"), "--force",
                   str(copy)).exit_code == 2


def test_metrics_file_of_latest_with_nothing_good_says_minus_one(run: Path, tmp_path: Path) -> None:
    root = tmp_path / "bad"
    shutil.copytree(run / "step_30", root / "step_30")
    prom = tmp_path / "m.prom"
    assert _invoke("latest", "--json", "--metrics-file", str(prom), str(root)).exit_code == 1
    values = _gauges(prom)
    assert values["ckptverify_passed"] == 0 and values["ckptverify_last_good_step"] == -1


def test_progress_is_shown_on_stderr_only_when_asked(run: Path) -> None:
    for command in ("scan", "latest"):
        shown = _invoke(command, "--progress", str(run))
        assert "1/3 step_" in shown.stderr, (command, shown.stderr)
        quiet = _invoke(command, "--no-progress", str(run))
        assert "1/3" not in quiet.stderr, (command, quiet.stderr)
        # Not a terminal, so no progress by default; with --json stdout stays one JSON document either way.
        assert "1/3" not in _invoke(command, str(run)).stderr
        both = _invoke(command, "--json", "--progress", str(run))
        assert "1/3" in both.stderr and json.loads(both.stdout)["command"] == command
    only = _invoke("latest", "--path-only", "--progress", str(run))
    assert only.stdout == f"{run / 'step_20'}\n" and "1/3" in only.stderr


def test_scan_deep_rebuilds_tensors(run: Path) -> None:
    from ckptverify.ownfiles.manifest import _self_digest

    manifest = run / "step_20" / MANIFEST_FILE
    data = json.loads(manifest.read_text())
    name = next(k for k, t in data["tensors"].items() if t["fingerprint"])
    data["tensors"][name]["fingerprint"] = "f" * 32  # bytes as saved, values not what memory held
    data["self_digest"] = _self_digest({k: v for k, v in data.items() if k != "self_digest"})
    manifest.write_text(json.dumps(data))
    shutil.rmtree(run / "step_30")
    shallow = _report(_invoke("scan", "--json", str(run)))
    assert shallow["exit_code"] == 0 and not shallow["stats"]["deep"]
    assert {r["path"]: r["state"] for r in shallow["stats"]["checkpoints"]}["step_20"] == "verified"
    deep = _invoke("scan", "--deep", "--json", str(run))
    data = _report(deep)
    assert deep.exit_code == 1 and data["stats"]["deep"]
    row = {r["path"]: r for r in data["stats"]["checkpoints"]}["step_20"]
    assert row["state"] == "corrupt" and "fingerprint" in row["reason"], row
    assert {r["path"]: r["state"] for r in data["stats"]["checkpoints"]}["step_10"] == "intact"


def test_trace_diff_ignore_leaves_out_matching_sites(tmp_path: Path) -> None:
    a, b = str(_trace(tmp_path / "a")), str(_trace(tmp_path / "b", loss_at_7=1.0))
    assert _invoke("trace", "diff", a, b).exit_code == 1
    result = _invoke("trace", "diff", "--json", "--ignore", "metric.*", a, b)
    data = _report(result)
    assert result.exit_code == 0, result.output
    (ignored,) = [f for f in data["findings"] if f["check"] == "trace-ignored"]
    assert ignored["severity"] == "info" and ignored["actual"]["sites"] == ["metric.loss"]
    # A pattern that leaves out a site the other trace does not record: no difference from it either.
    c = str(_trace(tmp_path / "c", extra=True))
    assert _invoke("trace", "diff", a, c).exit_code == 1
    assert _invoke("trace", "diff", "--ignore", "*.wall_ms", a, c).exit_code == 0
    # Ignoring every site compares nothing, which never passes.
    nothing = _report(_invoke("trace", "diff", "--json", "--ignore", "*", a, a))
    assert nothing["exit_code"] == 1
    assert [f["severity"] for f in nothing["findings"] if f["check"] == "trace-ignored"] == ["error"]


def test_trace_diff_compares_different_headers_only_when_allowed(tmp_path: Path) -> None:
    a, b = str(_trace(tmp_path / "a")), str(_trace(tmp_path / "b", level="state"))
    refused = _invoke("trace", "diff", a, b)
    assert refused.exit_code == 2 and "headers differ" in refused.stderr and "--allow-header-mismatch" in refused.stderr
    assert "force=True" not in refused.stderr  # the advice names this command's option, not the Python keyword
    allowed = _invoke("trace", "diff", "--allow-header-mismatch", "--json", a, b)
    assert allowed.exit_code == 0 and _report(allowed)["passed"] and not allowed.stderr, allowed.output


def test_watch_prints_text_by_default_and_json_lines_only_with_json(run: Path, tmp_path: Path) -> None:
    shutil.rmtree(run / "step_30")
    twin = tmp_path / "twin"
    shutil.copytree(run, twin)
    text = _invoke("watch", "--once", "--poll", "--log", str(tmp_path / "w.jsonl"), str(run))
    assert text.exit_code == 0 and "verified: step_20 (step 20): verified, 0 error(s)" in text.stdout, text.output
    assert not text.stdout.lstrip().startswith("{")
    lines = _invoke("watch", "--once", "--poll", "--json", "--log", str(tmp_path / "w2.jsonl"), str(twin))
    items = [json.loads(line) for line in lines.stdout.splitlines()]
    assert lines.exit_code == 0 and {(i["event"], i["path"]) for i in items} == {("verified", "step_10"),
                                                                                  ("verified", "step_20")}
    # The lines are the watch log's lines, unchanged.
    logged = [json.loads(line) for line in (tmp_path / "w2.jsonl").read_text().splitlines()]
    assert items == logged
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _invoke("watch", "--once", "--poll", "--json", "--log", str(tmp_path / "w3.jsonl"), str(empty))
    (line,) = out.stdout.splitlines()
    assert out.exit_code == 2 and json.loads(line)["event"] == "nothing"  # checking nothing is a usage error


# ---------------------------------------------------------------- what our own processes pass each other


_DEVICE_TARGET = '''
import json
import sys

import torch

from ckptverify import TrainState


def train(run):
    model = torch.nn.Linear(2, 2)
    run.restore(TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3)))
    with open(OUT, "w") as f:
        json.dump({"device": run.device, "env": sorted(k for k in __import__("os").environ
                                                        if k.startswith("CKPTVERIFY_")
                                                        and k != "CKPTVERIFY_STRICT_EVENTS")}, f)  # the suite's
'''


def test_the_device_and_the_plan_reach_the_workload_as_arguments_not_through_the_environment(tmp_path: Path) -> None:
    from ckptverify.resume.launch import launch_jobs
    from ckptverify.resume.run import Run, RunConfig

    out = tmp_path / "seen.json"
    script = tmp_path / "house_device_target.py"
    script.write_text(f"OUT = {str(out)!r}\n" + _DEVICE_TARGET)
    launch_jobs(1, "cpu", [(f"{script}:train", RunConfig(name="A", stop_step=1))])
    assert json.loads(out.read_text()) == {"device": "cpu", "env": []}
    assert Run(RunConfig()).device is None  # no launcher of ours: nothing claimed


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_the_verifier_process_gets_its_priority_and_hurry_pipe_as_arguments(run: Path) -> None:
    import os

    from ckptverify.verifier.jobs import STAMP
    from ckptverify.verifier.worker import VerifierProcess

    proc = VerifierProcess("low")
    try:
        result = proc.run(STAMP, {"path": str(run / "step_20"), "step": 20, "deep": False, "jobs": 1, "settle": 0.0})
        assert result["verdict"] == "passed", result
        assert proc._proc is not None
        pid = proc._proc.pid
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"--priority" in argv and argv[argv.index(b"--priority") + 1] == b"low"
        assert b"--hurry-fd" in argv and b"--waiter-nice" in argv
        env = [e for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e.startswith(b"CKPTVERIFY_")]
        assert env == [k for k in env if not k.startswith((b"CKPTVERIFY_VERIFY_PRIORITY", b"CKPTVERIFY_VERIFY_HURRY",
                                                           b"CKPTVERIFY_VERIFY_WAITER"))]
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19  # "low", read from its command line
    finally:
        proc.close()


def test_verify_of_a_run_directory_names_its_checkpoints_and_says_when_it_saw_only_part(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptverify.formats import rundir

    run = tmp_path / "run"
    for step in (1, 2):
        dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=str(run / f"step_{step}"))
    result = CliRunner().invoke(main, ["verify", str(run)])
    assert result.exit_code == 2 and "holding 2 checkpoint(s) (newest seen: step_2)" in result.output, result.output
    monkeypatch.setattr(rundir, "MAX_FOLDER_ENTRIES", 20)
    for i in range(30):
        (run / f"log{i:02d}.txt").write_bytes(b"")
    result = CliRunner().invoke(main, ["verify", str(run)])
    assert result.exit_code == 2 and "holding at least" in result.output, result.output
