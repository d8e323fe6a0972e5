"""Compare two traces step by step and find where they first diverge (see ``docs/trace.md``).

Cells are aligned by identity: the step number and the site name (which carries the occurrence, ``#k``).
For each rank the first divergent step is the first common step with any differing cell (a different value,
or a value recorded in one trace only), and the first divergent site is the first differing site of that step
in execution order. A trace recorded with ``detail="category"`` holds one cell per tensor category; compared
with a trace of detail ``tensor``, the per-tensor cells only the latter holds are left out, and a differing
category cell is traced back to the one tensor that explains it when there is one
(:mod:`ckptverify.trace.category`). At level ``module`` the differing module sites of that step are
classified: the first one, when the step's batch and the parameters it started from are equal, is the
*origin* (its recorded inputs are equal, its output differs); the later ones are *receivers*.

Across ranks (:func:`first_divergence`), at the job's first divergent step, a rank is an *origin* when a value it
starts from or computes on its own differs there (:data:`OWN_KINDS`: its random streams, hyperparameters, batch,
loss, module activations, non-persistent buffers, what it hands to a collective); a rank whose differing values
all lie downstream of a collective (gradients after their all-reduce or reduce-scatter, parameters, optimizer
state, metrics other than the loss) is a *receiver* when some other rank is an origin. Under DDP or FSDP a cause
on one rank reaches every rank at the next gradient reduction, so the lowest differing rank is not the answer.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ckptverify.errors import TraceHeaderMismatchError, UsageError
from ckptverify.findings import Finding, Location, error, info, warning
from ckptverify.trace.store import (
    CkptVerifyError,
    Trace,
    open_trace,
    step_ranges,
)

__all__ = [
    "FirstDivergence",
    "RankComparison",
    "TraceHeaderMismatchError",
    "compare_runs",
    "compare_traces",
    "divergences",
    "first_divergence",
    "job_divergence",
    "module_of",
    "rank_comparisons",
    "recompute_findings",
    "run_stores",
]

TraceLike = Trace | str | os.PathLike[str]

_MODULE_KINDS = frozenset({"module_in", "module_out", "module_grad_in"})
#: Site kinds a rank starts a step from or computes on its own, upstream of any cross-rank collective of the
#: step: a difference in one of them is born on that rank (or came with its own inputs). Gradients (read after
#: their reduction), parameters, optimizer state and the outputs of collectives are not among them: under DDP
#: or FSDP they carry every rank's values.
OWN_KINDS = frozenset({"rng", "hparam", "batch", "data", "buffer", "scheduler", "counter", "extra", "comm_in",
                       "module_in", "module_out", "module_grad_in", "module_recompute"})
#: Metric sites that hold this rank's own value: the loss ``run.record(loss=...)`` records is the rank's own
#: (a metric such as a gradient norm is computed after the reduction).
OWN_METRICS = frozenset({"metric.loss"})
#: Levels that record module sites.
_MODULE_LEVELS = ("module", "op")
#: Rows compared at once, and the most bytes one block of a trace may take (a wide trace compares fewer rows
#: at once).
_BLOCK = 256
_BLOCK_BYTES = 64 << 20
#: Receivers named in a message (all are in the finding's ``actual``).
_SHOWN = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstDivergence:
    """Where one rank's traces first differ.

    ``expected`` is trace A's value, ``actual`` trace B's (``None`` where the site was not recorded). At
    level ``module``: ``origin`` is the module named as origin (``None`` when there is none: the first
    difference is not a module site, or the step's inputs differ), ``origin_site`` its site,
    ``receivers`` the module sites that differ after it, and ``inputs_verified`` whether the step's batch
    and the parameters it started from were recorded in both traces and found equal (when ``False`` the
    origin assumes equal parameters, e.g. on the first step after a restore, which the restore check covers).
    When the first differing module site is a child's *input* (``module.<child>.in#k``) while the input of
    its parent was equal, the work that changed it was done in the parent's own ``forward``: ``origin`` is
    the parent and ``origin_fed`` the child it fed.

    When the first differing cell is a category cell (``grad.*``, ``param.*``, ...), ``site`` names the one
    tensor of the category that explains the difference if a trace holds the tensors' names (detail
    ``tensor``) and only one differs; ``via`` is then the category cell (``expected``/``actual`` are its
    values). ``tensors`` says what is known of the category's differing tensors: ``"one"`` (named),
    ``"several"``, or ``"unnamed"`` (neither trace holds per-tensor cells).
    """

    step: int
    rank: int
    site: str
    category: str
    kind: str
    expected: float | int | str | None = None
    actual: float | int | str | None = None
    origin: str | None = None
    origin_site: str | None = None
    origin_type: str | None = None
    origin_fed: str | None = None
    receivers: tuple[str, ...] = ()
    inputs_verified: bool | None = None
    differing_sites: int = 1
    via: str | None = None
    tensors: str | None = None
    #: The first site of this step among those this rank starts from or computes on its own
    #: (:data:`OWN_KINDS`, :data:`OWN_METRICS`) that differs; ``None`` when every differing site lies downstream
    #: of a collective (the rank may only have received the difference).
    own_site: str | None = None
    #: Set by :func:`first_divergence` for the job (``None`` on one rank's own divergence): the ranks where the
    #: difference is born at this step (empty when the traces cannot tell: several ranks differ, each only
    #: downstream of a collective), and the ranks that differ only because a collective carried an origin's
    #: values.
    origin_ranks: tuple[int, ...] | None = None
    receiver_ranks: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        out["receivers"] = list(self.receivers)
        for name in ("origin_ranks", "receiver_ranks"):
            value = getattr(self, name)
            out[name] = None if value is None else list(value)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RankComparison:
    """The comparison of one rank's two traces."""

    rank: int
    path_a: str
    path_b: str
    run_a: str
    run_b: str
    level: str
    first: FirstDivergence | None
    compared_steps: int
    compared_sites: int
    only_a: tuple[int, ...] = ()
    only_b: tuple[int, ...] = ()
    sites_only_a: tuple[str, ...] = ()
    sites_only_b: tuple[str, ...] = ()
    header_differences: tuple[str, ...] = ()
    #: Sites left out of the comparison because their name matches one of ``ignore_sites``.
    ignored_sites: tuple[str, ...] = ()
    missing: str | None = field(default=None)  # "a" or "b" when that run has no store for this rank


