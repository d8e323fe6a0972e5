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
    divergences,
    first_divergence,
    module_of,
    rank_comparisons,
    recompute_findings,
    run_stores,
)
from ckptverify.trace.recorder import ROOT_MODULE, TraceRecorder, canonical_name, module_site
from ckptverify.trace.store import (
    CATEGORIES,
    DETAILS,
    ENCODINGS,
    KINDS,
    LEVELS,
    TRACE_SCHEMA,
    TRACE_SCHEMA_VERSION,
    Cell,
    Site,
    Trace,
    TraceHeader,
    TraceRow,
    TraceWriter,
    open_trace,
    rank_store_path,
)

__all__ = ["CATEGORIES", "DETAILS", "ENCODINGS", "KINDS", "LEVELS", "ROOT_MODULE", "TRACE_SCHEMA",
           "TRACE_SCHEMA_VERSION", "Cell", "FirstDivergence", "RankComparison", "Site", "Trace", "TraceHeader",
           "TraceRecorder", "TraceRow", "TraceWriter", "canonical_name", "compare_runs", "compare_traces",
           "divergences", "first_divergence", "module_of", "module_site", "open_trace", "rank_comparisons",
           "rank_store_path", "recompute_findings", "run_stores"]
