"""Work units shared among ranks, balanced by bytes. Deterministic (largest first, to the least-loaded rank, ties to
the lowest), so the same work on the same world always lands the same way."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

#: The largest share a rank may read, as a multiple of the even share (total / ranks), when the work allows.
BALANCE_LIMIT = 1.2


def assign(sizes: Sequence[int], loads: list[int]) -> list[int]:
    """Each unit's rank (``sizes``: its bytes), updating ``loads`` in place; LPT order, within 4/3 of the best split."""
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    owner = [0] * len(sizes)
    for n in sorted(range(len(sizes)), key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(heap)
        owner[n] = rank
        loads[rank] = load + sizes[n]
        heapq.heappush(heap, (loads[rank], rank))
    return owner


def balance(per_rank: Sequence[int], total: int, units: int, largest_unit: int, rank0_own: int) -> dict[str, Any]:
    """How even the shares are: the largest as a fraction of ``total``, the limit (:data:`BALANCE_LIMIT` / ranks),
    whether met, and if not why the work did not allow it."""
    world = len(per_rank)
    largest = max(per_rank) if per_rank else 0
    limit = BALANCE_LIMIT / world if world else 1.0
    fraction = largest / total if total else 0.0
    met = fraction <= limit + 1e-12
    why = None
    if not met:
        # The first reason that holds is the one that bounds the split.
        if rank0_own > limit * total:
            why = (f"rank 0 read {rank0_own} bytes itself (metadata, archive headers and items of 1 MiB or less, "
                   f"read whole while planning), more than {BALANCE_LIMIT}/{world} of the {total} bytes")
        elif units < world:
            why = f"{units} work unit(s) for {world} ranks: some ranks had nothing to read"
        elif largest_unit > limit * total:
            why = (f"one work unit alone is {largest_unit} bytes, more than {BALANCE_LIMIT}/{world} of the "
                   f"{total} bytes (a unit is one record piece, file or checkpoint)")
        else:
            why = "the units could not be split more evenly (few units of uneven sizes)"
    return {"largest_share": largest, "largest_fraction": round(fraction, 6), "limit_fraction": round(limit, 6),
            "met": met, "why_not": why}
