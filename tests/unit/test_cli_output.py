"""The command line never lets a checkpoint's names drive the terminal, and never answers with a traceback.

Names (FQNs, file names) come from the checkpoint and may be hostile: rich markup must not be parsed (it
crashed the table before), terminal escapes must be shown, not sent. ``--json`` prints JSON for every way a
command can end, click's own usage errors included. ``--strict`` and ``--trust-uncheckable`` fail closed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from helpers import faults as inj

from ckptverify.cli import main

HOSTILE = "layer[/].[bold]w\x1b[31m\x1b]0;pwned\x07\u202e:train:"


def _save(path: Path, state: dict) -> Path:
    dcp.save(state, checkpoint_id=str(path))
    return path


def test_hostile_names_are_shown_escaped_and_never_interpreted(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt", {HOSTILE: torch.arange(4096, dtype=torch.float32), "ok": torch.ones(3)})
    fault = inj.flip_in_tensor_payload(path, HOSTILE)
    assert fault.fqn == HOSTILE
    result = CliRunner().invoke(main, ["verify", "--no-progress", str(path)], env={"COLUMNS": "400"})
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    out = result.output
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    # Shown literally, markup and all: the reader sees the real name, escaped.
    assert "layer[/].[bold]w\\x1b[31m\\x1b]0;pwned\\x07\\u202e:train:" in out
    assert "🚋" not in out

    as_json = CliRunner().invoke(main, ["verify", "--json", "--no-progress", str(path)])
    data = json.loads(as_json.output)
    assert as_json.exit_code == 1 and any(f["location"].get("fqn") == HOSTILE for f in data["findings"])


def test_click_usage_errors_are_json_with_json(tmp_path: Path) -> None:
    for argv in (["verify", "--json", "--jobs", "0", str(tmp_path)],
                 ["verify", "--json", "--no-such-option", str(tmp_path)],
                 ["diff", "--json", str(tmp_path)]):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 2, (argv, result.output)
        data = json.loads(result.output)
        assert data["exit_code"] == 2 and data["passed"] is False and data["error"]
    plain = CliRunner().invoke(main, ["verify", "--jobs", "0", str(tmp_path)])
    assert plain.exit_code == 2 and "Invalid value" in plain.output


def test_missing_path_is_exit_2_in_text_and_json(tmp_path: Path) -> None:
    gone = str(tmp_path / "nope")
    assert CliRunner().invoke(main, ["verify", gone]).exit_code == 2
    result = CliRunner().invoke(main, ["verify", "--json", gone])
    assert result.exit_code == 2 and json.loads(result.output)["error"]


def test_an_internal_error_is_one_line_and_exit_2(tmp_path: Path, monkeypatch) -> None:
    import ckptverify.audit.verify as verify_mod

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(verify_mod, "verify_checkpoint", broken)
    monkeypatch.delenv("CKPTVERIFY_DEBUG", raising=False)
    result = CliRunner().invoke(main, ["verify", "--no-progress", str(tmp_path)])
    assert result.exit_code == 2
    assert "Traceback" not in result.output and "internal error (RuntimeError: boom)" in result.output
    as_json = CliRunner().invoke(main, ["verify", "--json", str(tmp_path)])
    assert as_json.exit_code == 2 and "boom" in json.loads(as_json.output)["error"]


def test_an_interrupt_is_aborted_with_130_and_an_exit_passes_through(tmp_path: Path, monkeypatch) -> None:
    import ckptverify.audit.verify as verify_mod

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_mod, "verify_checkpoint", interrupted)
    result = CliRunner().invoke(main, ["verify", "--no-progress", str(tmp_path)])
    assert result.exit_code == 130 and "Aborted!" in result.output and "internal error" not in result.output

    def exits(*args, **kwargs):
        raise SystemExit(7)

    monkeypatch.setattr(verify_mod, "verify_checkpoint", exits)
    result = CliRunner().invoke(main, ["verify", "--no-progress", str(tmp_path)])
    assert result.exit_code == 7 and "internal error" not in result.output
    assert CliRunner().invoke(main, ["--version"]).exit_code == 0


def test_fingerprint_force_never_replaces_a_manifest_that_is_not_a_file(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt", {"w": torch.randn(8, 8)})
    (path / "ckptverify.manifest.json").mkdir()
    for argv in (["fingerprint", "--force", "--no-progress", str(path)],
                 ["fingerprint", "--force", "--json", str(path)]):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 2 and "not a regular file" in result.output, result.output
    assert os.path.isdir(path / "ckptverify.manifest.json")


def test_strict_and_trust_uncheckable_fail_closed(tmp_path: Path) -> None:
    torch.serialization.set_crc32_options(False)
    try:
        path = _save(tmp_path / "nocrc", {"w": torch.randn(16, 16), "step": 3})
    finally:
        torch.serialization.set_crc32_options(True)
    runner = CliRunner()
    assert runner.invoke(main, ["verify", "--no-progress", str(path)]).exit_code == 0
    strict = runner.invoke(main, ["verify", "--strict", "--json", str(path)])
    data = json.loads(strict.output)
    assert strict.exit_code == 1
    assert {f["check"] for f in data["findings"] if f["severity"] == "error"} == {"content-uncheckable"}

    refused = runner.invoke(main, ["fingerprint", "--json", str(path)])
    assert refused.exit_code == 1 and not (path / "ckptverify.manifest.json").exists()
    assert "fingerprint-refused" in {f["check"] for f in json.loads(refused.output)["findings"]}
    adopted = runner.invoke(main, ["fingerprint", "--trust-uncheckable", "--json", str(path)])
    checks = {f["check"] for f in json.loads(adopted.output)["findings"]}
    assert adopted.exit_code == 0 and {"fingerprint-trusted", "content-uncheckable"} <= checks
    # Once a manifest covers the bytes they are checked: strict passes.
    assert runner.invoke(main, ["verify", "--strict", "--no-progress", str(path)]).exit_code == 0
