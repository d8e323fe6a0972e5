"""The listing of a checkpoint's files is bounded, and says what it did not see.

- object keys under an ``s3://`` checkpoint with a ``.``, ``..`` or empty segment (``./a``, ``../../evil.txt``,
  ``/e``) are never walked into as folders (their names normalise to the prefix itself or outside it): each is
  one ``key-unaddressable`` error, and ``verify`` ends;
- a walk cut short by its bounds (entries, depth) or a folder it could not list is a ``walk-incomplete`` error:
  what lay beyond is unchecked, so the checkpoint does not pass;
- on a local disk the same walker never follows a link (a link to a parent folder is one unreferenced entry)
  and stops at its depth bound in a very deep tree.

The S3 tests run against moto's server (skipped without s3fs, moto or boto3); keys are planted with boto3's
raw ``put_object``, which sends them as they are.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptverify.audit.verify import verify_checkpoint
from ckptverify.safeparse import paths

BUCKET = "walkbounds"


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'ckptverify[s3]'): S3 tests skipped")
    pytest.importorskip("moto.server", reason="moto's S3 server is not installed (the `test` extra): S3 tests skipped")
    pytest.importorskip("boto3", reason="boto3 is not installed (the `test` extra): S3 tests skipped")
    from helpers.remote_s3 import serve_bucket

    yield from serve_bucket(BUCKET)


def _state() -> dict[str, Any]:
    return {"w": torch.arange(64.0).reshape(8, 8), "step": 2}


def _s3_checkpoint(prefix: str, *keys: str) -> str:
    """A small DCP checkpoint at ``s3://BUCKET/prefix`` with each of ``keys`` (relative, as stored) planted."""
    import boto3
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    url = f"s3://{BUCKET}/{prefix}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": intended here
        dcp.save(_state(), storage_writer=FsspecWriter(url))
    client = boto3.client("s3")
    for key in keys:
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=b"planted")
    return url


def _by_check(report: Any, check: str) -> list[str | None]:
    return sorted(f.location.file for f in report.findings if f.check == check)


# ---- unaddressable keys in an object store ------------------------------------------------------------------


def test_dot_segment_key_is_one_finding_and_the_walk_ends(s3: Any) -> None:
    url = _s3_checkpoint("dot/step_2", "./a", "stray")
    report = verify_checkpoint(url)
    assert not report.passed
    assert _by_check(report, "key-unaddressable") == ["./a"]
    assert _by_check(report, "file-unreferenced") == ["stray"]  # once, not once per loop through "."
    assert max(Counter((f.check, f.location.file) for f in report.findings).values()) == 1


def test_dotdot_key_normalising_outside_the_prefix_is_reported(s3: Any) -> None:
    url = _s3_checkpoint("dotdot/step_2", "../../evil.txt")
    report = verify_checkpoint(url)
    assert not report.passed
    [finding] = [f for f in report.findings if f.check == "key-unaddressable"]
    assert finding.location.file == "../../evil.txt" and "outside the checkpoint" in finding.message
    assert _by_check(report, "file-unreferenced") == []


def test_empty_segment_key_is_reported(s3: Any) -> None:
    url = _s3_checkpoint("empty/step_2", "/e")
    report = verify_checkpoint(url)
    assert not report.passed
    assert _by_check(report, "key-unaddressable") == ["/e"]


def test_dot_object_key_is_reported_not_opened(s3: Any) -> None:
    url = _s3_checkpoint("dotobj/step_2", "..")
    report = verify_checkpoint(url)
    assert not report.passed
    assert _by_check(report, "key-unaddressable") == [".."]


def test_unaddressable_keys_in_a_subfolder_are_named_from_the_checkpoint(s3: Any) -> None:
    url = _s3_checkpoint("subdot/step_2", "sub/./x", "sub/../y")
    report = verify_checkpoint(url)
    assert _by_check(report, "key-unaddressable") == ["sub/../y", "sub/./x"]


def test_remote_walk_cut_at_its_entry_bound_fails(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url = _s3_checkpoint("many/step_2", *(f"extra/f{i}" for i in range(6)))
    monkeypatch.setattr(paths, "MAX_WALK_ENTRIES", 5)
    report = verify_checkpoint(url)
    assert not report.passed
    [finding] = [f for f in report.findings if f.check == "walk-incomplete"]
    assert "5 entries" in finding.message


# ---- the same walker on a local disk ------------------------------------------------------------------------


def _local_checkpoint(tmp_path: Path) -> Path:
    root = tmp_path / "step_2"
    dcp.save(_state(), checkpoint_id=str(root))
    return root


def test_local_link_to_a_parent_folder_is_one_entry_not_a_loop(tmp_path: Path) -> None:
    root = _local_checkpoint(tmp_path)
    (root / "sub").mkdir()
    os.symlink("..", root / "sub" / "loop")
    report = verify_checkpoint(root)
    findings = [f for f in report.findings if f.check == "file-unreferenced"]
    assert [f.location.file for f in findings] == ["sub/loop"] and "link" in findings[0].message


def test_local_very_deep_tree_stops_at_the_depth_bound(tmp_path: Path) -> None:
    root = _local_checkpoint(tmp_path)
    levels = [root / "d"]
    for _ in range(1099):  # deeper than Python's recursion limit
        levels.append(levels[-1] / "d")
    try:
        for level in levels:
            level.mkdir()
        (levels[-1] / "planted").write_bytes(b"x")
        report = verify_checkpoint(root)
        assert not report.passed
        [finding] = [f for f in report.findings if f.check == "walk-incomplete"]
        assert f"at most {paths.MAX_WALK_DEPTH} levels" in finding.message
    finally:  # bottom up: pytest's own clean-up (shutil.rmtree) recurses once per level
        (levels[-1] / "planted").unlink(missing_ok=True)
        for level in reversed(levels):
            if level.exists():
                level.rmdir()


def test_local_walk_cut_at_its_entry_bound_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _local_checkpoint(tmp_path)
    for i in range(6):
        (root / f"extra{i}").write_bytes(b"x")
    monkeypatch.setattr(paths, "MAX_WALK_ENTRIES", 5)
    report = verify_checkpoint(root)
    assert not report.passed and len(_by_check(report, "walk-incomplete")) == 1
