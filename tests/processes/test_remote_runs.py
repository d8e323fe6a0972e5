"""Run directories in S3: ``scan``, ``latest`` (with stamps) and ``load(pick="latest-verified")`` over an
``s3://`` run directory on moto's S3 server, judged as the same run directory on a local disk is judged.

Skipped, with the reason, when s3fs or moto is not installed (the ``test`` extra installs both).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'ckptverify[s3]'): S3 tests skipped")
pytest.importorskip("moto.server", reason="moto's S3 server is not installed (the `test` extra): S3 tests skipped")

import torch
from helpers.remote_s3 import serve_bucket

import ckptverify as cv
from ckptverify.runs.latest import latest_verified
from ckptverify.runs.scan import scan_run_dir
from ckptverify.runs.stamp import read_stamp, stamp_path, write_stamp

BUCKET = "runs"


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    yield from serve_bucket(BUCKET)


def _train_state(seed: int) -> cv.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100)
    for _ in range(3):
        loss = model(torch.randn(16, 8)).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    return cv.TrainState(model=model, optimizer=opt, scheduler=sched)


@dataclasses.dataclass
class Run:
    url: str
    local: Path
    weights: dict[int, dict[str, torch.Tensor]]


def _run(fs: Any, tmp_path: Path, steps: tuple[int, ...] = (10, 20, 30)) -> Run:
    """Checkpoints saved by ``ckptverify.save`` (manifest included) under a local run directory, then copied
    object by object to ``s3://BUCKET/run-*/``: the same bytes in both places."""
    local = tmp_path / "run"
    weights = {}
    for step in steps:
        state = _train_state(step)
        state.counters.step = step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cv.save(state, local / f"step_{step}")
        weights[step] = {k: v.clone() for k, v in state.model.state_dict().items()}
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    fs.put(str(local) + "/", url.removeprefix("s3://") + "/", recursive=True)
    return Run(url, local, weights)


def _shard(fs: Any, url: str) -> str:
    return next(p for p in fs.find(url.removeprefix("s3://")) if p.endswith(".distcp"))


def _flip(fs: Any, key: str) -> None:
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0x04
    fs.pipe_file(key, bytes(data))


def _rows(report: Any) -> dict[str, tuple[str, str]]:
    return {r["path"]: (r["state"], r["format"]) for r in report.stats["checkpoints"]}


def test_scan_s3_run_directory_same_as_local(s3: Any, tmp_path: Path) -> None:
    run = _run(s3, tmp_path)
    clean = scan_run_dir(run.url)
    assert clean.passed, [f.message for f in clean.findings]
    assert _rows(clean) == {f"step_{s}": ("verified", "dcp") for s in (10, 20, 30)}
    _flip(s3, _shard(s3, f"{run.url}/step_30"))
    _flip(s3, _shard(s3, f"{run.url}/step_20").replace("s3://", ""))
    s3.rm_file(f"{run.url}/step_10/.metadata".removeprefix("s3://"))
    remote = scan_run_dir(run.url)
    s3.get(run.url.removeprefix("s3://") + "/", str(tmp_path / "copy") + "/", recursive=True)
    local = scan_run_dir(tmp_path / "copy")
    assert _rows(remote) == _rows(local)
    assert _rows(remote)["step_30"][0] == "corrupt" and not remote.passed


def test_latest_on_s3_skips_a_damaged_newest_and_uses_stamps(s3: Any, tmp_path: Path) -> None:
    run = _run(s3, tmp_path)
    step20 = f"{run.url}/step_20"
    report = cv.verify_checkpoint(step20)
    written = write_stamp(step20, report, step=20)
    assert written["passed"] and s3.exists(stamp_path(step20).removeprefix("s3://"))
    assert stamp_path(step20) == f"{step20}/{os.path.basename(stamp_path(str(tmp_path)))}"
    stamp = read_stamp(step20)
    assert stamp is not None and stamp.passed and stamp.current
    _flip(s3, _shard(s3, f"{run.url}/step_30"))
    picked = latest_verified(run.url, trust_stamps=True)
    assert picked.path == step20 and picked.step == 20
    assert [(s["path"], s["state"], s["how"]) for s in picked.skipped] == [("step_30", "corrupt", "verified now")]
    assert any("step_20" in f.message and "stamp" in f.message for f in picked.report.findings)  # type: ignore[union-attr]
    # A stamped checkpoint whose objects change afterwards: the stamp is no longer current (ETag, size).
    _flip(s3, _shard(s3, step20))
    stale = read_stamp(step20)
    assert stale is not None and not stale.current
    after = latest_verified(run.url)
    assert after.path == f"{run.url}/step_10"
    assert ("step_20", "corrupt", "verified now") in [(s["path"], s["state"], s["how"]) for s in after.skipped]


def test_load_latest_verified_from_s3(s3: Any, tmp_path: Path) -> None:
    run = _run(s3, tmp_path)
    _flip(s3, _shard(s3, f"{run.url}/step_30"))
    target = _train_state(0)
    report = cv.load(target, run.url, pick="latest-verified")
    assert report.passed
    assert report.stats["picked"] == f"{run.url}/step_20" and report.stats["step"] == 20
    for k, v in target.model.state_dict().items():
        assert torch.equal(v, run.weights[20][k]), k
    assert target.counters.step == 20


def test_load_from_s3_refuses_a_damaged_checkpoint(s3: Any, tmp_path: Path) -> None:
    run = _run(s3, tmp_path, steps=(10,))
    _flip(s3, _shard(s3, f"{run.url}/step_10"))
    target = _train_state(0)
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    with pytest.raises(cv.errors.CkptVerifyError):
        cv.load(target, f"{run.url}/step_10")
    for k, v in target.model.state_dict().items():
        assert torch.equal(v, before[k])


def test_cli_latest_and_scan_on_s3(s3: Any, tmp_path: Path) -> None:
    run = _run(s3, tmp_path, steps=(10, 20))
    _flip(s3, _shard(s3, f"{run.url}/step_20"))
    env = {**os.environ}
    latest = subprocess.run([sys.executable, "-m", "ckptverify", "latest", run.url, "--path-only"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.strip() == f"{run.url}/step_10"
    scan = subprocess.run([sys.executable, "-m", "ckptverify", "scan", run.url, "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert scan.returncode == 1, scan.stderr
    rows = {r["path"]: r["state"] for r in json.loads(scan.stdout)["stats"]["checkpoints"]}
    assert rows == {"step_10": "verified", "step_20": "corrupt"}
    # `verify` of the run directory itself: refused with a pointer to scan, as for a local one.
    verify = subprocess.run([sys.executable, "-m", "ckptverify", "verify", run.url],
                            capture_output=True, text=True, timeout=300, env=env)
    assert verify.returncode == 2 and "run directory" in verify.stderr and "ckptverify scan" in verify.stderr