# ------------------------------------------------------------------------------------------ inputs


def _as_trace(x: TraceLike) -> Trace:
    return x if isinstance(x, Trace) else open_trace(x)


def _is_store(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / "zarr.json").is_file()


def run_stores(run_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """``{rank: store path}`` of a run's trace directory (its ``rank<r>/`` stores)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise CkptVerifyError(f"no trace directory at {root}")
    out: dict[int, Path] = {}
    for child in root.iterdir():
        name = child.name
        if name.startswith("rank") and name[4:].isdigit() and _is_store(child):
            out[int(name[4:])] = child
    return dict(sorted(out.items()))


def _step_mask(steps: np.ndarray, wanted: Iterable[int] | None) -> np.ndarray:
    if wanted is None:
        return np.ones(steps.shape, dtype=bool)
    if isinstance(wanted, range):
        return np.fromiter((int(s) in wanted for s in steps), dtype=bool, count=steps.shape[0])
    chosen = np.asarray(sorted({int(s) for s in wanted}), dtype=np.int64)
    return np.isin(steps, chosen)


def _merged_order(a: Sequence[str], b: Sequence[str]) -> list[str]:
    """A's execution order, with B's extra sites placed right after the site B records before them."""
    in_a = set(a)
    after: dict[str | None, list[str]] = {}
    prev: str | None = None
    for name in b:
        if name in in_a:
            prev = name
        else:
            after.setdefault(prev, []).append(name)
    out = list(after.get(None, []))
    for name in a:
        out.append(name)
        out.extend(after.get(name, []))
    return out


# ------------------------------------------------------------------------------------------ compare


class _Aligned:
    """Two traces' columns lined up over a common list of site names."""

    def __init__(self, ta: Trace, tb: Trace, names: list[str]) -> None:
        self.ta, self.tb, self.names = ta, tb, names
        self.kinds = [(ta.site(n) if ta.has_site(n) else tb.site(n)).kind for n in names]
        pad_a, pad_b = len(ta._by_column), len(tb._by_column)
        self.col_a = np.asarray([c if (c := ta.column(n)) is not None else pad_a for n in names], dtype=np.int64)
        self.col_b = np.asarray([c if (c := tb.column(n)) is not None else pad_b for n in names], dtype=np.int64)

    @staticmethod
    def _take(trace: Trace, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Each run of consecutive rows is read on its own: the rows of common steps may lie far apart, and
        # reading everything between them would cost the gap.
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        parts = [trace.rows(int(run[0]), int(run[-1]) + 1) for run in np.split(rows, cuts)]
        values = np.concatenate([v for v, _ in parts], axis=0)
        present = np.concatenate([p for _, p in parts], axis=0)
        values = np.concatenate([values, np.zeros((values.shape[0], 1, 2), np.uint64)], axis=1)
        present = np.concatenate([present, np.zeros((present.shape[0], 1), bool)], axis=1)
        return values[:, cols], present[:, cols]

    def diff(self, rows_a: np.ndarray, rows_b: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """``[rows, sites]`` bool: cell differs (value, or present in one trace only); plus the raw blocks."""
        va, pa = self._take(self.ta, rows_a, self.col_a)
        vb, pb = self._take(self.tb, rows_b, self.col_b)
        differs = (pa != pb) | (pa & pb & (va != vb).any(axis=-1))
        return differs, (va, pa, vb, pb)

    def value(self, trace: Trace, step: int, name: str) -> float | int | str | None:
        return trace.value(step, name) if trace.has_site(name) else None


#: Header fields that never stop a comparison: the run's name, and how finely tensor categories were recorded.
_ALWAYS_IGNORED = ("run", "detail")


_ENCODING_WORDS = {
    "host": "digest_encoding 'host', xxh3 of the bytes of tensors in host memory",
    "device": "digest_encoding 'device', logical fingerprints computed on an accelerator",
    "host-as-device": "digest_encoding 'host-as-device', host tensors sent down the accelerator path "
                      "(CKPTVERIFY_TRACE_HOST_AS_DEVICE=1)",
}


def _check_headers(ta: Trace, tb: Trace, diffs: list[str], force: bool) -> None:
    """Refuse traces whose headers differ (unless ``force``), and always those whose digests read differently:
    every tensor site would differ from the first step on, which says nothing about the runs."""
    if "digest_encoding" in diffs:
        ea, eb = ta.header.digest_encoding, tb.header.digest_encoding
        raise UsageError(f"the traces digest tensors differently ({ta.path}: {_ENCODING_WORDS.get(ea, ea)}; "
                         f"{tb.path}: {_ENCODING_WORDS.get(eb, eb)}), so every tensor site would differ and no "
                         "step can be compared; record both on the same kind of device")
    if diffs and not force:
        raise TraceHeaderMismatchError(diffs, ta, tb)


def _compare_pair(ta: Trace, tb: Trace, *, steps: Iterable[int] | None, force: bool,
                  ignore: Iterable[str], ignore_sites: tuple[str, ...] = ()) -> RankComparison:
    diffs = ta.header.differences(tb.header, ignore=(*_ALWAYS_IGNORED, *ignore))
    _check_headers(ta, tb, diffs, force)
    if diffs and not force:
        raise TraceHeaderMismatchError(diffs, ta, tb)
    rank = ta.header.rank if ta.header.rank is not None else 0
    sa, sb = ta.step_array, tb.step_array
    fa, fb = sa[_step_mask(sa, steps)], sb[_step_mask(sb, steps)]
    common = np.intersect1d(fa, fb)
    only_a = tuple(int(s) for s in np.setdiff1d(fa, fb))
    only_b = tuple(int(s) for s in np.setdiff1d(fb, fa))

    names_a = [s.name for s in ta.sites]
    names_b = [s.name for s in tb.sites]
    ignored: tuple[str, ...] = ()
    if ignore_sites:
        # Left out on both sides before anything is aligned: an ignored site can be neither a difference nor a
        # site recorded by one trace only.
        ignored = tuple(dict.fromkeys(n for n in (*names_a, *names_b)
                                      if any(fnmatch.fnmatchcase(n, p) for p in ignore_sites)))
        names_a = [n for n in names_a if n not in ignored]
        names_b = [n for n in names_b if n not in ignored]
    sites_only_a: tuple[str, ...] = ()
    sites_only_b: tuple[str, ...] = ()
    if force:
        # Traces that describe different things: compare what both record, and say what was left out.
        names = [n for n in names_a if tb.has_site(n)]
        sites_only_a = tuple(n for n in names_a if not tb.has_site(n))
        sites_only_b = tuple(n for n in names_b if not ta.has_site(n))
    else:
        names = _merged_order(names_a, names_b)
    # A tensor's own cell, recorded by a trace of detail "tensor" only, is not a difference: its category
    # cell, which both record, stands for it.
    names = [n for n in names if (ta.has_site(n) and tb.has_site(n)) or not _member_of_finer(n, ta, tb)]
    aligned = _Aligned(ta, tb, names)
    rows_a = np.searchsorted(sa, common)
    rows_b = np.searchsorted(sb, common)

    first: FirstDivergence | None = None
    if names:
        widest = max(len(ta._by_column), len(tb._by_column), len(names), 1)
        block = max(1, min(_BLOCK, _BLOCK_BYTES // (17 * widest)))
        for i0 in range(0, common.shape[0], block):
            ra, rb = rows_a[i0 : i0 + block], rows_b[i0 : i0 + block]
            differs, _ = aligned.diff(ra, rb)
            bad_rows = np.flatnonzero(differs.any(axis=1))
            if bad_rows.size:
                i = int(bad_rows[0])
                first = _describe(aligned, rank, int(common[i0 + i]), differs[i])
                break
    level = ta.header.level
    return RankComparison(rank=rank, path_a=str(ta.path), path_b=str(tb.path), run_a=ta.header.run,
                          run_b=tb.header.run, level=level, first=first, compared_steps=int(common.shape[0]),
                          compared_sites=len(names), only_a=only_a, only_b=only_b, sites_only_a=sites_only_a,
                          sites_only_b=sites_only_b, header_differences=tuple(diffs), ignored_sites=ignored)


def _member_of_finer(name: str, ta: Trace, tb: Trace) -> bool:
    """Whether ``name`` is a tensor's own cell that only the trace of detail ``tensor`` records."""
    for mine, other in ((ta, tb), (tb, ta)):
        if mine.has_site(name) and mine.site(name).group and other.header.detail == "category":
            return True
    return False


def _named_member(ta: Trace, tb: Trace, step: int, site: Any) -> tuple[str | None, str]:
    """The one tensor of category cell ``site`` that explains its difference at ``step``, and what is known:
    ``"one"`` (named), ``"several"``, ``"unnamed"`` (neither trace names the category's tensors)."""
    from ckptverify.trace.category import locate, matches

    finer = [t for t in (ta, tb) if t.header.detail == "tensor"]
    if not finer:
        return None, "unnamed"
    a, b = ta.lanes(step, site.name), tb.lanes(step, site.name)
    located = locate(a, b) if a is not None and b is not None else None
    if located is not None:
        # Only an unambiguous match names a tensor (a difference with many trailing zero bits leaves the
        # weight's high bits unknown).
        found = {s.name for trace in finer for s in trace.sites
                 if s.group == site.name and matches(s.name, located) and trace.lanes(step, s.name) is not None}
        if len(found) == 1:
            return found.pop(), "one"
    return None, "several"


def _describe(aligned: _Aligned, rank: int, step: int, row: np.ndarray) -> FirstDivergence:
    """The first divergence at ``step`` (``row``: which sites differ), with the module classification."""
    ta, tb = aligned.ta, aligned.tb
    j = int(np.argmax(row))
    name = aligned.names[j]
    site = ta.site(name) if ta.has_site(name) else tb.site(name)
    own = next((aligned.names[k] for k in np.flatnonzero(row)
                if aligned.kinds[k] in OWN_KINDS or aligned.names[k] in OWN_METRICS), None)
    base = {
        "step": step, "rank": rank, "site": name, "category": site.category, "kind": site.kind,
        "expected": aligned.value(ta, step, name), "actual": aligned.value(tb, step, name),
        "differing_sites": int(row.sum()), "own_site": own,
    }
    if site.encoding == "set128":
        member, known = _named_member(ta, tb, step, site)
        base["tensors"] = known
        if member is not None:
            base["site"], base["via"] = member, name
    module_cols = [k for k, kind in enumerate(aligned.kinds) if kind in _MODULE_KINDS]
    if ta.header.level not in _MODULE_LEVELS and tb.header.level not in _MODULE_LEVELS and not module_cols:
        return FirstDivergence(**base)
    differing_modules = [k for k in module_cols if row[k]]
    batch_cols = [k for k, kind in enumerate(aligned.kinds) if kind == "batch"]
    batch_equal = not any(row[k] for k in batch_cols)
    params_state = _previous_params(aligned, step)  # True equal, False differ, None not recorded
    inputs_verified = bool(batch_cols) and batch_equal and params_state is True
    if not differing_modules or not batch_equal or params_state is False:
        # No module to blame: the difference is not in a module, or it came in with the step's inputs.
        receivers = tuple(aligned.names[k] for k in differing_modules)
        return FirstDivergence(**base, receivers=receivers, inputs_verified=inputs_verified)
    k0 = differing_modules[0]
    origin_name = aligned.names[k0]
    origin_site = ta.site(origin_name) if ta.has_site(origin_name) else tb.site(origin_name)
    origin, fed, origin_type = module_of(origin_name), None, origin_site.info or None
    if origin_site.kind == "module_in":
        # Its input differs while everything recorded before (the parent's input included) is equal: the
        # parent's own forward computed it.
        fed = origin
        origin = parent_module(origin)
        origin_type = _module_type(aligned, origin)
    return FirstDivergence(
        **base,
        origin=origin,
        origin_site=origin_name,
        origin_type=origin_type,
        origin_fed=fed,
        receivers=tuple(aligned.names[k] for k in differing_modules[1:]),
        inputs_verified=inputs_verified,
    )


def parent_module(name: str) -> str:
    """The parent module's name (``blocks.0.ln1`` -> ``blocks.0``; a top-level module's is the root's)."""
    from ckptverify.trace.sites import ROOT_MODULE

    head, dot, _ = name.rpartition(".")
    return head if dot and name != ROOT_MODULE else ROOT_MODULE


def _module_type(aligned: _Aligned, module: str) -> str | None:
    for name in aligned.names:
        if name.startswith("module.") and module_of(name) == module:
            site = aligned.ta.site(name) if aligned.ta.has_site(name) else aligned.tb.site(name)
            return site.info or None
    return None


def module_of(site: str) -> str:
    """The module name in a module site name: ``module.blocks.0.attn.fwd#1`` -> ``blocks.0.attn``."""
    body = site[len("module."):] if site.startswith("module.") else site
    return body.rsplit(".", 1)[0]


def _previous_params(aligned: _Aligned, step: int) -> bool | None:
    """Whether the parameters recorded at the step before ``step`` are equal in both traces (``None`` when
    that step or its parameters are not in both)."""
    ta, tb = aligned.ta, aligned.tb
    row_a = ta.row_index(step)
    if not row_a:
        return None
    prev = int(ta.step_array[row_a - 1])
    row_b = tb.row_index(prev)
    if row_b is None:
        return None
    cols = [k for k, kind in enumerate(aligned.kinds) if kind == "param"]
    if not cols:
        return None
    differs, (_, pa, _, pb) = aligned.diff(np.asarray([row_a - 1]), np.asarray([row_b]))
    if not (pa[0, cols].any() or pb[0, cols].any()):
        return None
    return not bool(differs[0, cols].any())


# ------------------------------------------------------------------------------------------ findings


def _show(value: float | int | str | None) -> str:
    if value is None:
        return "not recorded"
    if isinstance(value, str):
        return value[:12] + "…"
    return repr(value)


def _run_label(run: str, tag: str) -> str:
    """How a message names a run: by its own name (``A2``), with the comparison side only when they differ."""
    if not run or run == tag:
        return f"run {tag}"
    if len(run) <= 3 and run[:1].isupper():
        return f"run {run}"
    return f"{tag} ({run!r})"


def _location(site: str, kind: str, rank: int) -> Location:
    fqn = None
    if site.endswith(".*"):
        fqn = None
    elif kind in ("param", "grad"):
        fqn = site.split(".", 1)[1]
    elif kind in _MODULE_KINDS:
        fqn = module_of(site)
    return Location(rank=rank, record=site, fqn=fqn)


def _findings(comparisons: Sequence[RankComparison]) -> list[Finding]:
    out: list[Finding] = []
    for comp in comparisons:
        r = comp.rank
        if comp.missing is not None:
            have, lack = ("A", "B") if comp.missing == "b" else ("B", "A")
            out.append(error("trace-incomplete", f"rank {r}: trace {have} has a store for this rank, trace {lack} "
                             "has none", location=Location(rank=r),
                             actual={"rank": r, "missing_in": lack}))
            continue
        for tag, run, missing in (("A", comp.run_a, comp.only_a), ("B", comp.run_b, comp.only_b)):
            if missing:
                out.append(error(
                    "trace-incomplete",
                    f"rank {r}: steps {step_ranges(missing)} are recorded only in trace {tag} (run {run!r}); "
                    "they were not compared",
                    location=Location(rank=r),
                    actual={"rank": r, "only_in": tag, "steps": list(missing)},
                ))
        if comp.ignored_sites:
            names = comp.ignored_sites
            shown = ", ".join(names[:_SHOWN]) + (", …" if len(names) > _SHOWN else "")
            # A comparison that compared nothing proves nothing: every site ignored is an error, not a pass.
            make = error if comp.compared_sites == 0 else info
            out.append(make("trace-ignored", f"rank {r}: {len(names)} sites matching --ignore were left out of the "
                            f"comparison{' (nothing was left to compare)' if make is error else ''}: {shown}",
                            location=Location(rank=r), actual={"rank": r, "sites": list(names)}))
        for tag, names in (("A", comp.sites_only_a), ("B", comp.sites_only_b)):
            if names:
                shown = ", ".join(names[:_SHOWN]) + (", …" if len(names) > _SHOWN else "")
                out.append(warning(
                    "trace-sites", f"rank {r}: {len(names)} sites are recorded only in trace {tag} and were not "
                    f"compared: {shown}", location=Location(rank=r),
                    actual={"rank": r, "only_in": tag, "sites": list(names)},
                ))
    divergent = [c for c in comparisons if c.first is not None]
    if not divergent:
        return out
    first_step = min(c.first.step for c in divergent if c.first is not None)
    job = job_divergence([c.first for c in divergent if c.first is not None])
    receiving = set(job.receiver_ranks or ()) if job is not None else set()
    for comp in divergent:
        d = comp.first
        assert d is not None
        later = "" if d.step == first_step else f" (after the first divergence of the job at step {first_step})"
        if d.rank in receiving:
            later += " (a receiver: only values a collective wrote differ on this rank)"
        where = f"site {d.site} ({d.kind})"
        if d.via:
            where = (f"tensor {d.site} ({d.kind}), the only one of category cell {d.via} that explains it: "
                     f"{d.via}")
        notes = {"several": "; more than one tensor of the category differs",
                 "unnamed": "; one digest stands for the whole category in both traces (detail 'category'): "
                            "compare with a trace of detail 'tensor' (a replay) to name the tensor"}
        note = notes.get(d.tensors or "", "")
        out.append(error(
            "trace-divergence",
            f"rank {d.rank}: first divergence at step {d.step}{later}, in {d.category}: {where} "
            f"is {_show(d.expected)} in {_run_label(comp.run_a, 'A')} and {_show(d.actual)} in "
            f"{_run_label(comp.run_b, 'B')}{note}; "
            f"{d.differing_sites} sites differ at that step",
            location=_location(d.site, d.kind, d.rank),
            expected={"value": d.expected},
            actual={"step": d.step, "site": d.site, "category": d.category, "kind": d.kind, "rank": d.rank,
                    "value": d.actual, "differing_sites": d.differing_sites, "via": d.via, "tensors": d.tensors},
        ))
        if d.origin is not None:
            kind = f" ({d.origin_type})" if d.origin_type else ""
            shown = ", ".join(d.receivers[:_SHOWN]) + (", …" if len(d.receivers) > _SHOWN else "")
            caveat = "" if d.inputs_verified else (
                "; the parameters this step started from are not in both traces, so equal inputs are assumed")
            what = (f"its input is equal, but its own forward changed the input of {d.origin_fed} "
                    f"({d.origin_site})" if d.origin_fed else f"inputs equal, {d.origin_site} differs")
            out.append(info(
                "trace-origin",
                f"rank {d.rank}, step {d.step}: module {d.origin}{kind} is the origin — {what}{caveat}; "
                f"{len(d.receivers)} later module sites differ as receivers"
                + (f": {shown}" if shown else ""),
                location=Location(rank=d.rank, fqn=d.origin, record=d.origin_site),
                actual={"step": d.step, "rank": d.rank, "origin": d.origin, "origin_site": d.origin_site,
                        "origin_type": d.origin_type, "origin_fed": d.origin_fed,
                        "receivers": list(d.receivers),
                        "inputs_verified": d.inputs_verified},
            ))
    per_rank = {c.rank: c.first.category for c in divergent if c.first is not None}
    ranks_first = sorted(c.rank for c in divergent if c.first is not None and c.first.step == first_step)
    text = ", ".join(f"rank {r}: {cat}" for r, cat in per_rank.items())
    roles = ""
    if job is not None and len(ranks_first) + len(job.receiver_ranks) > 1:
        if job.origin_ranks:
            roles = (f"; born on rank{'s' if len(job.origin_ranks) > 1 else ''} "
                     f"{', '.join(map(str, job.origin_ranks))}")
            if job.receiver_ranks:
                roles += (f", received through a collective by rank{'s' if len(job.receiver_ranks) > 1 else ''} "
                          f"{', '.join(map(str, job.receiver_ranks))}")
        else:
            roles = ("; every rank differs only in values a collective wrote (gradients, parameters, optimizer "
                     "state), so which rank it is born on cannot be told at this level")
    out.append(info(
        "trace-summary",
        f"traces first diverge at step {first_step} (ranks {', '.join(map(str, ranks_first))}); first divergent "
        f"category per rank: {text}{roles}",
        actual={"first_step": first_step, "ranks": ranks_first,
                "origin_ranks": list(job.origin_ranks) if job is not None else [],
                "receiver_ranks": list(job.receiver_ranks) if job is not None else [],
                "categories": {str(r): cat for r, cat in per_rank.items()},
                "steps": {str(c.rank): c.first.step for c in divergent if c.first is not None}},
    ))
    return out


# ------------------------------------------------------------------------------------------ public


def rank_comparisons(a: TraceLike, b: TraceLike, *, steps: Iterable[int] | None = None, force: bool = False,
                     ignore: Iterable[str] = (), ignore_sites: Iterable[str] = ()) -> list[RankComparison]:
    """Compare two traces, or two run directories rank by rank (each ``rank<r>/`` store with its peer).

    Headers are checked for every rank before anything is compared: they must agree on every field but
    ``run`` (and those in ``ignore``), else :class:`TraceHeaderMismatchError`, unless ``force``; traces whose
    tensor digests read differently (``digest_encoding``, unless in ``ignore``) are refused even with ``force``
    (:class:`UsageError`).
    ``ignore_sites``: glob patterns (``fnmatch``, case-sensitive) of site names left out on both sides.
    """
    ignore = tuple(ignore)
    if isinstance(a, Trace) or isinstance(b, Trace) or _is_store(a) or _is_store(b):
        pairs = [(_as_trace(a), _as_trace(b))]
        missing: list[RankComparison] = []
    else:
        stores_a, stores_b = run_stores(a), run_stores(b)
        if not stores_a and not stores_b:
            raise CkptVerifyError(f"no rank<r>/ trace stores in {a} or {b}")
        pairs = [(open_trace(stores_a[r]), open_trace(stores_b[r])) for r in stores_a if r in stores_b]
        missing = [
            RankComparison(rank=r, path_a=str(stores_a.get(r, "")), path_b=str(stores_b.get(r, "")), run_a="",
                           run_b="", level="", first=None, compared_steps=0, compared_sites=0,
                           missing="b" if r in stores_a else "a")
            for r in sorted(set(stores_a) ^ set(stores_b))
        ]
    for ta, tb in pairs:
        _check_headers(ta, tb, ta.header.differences(tb.header, ignore=(*_ALWAYS_IGNORED, *ignore)), force)
    sites = tuple(ignore_sites)
    comps = [_compare_pair(ta, tb, steps=steps, force=force, ignore=ignore, ignore_sites=sites) for ta, tb in pairs]
    return sorted([*comps, *missing], key=lambda c: c.rank)


def compare_traces(a: TraceLike, b: TraceLike, *, steps: Iterable[int] | None = None, force: bool = False,
                   ignore: Iterable[str] = (), ignore_sites: Iterable[str] = ()) -> list[Finding]:
    """Findings of comparing two traces (stores or open :class:`Trace`\\ s); no findings when they are equal
    over the compared steps.

    ``steps`` restricts the comparison (e.g. ``range(K + 1, T + 1)`` for a run resumed at ``K``); steps in
    the range recorded by only one trace are a ``trace-incomplete`` error. Findings: ``trace-divergence``
    (error, the first divergent step and site), ``trace-origin`` (info, level ``module``),
    ``trace-summary`` (info), ``trace-incomplete`` (error), ``trace-sites`` (warning, only with ``force``),
    ``trace-ignored`` (info: the sites left out because they match a glob of ``ignore_sites``), and each
    trace's own ``recompute-mismatch`` errors (:func:`recompute_findings`).
    """
    found = _findings(rank_comparisons(a, b, steps=steps, force=force, ignore=ignore, ignore_sites=ignore_sites))
    return [*found, *recompute_findings(a, steps=steps), *recompute_findings(b, steps=steps)]


def compare_runs(dir_a: str | os.PathLike[str], dir_b: str | os.PathLike[str], *,
                 steps: Iterable[int] | None = None, force: bool = False, ignore: Iterable[str] = (),
                 ignore_sites: Iterable[str] = ()) -> list[Finding]:
    """:func:`compare_traces` over all ranks of two run directories (``rank<r>/`` stores). A rank with a
    store in only one run is a ``trace-incomplete`` error."""
    for d in (dir_a, dir_b):
        if _is_store(d):
            raise UsageError(f"{d} is a single trace store, not a run directory; use compare_traces")
    return _findings(rank_comparisons(dir_a, dir_b, steps=steps, force=force, ignore=ignore,
                                      ignore_sites=ignore_sites))


def divergences(a: TraceLike, b: TraceLike, *, steps: Iterable[int] | None = None, force: bool = False,
                ignore: Iterable[str] = (), ignore_sites: Iterable[str] = ()) -> list[FirstDivergence]:
    """Each divergent rank's first divergence (traces or run directories), by rank."""
    return [c.first for c in rank_comparisons(a, b, steps=steps, force=force, ignore=ignore,
                                              ignore_sites=ignore_sites) if c.first is not None]


def first_divergence(a: TraceLike, b: TraceLike, *, steps: Iterable[int] | None = None, force: bool = False,
                     ignore: Iterable[str] = (), ignore_sites: Iterable[str] = ()) -> FirstDivergence | None:
    """The job's first divergence: at the earliest divergent step, the divergence of the rank where it is born
    (see the module docstring; the lowest such rank when several are), with ``origin_ranks`` and
    ``receiver_ranks`` set for the job; ``None`` when the traces agree on every common step. When several
    ranks differ at that step and none in a value of its own, the lowest rank's divergence is returned with no
    origin rank: the traces cannot tell. Accepts two traces or two run directories."""
    found = divergences(a, b, steps=steps, force=force, ignore=ignore, ignore_sites=ignore_sites)
    return job_divergence(found)


def job_divergence(found: Sequence[FirstDivergence]) -> FirstDivergence | None:
    """:func:`first_divergence` over each rank's first divergence ``found`` (one per rank)."""
    if not found:
        return None
    step = min(d.step for d in found)
    at = sorted((d for d in found if d.step == step), key=lambda d: d.rank)
    # One rank alone differs: it is where the difference is born, whatever it differs in.
    origins = [at[0]] if len(at) == 1 else [d for d in at if d.own_site is not None]
    origin_ranks = tuple(d.rank for d in origins)
    receivers = tuple(sorted(d.rank for d in found if d.rank not in origin_ranks)) if origins else ()
    chosen = origins[0] if origins else at[0]
    return replace(chosen, origin_ranks=origin_ranks, receiver_ranks=receivers)


def recompute_findings(trace: TraceLike, *, steps: Iterable[int] | None = None) -> list[Finding]:
    """``recompute-mismatch`` errors of one run (a trace, a store or a run directory; no second run needed): per
    rank and module, the first step where a module forward that activation checkpointing recomputed in backward
    (``module.<m>.recompute#k``) gave another output than the forward it repeats (``module.<m>.fwd#k``), so
    that backward used activations the forward never produced (dropout with ``preserve_rng_state=False``, a
    nondeterministic kernel, state that changed in between). ``steps`` narrows the steps looked at."""
    if isinstance(trace, Trace) or _is_store(trace):
        traces = [_as_trace(trace)]
    else:
        traces = [open_trace(p) for p in run_stores(trace).values()]
    wanted = None if steps is None else {int(s) for s in steps}
    out: list[Finding] = []
    for t in traces:
        pairs = [(s.name, s.name.replace(".recompute#", ".fwd#", 1)) for s in t.sites if s.kind == "module_recompute"]
        pairs = [(r, f) for r, f in pairs if t.has_site(f)]
        if not pairs:
            continue
        rank = t.header.rank
        first: dict[str, tuple[int, str, str | None, str | None]] = {}
        for step in t.steps:
            if wanted is not None and step not in wanted:
                continue
            for rec, fwd in pairs:
                module = module_of(rec)
                if module in first:
                    continue
                a, b = t.hex(step, fwd), t.hex(step, rec)
                if a is not None and b is not None and a != b:
                    first[module] = (step, rec, a, b)
        for module, (step, site, a, b) in first.items():
            out.append(error(
                "recompute-mismatch",
                f"rank {rank}, step {step}: the forward of {module} recomputed in backward (activation "
                f"checkpointing) gave another output than the forward it repeats ({site.rsplit('#', 1)[-1]}-th "
                "call): backward used activations the forward never produced. Dropout or other random ops in "
                "a checkpointed region need preserve_rng_state=True; a nondeterministic op or state changed "
                "between forward and backward do the same",
                location=Location(rank=rank, fqn=module, record=f"step {step}"),
                expected=a, actual=b,
            ))
    return out
