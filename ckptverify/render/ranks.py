"""How a command run across ranks (``--readers``, torchrun, srun) shows who read what, after its report.

A front end (like :mod:`ckptverify.render.report`): the lines come from the report's ``stats`` (``ranks``,
``balance``, ``ranks_note``: docs/json-schema.md); host names are shown through
:func:`~ckptverify.render.report.printable`, never parsed as markup.
"""

from __future__ import annotations

from typing import Any

from ckptverify.findings import Report
from ckptverify.render.report import human_bytes, printable

__all__ = ["render_ranks"]

#: Up to this many ranks each get a line; past it, the three that read most and a summary.
_LISTED = 8


def render_ranks(report: Report, console: Any) -> None:
    """One line per rank (a summary past a few ranks) with the bytes it read, and the balance."""
    from rich.text import Text

    def say(text: str) -> None:
        console.print(Text(printable(text), style="dim"))

    stats = report.stats
    ranks = stats.get("ranks") or []
    total = int(stats.get("bytes") or 0)
    say(f"read by {len(ranks)} ranks ({stats.get('launcher')}):")
    for r in ranks if len(ranks) <= _LISTED else sorted(ranks, key=lambda r: -r["bytes_read"])[:3]:
        share = f" ({r['bytes_read'] / total:.1%})" if total else ""
        say(f"  rank {r['rank']} on {r['host']}: read {human_bytes(r['bytes_read'])}{share} in {r['units']} unit(s)")
    if len(ranks) > _LISTED:
        sizes = sorted(r["bytes_read"] for r in ranks)
        say(f"  ... and {len(ranks) - 3} more ranks: least {human_bytes(sizes[0])}, median "
            f"{human_bytes(sizes[len(sizes) // 2])}")
    bal = stats.get("balance") or {}
    if bal:
        say(f"  largest share {bal['largest_fraction']:.1%} of the bytes (limit {bal['limit_fraction']:.1%}): "
            + ("balanced" if bal["met"] else f"not balanced: {bal['why_not']}"))
    if stats.get("ranks_note"):
        say(f"  {stats['ranks_note']}")
