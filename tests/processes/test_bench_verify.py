"""``scripts/bench_verify.py`` prints, in one run, the fixed cost, verify with it taken off, the in-process figures
without and with a manifest, and the per-byte costs (figures, not timings, are checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_verify_prints_fixed_cost_in_process_and_per_byte_figures(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_verify.py"), "--gib", "0.03",
                          "--repeats", "1", "--dir", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    for row in ("verify fixed cost", "with manifest fixed cost", "verify, fixed cost off",
                "with manifest, fixed cost off", "verify (in-process core)", "with manifest (in-process core)",
                "copy from page cache (preadv, 1 MiB)", "crc32 (isal)", "crc32 (zlib)",
                "xxh3-128 (xxhash, streaming)", "copy + crc32 (isal)"):
        assert row in out.stdout, row
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["fixed_cost_s"] > 0 and data["manifest_fixed_cost_s"] > 0
    assert data["verify_core_gbps"] > 0 and data["verify_manifest_core_gbps"] > 0
    assert data["verify_core_over_cat"] > 0 and data["verify_manifest_core_over_cat"] > 0
    assert all(v > 0 for v in data["per_byte_gbps"].values()) and len(data["per_byte_gbps"]) >= 6
    assert data["verify_peak_rss_mib"] > 0 and data["verify_manifest_peak_rss_mib"] > 0
    # The timed commands ran with their bytecode cached in the work directory, despite PYTHONDONTWRITEBYTECODE.
    assert any((tmp_path / "pycache").rglob("*.pyc"))
    # The in-process child asserted that the manifest copy was verified against its manifest.
    assert (tmp_path / "ckpt-manifest" / "ckptverify.manifest.json").is_file()
