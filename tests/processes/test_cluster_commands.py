"""``fingerprint`` and ``scan`` across ranks: the manifest written and the report given are those of one
process, and the ranks share the reads. Real processes and a real rendezvous store on this machine: the commands
run in this process (``invoke``), which under ``--readers 2`` is rank 0 and starts rank 1 as a real process; what
these tests compare is reports and manifests, not a process's start-up or exit (the launches themselves are
``test_cluster_verify``'s)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_cluster_verify import ROOT, build, invoke, run


def _json(proc: Any) -> dict[str, Any]:
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _manifest(path: Path) -> dict[str, Any]:
    data = json.loads((path / "ckptverify.manifest.json").read_text())
    for volatile in ("created", "self_digest"):  # the time it was written, and the digest over it
        data.pop(volatile)
    return data


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("cluster-cmd") / "src")


def test_fingerprint_readers_writes_the_single_process_manifest(source: Path, tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(source, one)
    shutil.copytree(source, two)
    a = invoke("fingerprint", str(one), "--json")
    b = invoke("fingerprint", str(two), "--readers", "2", "--json")
    assert a.returncode == 0 and b.returncode == 0, b.stderr[-2000:]
    assert _manifest(one) == _manifest(two)
    ra, rb = _json(a), _json(b)
    assert [(f["check"], f["severity"], f["message"].replace(str(one), "X")) for f in ra["findings"]] == \
        [(f["check"], f["severity"], f["message"].replace(str(two), "X")) for f in rb["findings"]]
    ranks = rb["stats"]["ranks"]
    assert len(ranks) == 2 and all(r["bytes_read"] > 0 for r in ranks)
    # Every byte is read for its CRC, then for the item digests, the file digests and the tensors'
    # fingerprints, each pass shared.
    assert sum(r["bytes_read"] for r in ranks) >= 3.9 * rb["stats"]["bytes"]
    assert max(r["bytes_read"] for r in ranks) <= 0.6 * sum(r["bytes_read"] for r in ranks)
    assert rb["stats"]["balance"]["met"]
    # The manifest written by the ranks is one verify accepts, byte for byte.
    check = invoke("verify", str(two), "--readers", "2", "--json")
    assert check.returncode == 0 and _json(check)["stats"]["manifest"] is True


def test_fingerprint_refused_alike(source: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    shard = bad / "__0_1.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    a = invoke("fingerprint", str(bad), "--json")
    b = invoke("fingerprint", str(bad), "--readers", "2", "--json")
    assert a.returncode == b.returncode == 1
    assert [f["check"] for f in _json(a)["findings"]] == [f["check"] for f in _json(b)["findings"]]
    assert "fingerprint-refused" in [f["check"] for f in _json(b)["findings"]]
    assert not (bad / "ckptverify.manifest.json").exists()


def test_scan_readers_same_report(source: Path, tmp_path: Path) -> None:
    runs = tmp_path / "run"
    for step in (100, 200, 300, 400):
        shutil.copytree(source, runs / f"step_{step}")
    shard = runs / "step_300" / "__0_2.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    a = invoke("scan", str(runs), "--json")
    b = invoke("scan", str(runs), "--readers", "2", "--json")
    assert a.returncode == b.returncode == 1
    ra, rb = _json(a), _json(b)
    assert ra["findings"] == rb["findings"]
    strip = ("seconds",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in ra["stats"]["checkpoints"]] == \
        [{k: v for k, v in r.items() if k not in strip} for r in rb["stats"]["checkpoints"]]
    assert rb["stats"]["newest_good"] == ra["stats"]["newest_good"] == {"path": "step_400", "step": 400}
    ranks = rb["stats"]["ranks"]
    assert [r["units"] for r in ranks] == [2, 2]  # four checkpoints of one size: two each
    assert sum(r["bytes_read"] for r in ranks) == sum(c["size"] for c in rb["stats"]["checkpoints"])
    assert rb["stats"]["balance"]["met"]
    text = invoke("scan", str(runs), "--readers", "2")
    assert text.returncode == 1 and "read by 2 ranks (local)" in text.stdout and "corrupt" in text.stdout


def test_bench_verify_readers_prints_throughput_per_rank_count(tmp_path: Path) -> None:
    # The script as a user runs it: its own command line, and the verify commands it starts and times.
    proc = run(str(ROOT / "scripts" / "bench_verify.py"), "--readers", "2", "--gib", "0.02", "--repeats", "1",
               "--dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["ranks"] for r in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert len(row["bytes_per_rank"]) == row["ranks"] and sum(row["bytes_per_rank"]) == row["checkpoint_bytes"]
        assert row["verify_gbps"] > 0 and row["wall_gbps"] > 0
    assert "bytes per rank sum to the checkpoint's" in proc.stdout and ": True;" in proc.stdout
