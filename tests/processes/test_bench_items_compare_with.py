"""``bench_items.py --compare-with`` times the other checkout's code, wherever the benchmark is started from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compare_with_runs_the_other_checkout_even_from_this_checkouts_root(tmp_path: Path) -> None:
    # A stand-in checkout whose ``python -m ckptverify`` only records that it ran (and succeeds).
    other = tmp_path / "other"
    (other / "ckptverify").mkdir(parents=True)
    marker = tmp_path / "ran.txt"
    (other / "ckptverify" / "__init__.py").write_text("")
    (other / "ckptverify" / "__main__.py").write_text(
        "import sys\n"
        f"with open({str(marker)!r}, 'a') as f:\n"
        "    f.write(sys.argv[1] + '\\n')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "scripts/bench_items.py", "--items", "12", "--repeats", "2", "--no-load",
                          "--layout", "one", "--cache", str(tmp_path / "cache"), "--compare-with", str(other)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    # verify, fingerprint and verify with the manifest of the other checkout, twice each: and only those.
    assert sorted(marker.read_text().split()) == sorted(["verify", "fingerprint", "verify"] * 2)
    got = json.loads(out.stdout.strip().splitlines()[-1])["results"]["one"]
    assert {"ckptverify fingerprint", "ckptverify fingerprint (compared)"} <= set(got)
    # This checkout's fingerprint ran for real: its manifest is in the adopted copy.
    assert (tmp_path / "cache" / "one-12-adopted" / "ckptverify.manifest.json").is_file()
