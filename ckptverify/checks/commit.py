"""The ``save-uncommitted`` check: did the save that wrote this directory commit?

A ckptverify save writes :data:`~ckptverify.ownfiles.names.SAVE_MARKER` before rewriting any shard and removes it only
after its manifest is in place. A directory still holding it may mix two saves even where every item is well
formed, so it is never a complete checkpoint.
"""

from __future__ import annotations

from ckptverify.dcp.commit import describe_marker, read_marker
from ckptverify.findings import Finding, Location, error
from ckptverify.ownfiles.names import SAVE_MARKER

__all__ = ["check_commit"]


def check_commit(root: str) -> list[Finding]:
    """An error when ``root`` holds the in-progress marker of a ckptverify save, else nothing."""
    marker = read_marker(root)
    if marker is None:
        return []
    return [error(
        "save-uncommitted",
        f"a ckptverify save into this directory began ({describe_marker(marker)}) and has not committed: it is "
        "still running or was killed, and the files may mix two saves; save again, or restore another copy",
        location=Location(file=SAVE_MARKER),
    )]
