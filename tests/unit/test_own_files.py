"""ckptverify's own files are replaced whole: the old content or the new, never a part, and no leftovers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptverify.ownfiles.names import STAMP_TEMP_PREFIX, write_atomic


@pytest.mark.parametrize("durable", [True, False])
def test_a_write_replaces_the_file_with_the_umask_s_permissions_and_leaves_nothing_else(
        tmp_path: Path, durable: bool) -> None:
    target = tmp_path / "ckptverify.verified.json"
    target.write_text("old")
    old = os.umask(0o027)
    try:
        assert write_atomic(target, "new", prefix=STAMP_TEMP_PREFIX, durable=durable) == str(target)
    finally:
        os.umask(old)
    assert target.read_text() == "new" and os.listdir(tmp_path) == [target.name]
    assert target.stat().st_mode & 0o777 == 0o640


def test_a_write_that_fails_keeps_the_old_file_and_removes_its_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "ckptverify.manifest.json"
    target.write_bytes(b"old")
    with pytest.raises(TypeError):
        write_atomic(target, 12345, prefix=".ckptverify-manifest-")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == [target.name]
