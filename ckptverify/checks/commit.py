"""Did the save that wrote this directory commit? (the ``save-uncommitted`` check)

A ckptverify save marks its directory with :data:`~ckptverify.dcp.commit.MARKER_FILE` before it rewrites
any shard and removes the marker only after its manifest (the commit record) is in place. A directory that
still holds the marker was being written by a save that is running now or died: its shards may mix two
saves even where every item is well formed, so it is never a complete checkpoint, whatever else it holds.
"""

from __future__ import annotations

from ckptverify.dcp.commit import MARKER_FILE, describe_marker, read_marker
from ckptverify.findings import Finding, Location, error

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
        location=Location(file=MARKER_FILE),
    )]
