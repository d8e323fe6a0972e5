"""``bench_parts.py`` runs end to end on a small checkpoint and checks what its figures rest on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("layout", "rebuilt"), [("dcp", 12), ("folder", 27)])
def test_the_parts_benchmark_runs_and_finds_each_node_reading_only_its_files(tmp_path: Path, layout: str,
                                                                              rebuilt: int) -> None:
    out = subprocess.run([sys.executable, "scripts/bench_parts.py", "--nodes", "3", "--mib", "6", "--repeats", "1",
                          "--layout", layout, "--dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    many = "s" if layout == "folder" else ""
    assert lines[-1] == f"manifest{many} from the parts == written whole: True", out.stdout
    assert sum("each node opened only its own files: True" in line for line in lines) == 3, out.stdout
    for what in ("fingerprint", "verify --deep"):
        assert any(line.strip().startswith(f"{what} in parts: other nodes") and "x whole" in line for line in lines)
    assert f"tensors rebuilt by the deep check, whole and in parts: [{rebuilt}] and [{rebuilt}]: same" in lines, \
        out.stdout
    assert not list(tmp_path.iterdir())  # the checkpoint it built is removed
