"""The object-store extra is optional: without it a local path works as before and imports none of it, and a
URL is exit 2 saying what to install. Runs without s3fs or moto installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp


def _cli(args: list[str], prelude: str) -> subprocess.CompletedProcess[str]:
    code = f"{prelude}\nimport sys\nfrom ckptverify.cli import main\nsys.argv = ['ckptverify', *{args!r}]\nmain()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_url_without_the_extra_is_exit_2_with_what_to_install() -> None:
    # fsspec made unimportable, as on a machine without the extra.
    for command in (["verify", "s3://bucket/ckpt"], ["scan", "s3://bucket/run"], ["latest", "s3://bucket/run"]):
        run = _cli(command, prelude="import sys; sys.modules['fsspec'] = None")
        assert run.returncode == 2, (command, run.stdout, run.stderr)
        assert "pip install 'ckptverify[s3]'" in run.stderr
        assert "Traceback" not in run.stderr


def test_local_verify_imports_no_fsspec(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "c"))
    code = ("import sys\nfrom ckptverify.audit.verify import verify_checkpoint\n"
            f"assert verify_checkpoint({str(tmp_path / 'c')!r}).passed\n"
            "assert 'fsspec' not in sys.modules and 'ckptverify.safeparse.remote' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_urls_are_told_from_paths() -> None:
    from ckptverify.safeparse.paths import is_url, normpath

    assert is_url("s3://bucket/x") and is_url("gs://b") and is_url("memory://a/b")
    assert not is_url("/data/s3://x") and not is_url("relative/dir") and not is_url("C:\\ckpt")
    assert normpath("s3://bucket/run/./step_3/") == "s3://bucket/run/step_3"
    assert normpath("run/./step_3/") == "run/step_3"


def test_what_writes_or_renames_in_a_run_directory_refuses_a_url_and_creates_nothing_locally(
        tmp_path: Path, monkeypatch: Any) -> None:
    import pytest

    import ckptverify as cv
    from ckptverify.errors import UsageError
    from ckptverify.production.mode import ProductionOptions
    from ckptverify.runs.latest import move_aside

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="local or mounted"):
        move_aside("s3://bucket/run", "step_10")
    with pytest.raises(UsageError, match="local or mounted"):
        ProductionOptions(run_dir="s3://bucket/run", steps=2)
    with pytest.raises((UsageError, SystemExit)):
        cv.Run.main(lambda run: None, steps=2, run_dir="s3://bucket/run")
    assert list(tmp_path.iterdir()) == []  # no local folder named "s3:"
