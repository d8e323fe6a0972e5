"""``verify``'s start-up: the command imports only what the checkpoint in hand needs.

A cron job or ``watch`` over many checkpoints pays the command's imports once per checkpoint
(``scripts/bench_startup.py`` times it). Timing is noisy on a shared machine, so these tests check the cause
instead: in a fresh interpreter, which modules one ``verify`` left in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Never needed by ``verify --json`` of a plain DCP checkpoint without a manifest.
NOT_FOR_PLAIN_JSON = (
    "torch",
    "numpy",
    "rich",
    "socket",
    "importlib.abc",
    "ckptverify.checks.deep",
    "ckptverify.checks.folder",
    "ckptverify.checks.single",
    "ckptverify.checks.transformed",
    "ckptverify.dcp.safetensors",
    "ckptverify.fingerprint",
    "ckptverify.formats.dcp",
    "ckptverify.formats.describe",
    "ckptverify.resume",
    "ckptverify.trace",
    "ckptverify.state",
    "ckptverify.checkpoint",
    "ckptverify.verifier",
    "ckptverify.render.resume",
)

_RUN = """
import json, sys
from ckptverify.cli import main
code = 0
try:
    main(sys.argv[2:], standalone_mode=False)
except SystemExit as exc:
    code = exc.code
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def run_verify(tmp_path: Path, *args: str) -> tuple[int, set[str], str]:
    """Run the command line in a fresh interpreter; its exit code, the modules it imported, its stdout."""
    record = tmp_path / "modules.json"
    done = subprocess.run([sys.executable, "-c", _RUN, str(record), "verify", *args], capture_output=True,
                          text=True, timeout=300)
    assert record.exists(), done.stderr
    got = json.loads(record.read_text())
    return got["code"], set(got["modules"]), done.stdout


def loaded(modules: set[str], name: str) -> bool:
    """``name`` or any of its submodules was imported."""
    return name in modules or any(m.startswith(name + ".") for m in modules)


def test_plain_json_verify_imports_only_its_path(fresh_ckpt, tmp_path: Path) -> None:
    ckpt = fresh_ckpt("single")
    code, modules, out = run_verify(tmp_path, "--json", str(ckpt))
    report = json.loads(out)
    assert code == 0 and report["passed"], out
    assert any(f["check"] == "manifest-absent" for f in report["findings"])  # the path measured: no manifest
    assert "ckptverify.checks.dcp_pipeline" in modules
    assert [m for m in NOT_FOR_PLAIN_JSON if loaded(modules, m)] == []


def test_text_verify_imports_rich_but_not_deep(fresh_ckpt, tmp_path: Path) -> None:
    ckpt = fresh_ckpt("single")
    code, modules, out = run_verify(tmp_path, str(ckpt))
    assert code == 0, out
    assert "rich.console" in modules  # the text report is rich's: the record sees what a command imports
    assert "passed" in out.lower() or "pass" in out.lower()
    assert not loaded(modules, "ckptverify.checks.deep")
    assert not loaded(modules, "torch")


def test_deep_verify_still_imports_and_runs_deep_checks(fresh_ckpt, tmp_path: Path) -> None:
    ckpt = fresh_ckpt("single")
    code, modules, out = run_verify(tmp_path, "--json", "--deep", str(ckpt))
    report = json.loads(out)
    assert code == 0 and report["passed"], out
    assert "ckptverify.checks.deep" in modules
    assert any(c["check"] == "fingerprint" and c["count"] > 0 for c in report["coverage"]), report["coverage"]


def test_safetensors_dcp_imports_its_blob_reader_when_needed(fresh_ckpt, tmp_path: Path) -> None:
    ckpt = fresh_ckpt("safetensors")
    code, modules, out = run_verify(tmp_path, "--json", str(ckpt))
    report = json.loads(out)
    assert code == 0 and report["passed"], out
    assert "ckptverify.dcp.safetensors" in modules


@pytest.mark.parametrize("side_file", ["meta.pt"])
def test_side_file_beside_dcp_is_still_checked(fresh_ckpt, tmp_path: Path, side_file: str) -> None:
    ckpt = fresh_ckpt("single")
    (ckpt / side_file).write_bytes(b"not a torch.save archive")
    code, modules, out = run_verify(tmp_path, "--json", str(ckpt))
    report = json.loads(out)
    assert code == 1, out
    assert any(f["location"].get("file") == side_file and f["severity"] == "error" for f in report["findings"])
    assert "ckptverify.checks.single" in modules


REPO = Path(__file__).resolve().parents[2]


def test_bench_startup_prints_medians_ratios_and_imports(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_startup.py"), "--runs", "1"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.split()[:3] == ["python", "-c", "pass"] for line in lines), done.stdout
    for name in ("verify --json", "verify (text)"):
        row = next(line for line in lines if line.strip().startswith(name))
        assert "x interpreter start" in row and "target <= 0.2 s" in row, row
    top = lines[lines.index(next(line for line in lines if line.startswith("top 10 imports"))) + 2:]
    assert len(top) == 10 and all(line.split()[0].isdigit() for line in top), done.stdout


def test_bench_startup_refuses_a_compared_folder_that_is_no_checkout(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_startup.py"), "--runs", "1",
                           "--compare-with", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "not a checkout of ckptverify" in done.stderr
    assert "Traceback" not in done.stderr
