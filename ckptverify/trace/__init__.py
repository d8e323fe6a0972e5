"""Per-step traces: record fingerprints of every training step, and find where two runs first diverge.

:class:`TraceRecorder` writes one row per step to a rank-local store ``<run_dir>/rank<r>``; :class:`TraceWriter` /
:func:`open_trace` write and read one store; :func:`compare_traces`, :func:`compare_runs` and
:func:`first_divergence` compare. Layout, levels, site names and semantics: ``docs/trace.md``."""

from __future__ import annotations

from ckptverify.trace.compare import (
    FirstDivergence,
    RankComparison,
    compare_runs,
    compare_traces,
    first_divergence,
    rank_comparisons,
    recompute_findings,
)
from ckptverify.trace.recorder import TraceRecorder
from ckptverify.trace.store import LEVELS, Cell, Trace, TraceHeader, TraceRow, TraceWriter, open_trace, rank_store_path

__all__ = ["LEVELS", "Cell", "FirstDivergence", "RankComparison", "Trace", "TraceHeader", "TraceRecorder", "TraceRow",
           "TraceWriter", "compare_runs", "compare_traces", "first_divergence", "open_trace",
           "rank_comparisons", "rank_store_path", "recompute_findings"]
