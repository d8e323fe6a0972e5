"""The per-item and memory benchmarks run and print what they claim (figures, not timings, are checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=900)


def test_bench_items_prints_verify_and_fingerprint_against_read_metadata(tmp_path: Path) -> None:
    out = _run(str(ROOT / "scripts" / "bench_items.py"), "--items", "40", "--repeats", "1", "--no-load",
               "--cache", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    for layout in ("'one'", "'per'"):
        assert f"layout {layout}: 40 items" in out.stdout
    assert "target verify <= 10 s per 100 000 items" in out.stdout
    assert "target fingerprint <= 15 s per 100 000 items" in out.stdout
    data = json.loads(out.stdout.strip().splitlines()[-1])
    for layout in ("one", "per"):
        got = data["results"][layout]
        assert {"dcp read_metadata", "ckptverify verify", "ckptverify fingerprint", "verify with manifest"} <= set(got)
        assert all(v["wall"] > 0 and v["rss_mib"] > 0 for v in got.values())
    assert len(os.listdir(tmp_path / "per-40")) == 41  # 40 item files and .metadata: built once, kept
    # Run again (profiling, the cheaper mode): the kept checkpoint is used, not built again.
    again = _run(str(ROOT / "scripts" / "bench_items.py"), "--items", "40", "--layout", "per", "--profile",
                 "--cache", str(tmp_path))
    assert again.returncode == 0 and "building" not in again.stdout, again.stdout + again.stderr[-2000:]
    assert (tmp_path / "per-40.verify.prof").stat().st_size > 0 and (tmp_path / "per-40.fingerprint.prof").is_file()


def test_bench_verify_prints_peak_rss_per_checkpoint_size(tmp_path: Path) -> None:
    out = _run(str(ROOT / "scripts" / "bench_verify.py"), "--rss-sizes", "0.0625,0.125", "--repeats", "1",
               "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])["rss_by_size"]
    assert [round(r["gib"], 2) for r in rows] == [0.06, 0.13]
    assert all(r["verify_peak_rss_mib"] > 0 and r["manifest_peak_rss_mib"] > 0 for r in rows)
    assert "peak RSS from 0.06 to 0.13 GiB grows by" in out.stdout
    assert not any(p.name.startswith("ckpt-") for p in tmp_path.iterdir())  # each deleted once measured
