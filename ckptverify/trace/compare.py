"""Compare two traces step by step and find where they first diverge (see ``docs/trace.md``).

Cells align by step number and site name (which carries the occurrence ``#k``); a rank's first divergence is the
first differing cell (value, or recorded in one trace only) of the first such step, in execution order. Per-tensor
cells only a ``tensor``-detail trace holds are left out; a differing category cell is traced back to its one tensor
when possible. Trap: under DDP/FSDP a cause on one rank reaches every rank at the next gradient reduction, so the
lowest differing rank is not the answer: a rank is an *origin* when an :data:`OWN_KINDS` value differs, a *receiver*
when only values downstream of a collective do."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ckptverify.errors import CkptVerifyError, TraceHeaderMismatchError, UsageError
from ckptverify.findings import Finding, Location, error, info, warning
from ckptverify.trace.sites import ROOT_MODULE
from ckptverify.trace.store import DIGEST_ENCODINGS, Site, Trace, block_rows, is_store, open_trace, step_ranges

__all__ = ["FirstDivergence", "RankComparison", "compare_runs", "compare_traces", "comparison_findings",
           "first_divergence", "job_divergence", "module_of", "named_member", "rank_comparisons", "recompute_findings",
           "run_stores", "sites_at"]

TraceLike = Trace | str | os.PathLike[str]

_MODULE_KINDS = frozenset({"module_in", "module_out", "module_grad_in"})
#: Site kinds a rank computes on its own, upstream of any collective: a difference there is born on that rank.
#: Gradients (read after reduction), parameters, optimizer state and collective outputs carry every rank's values.
OWN_KINDS = frozenset({"rng", "hparam", "batch", "data", "buffer", "scheduler", "counter", "extra", "comm_in",
                       "module_in", "module_out", "module_grad_in", "module_recompute"})
#: Metrics holding the rank's own value (a gradient norm, say, is computed after the reduction).
OWN_METRICS = frozenset({"metric.loss"})
#: Receivers named in a message (all are in the finding's ``actual``).
_SHOWN = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstDivergence:
    """Where one rank's traces first differ; ``expected`` is trace A's value, ``actual`` B's (``None``: not recorded).

    Module levels: ``origin`` is the module whose recorded inputs are equal and output differs (``None`` when the
    step's inputs differ), ``receivers`` the module sites differing after it; ``inputs_verified`` says the batch and
    starting parameters were found equal (else assumed). A differing child *input* under an equal parent input makes
    the parent the origin and ``origin_fed`` the child. For a category cell, ``site`` names the one tensor that
    explains it when known, ``via`` the category cell, ``tensors`` is ``one``/``several``/``unnamed``."""

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
    #: First differing site of :data:`OWN_KINDS`/:data:`OWN_METRICS`; ``None``: all downstream of a collective.
    own_site: str | None = None
    #: Set by :func:`first_divergence` for the job: ranks where it is born (empty: cannot tell), and ranks that
    #: differ only through a collective.
    origin_ranks: tuple[int, ...] | None = None
    receiver_ranks: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {name: list(v) if isinstance(v := getattr(self, name), tuple) else v
                for name in self.__slots__}  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankComparison:
    """The comparison of one rank's two traces: ``differing`` the sites that differ at any step read (every compared
    step with :func:`rank_comparisons`' ``every_step``), ``first_differing`` those at the first divergent step
    (execution order each), ``traces`` the two traces."""

    rank: int
    path_a: str
    path_b: str
    run_a: str
    run_b: str
    first: FirstDivergence | None
    compared_sites: int
    only_a: tuple[int, ...] = ()
    only_b: tuple[int, ...] = ()
    sites_only_a: tuple[str, ...] = ()
    sites_only_b: tuple[str, ...] = ()
    ignored_sites: tuple[str, ...] = ()
    missing: str | None = field(default=None)  # "a" or "b" when that run has no store for this rank
    differing: tuple[str, ...] = ()
    first_differing: tuple[str, ...] = ()
    traces: tuple[Trace, Trace] | None = field(default=None, repr=False, compare=False)


def _as_trace(x: TraceLike) -> Trace:
    return x if isinstance(x, Trace) else open_trace(x)


def run_stores(run_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """``{rank: store path}`` of a run's trace directory (its ``rank<r>/`` stores)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise CkptVerifyError(f"no trace directory at {root}")
    found = {int(c.name[4:]): c for c in root.iterdir()
             if c.name.startswith("rank") and c.name[4:].isdigit() and is_store(c)}
    return dict(sorted(found.items()))


def _step_mask(steps: np.ndarray, wanted: Iterable[int] | None) -> np.ndarray:
    if wanted is None:
        return np.ones(steps.shape, dtype=bool)
    if isinstance(wanted, range):
        return np.fromiter((int(s) in wanted for s in steps), dtype=bool, count=steps.shape[0])
    return np.isin(steps, np.asarray([int(s) for s in wanted], dtype=np.int64))


def merged_order(a: Sequence[Any], b: Sequence[Any]) -> list[Any]:
    """A's execution order, with B's extra items placed right after the item B records before them."""
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


class _Aligned:
    """Two traces' columns lined up over a common list of site names."""

    def __init__(self, ta: Trace, tb: Trace, names: list[str]) -> None:
        self.ta, self.tb, self.names = ta, tb, names
        self.kinds = [self.site(n).kind for n in names]
        pad_a, pad_b = len(ta._by_column), len(tb._by_column)
        self.col_a = np.asarray([c if (c := ta.column(n)) is not None else pad_a for n in names], dtype=np.int64)
        self.col_b = np.asarray([c if (c := tb.column(n)) is not None else pad_b for n in names], dtype=np.int64)

    def site(self, name: str) -> Site:
        """``name``'s site as trace A records it, else as trace B does."""
        return self.ta.site(name) if self.ta.has_site(name) else self.tb.site(name)

    @staticmethod
    def _take(trace: Trace, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Read each run of consecutive rows on its own: reading across gaps would cost the gap.
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        parts = [trace.rows(int(run[0]), int(run[-1]) + 1) for run in np.split(rows, cuts)]
        # One column more, absent: where a site the trace lacks points.
        values = np.pad(np.concatenate([v for v, _ in parts]), ((0, 0), (0, 1), (0, 0)))
        present = np.pad(np.concatenate([p for _, p in parts]), ((0, 0), (0, 1)))
        return values[:, cols], present[:, cols]

    def diff(self, rows_a: np.ndarray, rows_b: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """``[rows, sites]`` bool: cell differs (value, or present in one trace only); plus the raw blocks."""
        va, pa = self._take(self.ta, rows_a, self.col_a)
        vb, pb = self._take(self.tb, rows_b, self.col_b)
        differs = (pa != pb) | (pa & pb & (va != vb).any(axis=-1))
        return differs, (va, pa, vb, pb)


def _compare_pair(ta: Trace, tb: Trace, *, steps: Iterable[int] | None, force: bool, ignore_sites: tuple[str, ...],
                  every_step: bool) -> RankComparison:
    """Compare one rank's traces whose headers :func:`rank_comparisons` accepted; past the first divergent block only
    with ``every_step``."""
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
        # Before aligning: an ignored site is neither a difference nor a one-sided site.
        ignored = tuple(dict.fromkeys(n for n in (*names_a, *names_b)
                                      if any(fnmatch.fnmatchcase(n, p) for p in ignore_sites)))
        names_a = [n for n in names_a if n not in ignored]
        names_b = [n for n in names_b if n not in ignored]
    sites_only_a: tuple[str, ...] = ()
    sites_only_b: tuple[str, ...] = ()
    if force:
        names = [n for n in names_a if tb.has_site(n)]
        sites_only_a = tuple(n for n in names_a if not tb.has_site(n))
        sites_only_b = tuple(n for n in names_b if not ta.has_site(n))
    else:
        names = merged_order(names_a, names_b)
    # A tensor's own cell only the trace of detail ``tensor`` records is no difference: the category cell stands for it.
    finer = {s.name for mine, other in ((ta, tb), (tb, ta)) if other.header.detail == "category"
             for s in mine.sites if s.group}
    names = [n for n in names if (ta.has_site(n) and tb.has_site(n)) or n not in finer]
    aligned = _Aligned(ta, tb, names)
    rows_a = np.searchsorted(sa, common)
    rows_b = np.searchsorted(sb, common)

    first: FirstDivergence | None = None
    ever = at_first = np.zeros(len(names), dtype=bool)
    if names:
        block = block_rows(max(len(ta._by_column), len(tb._by_column), len(names)))
        for i0 in range(0, common.shape[0], block):
            ra, rb = rows_a[i0 : i0 + block], rows_b[i0 : i0 + block]
            differs, _ = aligned.diff(ra, rb)
            ever = ever | differs.any(axis=0)
            bad_rows = np.flatnonzero(differs.any(axis=1))
            if first is None and bad_rows.size:
                i = int(bad_rows[0])
                first, at_first = _describe(aligned, rank, int(common[i0 + i]), differs[i]), differs[i]
            if first is not None and not every_step:
                break
    return RankComparison(rank=rank, path_a=str(ta.path), path_b=str(tb.path), run_a=ta.header.run,
                          run_b=tb.header.run, first=first, compared_sites=len(names), only_a=only_a,
                          only_b=only_b, sites_only_a=sites_only_a, sites_only_b=sites_only_b, ignored_sites=ignored,
                          differing=tuple(n for n, d in zip(names, ever, strict=True) if d),
                          first_differing=tuple(n for n, d in zip(names, at_first, strict=True) if d),
                          traces=(ta, tb))


def named_member(ta: Trace, tb: Trace, step: int, site: Any) -> tuple[str | None, str]:
    """The one tensor of category cell ``site`` that explains its difference at ``step``, and what is known:
    ``"one"``, ``"several"`` or ``"unnamed"``."""
    from ckptverify.trace.category import locate, matches

    finer = [t for t in (ta, tb) if t.header.detail == "tensor"]
    if not finer:
        return None, "unnamed"
    a, b = ta.lanes(step, site.name), tb.lanes(step, site.name)
    located = locate(a, b) if a is not None and b is not None else None
    if located is not None:
        # Only an unambiguous match names a tensor (many trailing zero bits leave the weight ambiguous).
        found = {s.name for trace in finer for s in trace.sites
                 if s.group == site.name and matches(s.name, located) and trace.lanes(step, s.name) is not None}
        if len(found) == 1:
            return found.pop(), "one"
    return None, "several"


def _describe(aligned: _Aligned, rank: int, step: int, row: np.ndarray) -> FirstDivergence:
    """The first divergence at ``step`` (``row``: which sites differ), with the module classification."""
    ta, tb = aligned.ta, aligned.tb
    name = aligned.names[int(np.argmax(row))]
    site = aligned.site(name)
    own = next((aligned.names[k] for k in np.flatnonzero(row)
                if aligned.kinds[k] in OWN_KINDS or aligned.names[k] in OWN_METRICS), None)
    base = {
        "step": step, "rank": rank, "site": name, "category": site.category, "kind": site.kind,
        "expected": ta.value(step, name), "actual": tb.value(step, name),
        "differing_sites": int(row.sum()), "own_site": own,
    }
    if site.encoding == "set128":
        member, known = named_member(ta, tb, step, site)
        base["tensors"] = known
        if member is not None:
            base["site"], base["via"] = member, name
    module_cols = [k for k, kind in enumerate(aligned.kinds) if kind in _MODULE_KINDS]
    if ta.header.level not in ("module", "op") and tb.header.level not in ("module", "op") and not module_cols:
        return FirstDivergence(**base)
    differing_modules = [k for k in module_cols if row[k]]
    batch_cols = [k for k, kind in enumerate(aligned.kinds) if kind == "batch"]
    batch_equal = not any(row[k] for k in batch_cols)
    params_state = _previous_params(aligned, step)  # True equal, False differ, None not recorded
    inputs_verified = bool(batch_cols) and batch_equal and params_state is True
    if not differing_modules or not batch_equal or params_state is False:
        receivers = tuple(aligned.names[k] for k in differing_modules)
        return FirstDivergence(**base, receivers=receivers, inputs_verified=inputs_verified)
    origin_name = aligned.names[differing_modules[0]]
    origin_site = aligned.site(origin_name)
    origin, fed, origin_type = module_of(origin_name), None, origin_site.info or None
    if origin_site.kind == "module_in":
        # The parent (``blocks.0.ln1`` -> ``blocks.0``; a top-level module's is the root) changed its child's input.
        head, dot, _ = origin.rpartition(".")
        fed, origin = origin, head if dot and origin != ROOT_MODULE else ROOT_MODULE
        origin_type = next((aligned.site(n).info or None for n in aligned.names
                            if n.startswith("module.") and module_of(n) == origin), None)
    return FirstDivergence(
        **base,
        origin=origin,
        origin_site=origin_name,
        origin_type=origin_type,
        origin_fed=fed,
        receivers=tuple(aligned.names[k] for k in differing_modules[1:]),
        inputs_verified=inputs_verified,
    )


def module_of(site: str) -> str:
    """The module name in a module site name: ``module.blocks.0.attn.fwd#1`` -> ``blocks.0.attn``."""
    return site.removeprefix("module.").rsplit(".", 1)[0]


def _previous_params(aligned: _Aligned, step: int) -> bool | None:
    """Whether the parameters recorded at the step before ``step`` are equal in both traces (``None`` when not in
    both)."""
    ta, tb = aligned.ta, aligned.tb
    row_a = ta.row_index(step)
    if not row_a:
        return None
    prev = int(ta.step_array[row_a - 1])
    row_b = tb.row_index(prev)
    if row_b is None:
        return None
    cols = [k for k, kind in enumerate(aligned.kinds) if kind == "param"]
    differs, (_, pa, _, pb) = aligned.diff(np.asarray([row_a - 1]), np.asarray([row_b]))
    if not (pa[0, cols].any() or pb[0, cols].any()):
        return None
    return not bool(differs[0, cols].any())


def _show(value: float | int | str | None) -> str:
    if value is None:
        return "not recorded"
    if isinstance(value, str):
        return value[:12] + "…"
    return repr(value)


def _run_label(run: str, tag: str) -> str:
    """How a message names a run: its own name (``A2``), with the side only when they differ."""
    if not run or run == tag:
        return f"run {tag}"
    if len(run) <= 3 and run[:1].isupper():
        return f"run {run}"
    return f"{tag} ({run!r})"


def _location(site: str, kind: str, rank: int) -> Location:
    fqn = None
    if site.endswith(".*"):
        pass  # a category cell: no one tensor
    elif kind in ("param", "grad"):
        fqn = site.split(".", 1)[1]
    elif kind in _MODULE_KINDS:
        fqn = module_of(site)
    return Location(rank=rank, record=site, fqn=fqn)


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", …" if len(names) > _SHOWN else "")


def comparison_findings(comparisons: Sequence[RankComparison]) -> list[Finding]:
    """The findings of :func:`rank_comparisons`' result: one-sided steps and sites, left-out sites, each divergent
    rank's first divergence (and origin module), and the job's summary."""
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
            # Comparing nothing proves nothing: all sites ignored is an error.
            make = error if comp.compared_sites == 0 else info
            out.append(make("trace-ignored", f"rank {r}: {len(names)} sites matching --ignore were left out of the "
                            f"comparison{' (nothing was left to compare)' if make is error else ''}: {_listed(names)}",
                            location=Location(rank=r), actual={"rank": r, "sites": list(names)}))
        for tag, names in (("A", comp.sites_only_a), ("B", comp.sites_only_b)):
            if names:
                out.append(warning(
                    "trace-sites", f"rank {r}: {len(names)} sites are recorded only in trace {tag} and were not "
                    f"compared: {_listed(names)}", location=Location(rank=r),
                    actual={"rank": r, "only_in": tag, "sites": list(names)},
                ))
    firsts = [c.first for c in comparisons if c.first is not None]
    job = job_divergence(firsts)
    if job is None:
        return out
    first_step = job.step  # the earliest divergent step
    receiving = set(job.receiver_ranks or ())
    for comp in comparisons:
        d = comp.first
        if d is None:
            continue
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
            shown = _listed(d.receivers)
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
    per_rank = {d.rank: d.category for d in firsts}
    ranks_first = sorted(d.rank for d in firsts if d.step == first_step)
    text = ", ".join(f"rank {r}: {cat}" for r, cat in per_rank.items())
    roles = ""
    if len(ranks_first) + len(job.receiver_ranks or ()) > 1:
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
                "origin_ranks": list(job.origin_ranks or ()), "receiver_ranks": list(job.receiver_ranks or ()),
                "categories": {str(r): cat for r, cat in per_rank.items()},
                "steps": {str(d.rank): d.step for d in firsts}},
    ))
    return out


def rank_comparisons(a: TraceLike, b: TraceLike, *, steps: Iterable[int] | None = None, force: bool = False,
                     ignore: Iterable[str] = (), ignore_sites: Iterable[str] = (),
                     every_step: bool = False) -> list[RankComparison]:
    """Compare two traces, or two run directories rank by rank.

    Every rank's headers are checked first: they must agree but for ``run`` and ``ignore``, else
    :class:`TraceHeaderMismatchError` unless ``force``; differing ``digest_encoding`` is a :class:`UsageError` even
    with ``force``. ``ignore_sites``: case-sensitive ``fnmatch`` globs of site names left out on both sides.
    ``every_step``: read every compared step for ``differing``; without it reading stops at the first divergent
    block, and ``differing`` covers the steps read."""
    ignore = tuple(ignore)
    if isinstance(a, Trace) or isinstance(b, Trace) or is_store(a) or is_store(b):
        pairs = [(_as_trace(a), _as_trace(b))]
        missing: list[RankComparison] = []
    else:
        stores_a, stores_b = run_stores(a), run_stores(b)
        if not stores_a and not stores_b:
            raise CkptVerifyError(f"no rank<r>/ trace stores in {a} or {b}")
        pairs = [(open_trace(stores_a[r]), open_trace(stores_b[r])) for r in stores_a if r in stores_b]
        missing = [
            RankComparison(rank=r, path_a=str(stores_a.get(r, "")), path_b=str(stores_b.get(r, "")), run_a="",
                           run_b="", first=None, compared_sites=0,
                           missing="b" if r in stores_a else "a")
            for r in sorted(set(stores_a) ^ set(stores_b))
        ]
    for ta, tb in pairs:
        diffs = ta.header.differences(tb.header, ignore=("run", "detail", *ignore))
        if "digest_encoding" in diffs:  # refused even with force: every tensor site would differ
            ea, eb = ta.header.digest_encoding, tb.header.digest_encoding
            raise UsageError(f"the traces digest tensors differently ({ta.path}: digest_encoding {ea!r}, "
                             f"{DIGEST_ENCODINGS[ea]}; {tb.path}: digest_encoding {eb!r}, {DIGEST_ENCODINGS[eb]}), "
                             "so every tensor site would differ and no step can be compared; record both on the same "
                             "kind of device")
        if diffs and not force:
            raise TraceHeaderMismatchError(diffs, ta, tb)
    sites = tuple(ignore_sites)
    comps = [_compare_pair(ta, tb, steps=steps, force=force, ignore_sites=sites, every_step=every_step)
             for ta, tb in pairs]
    return sorted([*comps, *missing], key=lambda c: c.rank)


def compare_traces(a: TraceLike, b: TraceLike, *, steps: Iterable[int] | None = None, force: bool = False,
                   ignore: Iterable[str] = (), ignore_sites: Iterable[str] = ()) -> list[Finding]:
    """Findings of comparing two traces (none when equal over the compared steps), plus each trace's
    :func:`recompute_findings`. Steps in ``steps`` recorded by only one trace are a ``trace-incomplete`` error."""
    found = comparison_findings(rank_comparisons(a, b, steps=steps, force=force, ignore=ignore,
                                                 ignore_sites=ignore_sites))
    return [*found, *recompute_findings(a, steps=steps), *recompute_findings(b, steps=steps)]


def compare_runs(dir_a: str | os.PathLike[str], dir_b: str | os.PathLike[str], *,
                 steps: Iterable[int] | None = None, force: bool = False, ignore: Iterable[str] = (),
                 ignore_sites: Iterable[str] = ()) -> list[Finding]:
    """:func:`compare_traces` over all ranks of two run directories (``rank<r>/`` stores). A rank with a
    store in only one run is a ``trace-incomplete`` error."""
    for d in (dir_a, dir_b):
        if is_store(d):
            raise UsageError(f"{d} is a single trace store, not a run directory; use compare_traces")
    return comparison_findings(rank_comparisons(dir_a, dir_b, steps=steps, force=force, ignore=ignore,
                                                ignore_sites=ignore_sites))


def first_divergence(a: TraceLike, b: TraceLike, *, steps: Iterable[int] | None = None, force: bool = False,
                     ignore: Iterable[str] = (), ignore_sites: Iterable[str] = ()) -> FirstDivergence | None:
    """The job's first divergence: at the earliest divergent step, the (lowest) rank where it is born, with
    ``origin_ranks``/``receiver_ranks`` set; ``None`` when the traces agree. When several ranks differ and none in a
    value of its own, the lowest rank's divergence with no origin rank: the traces cannot tell."""
    comps = rank_comparisons(a, b, steps=steps, force=force, ignore=ignore, ignore_sites=ignore_sites)
    return job_divergence([c.first for c in comps if c.first is not None])


def sites_at(comparisons: Sequence[RankComparison], step: int) -> dict[int, list[str]]:
    """Per rank compared in both runs, the sites that differ at ``step``, which is no later than any rank's first
    divergence (the job's first divergent step): a rank diverging later has none."""
    return {c.rank: list(c.first_differing) if c.first is not None and c.first.step == step else []
            for c in comparisons if c.missing is None}


def job_divergence(found: Sequence[FirstDivergence]) -> FirstDivergence | None:
    """:func:`first_divergence` over each rank's first divergence ``found`` (one per rank)."""
    if not found:
        return None
    step = min(d.step for d in found)
    at = sorted((d for d in found if d.step == step), key=lambda d: d.rank)
    origins = [at[0]] if len(at) == 1 else [d for d in at if d.own_site is not None]
    origin_ranks = tuple(d.rank for d in origins)
    receivers = tuple(sorted(d.rank for d in found if d.rank not in origin_ranks)) if origins else ()
    chosen = origins[0] if origins else at[0]
    return replace(chosen, origin_ranks=origin_ranks, receiver_ranks=receivers)


def recompute_findings(trace: TraceLike, *, steps: Iterable[int] | None = None) -> list[Finding]:
    """``recompute-mismatch`` errors of one run: per rank and module, the first step where a forward recomputed by
    activation checkpointing (``recompute#k``) differs from the forward it repeats (``fwd#k``), so backward used
    activations the forward never produced. ``steps`` narrows the steps."""
    single = isinstance(trace, Trace) or is_store(trace)
    traces = [_as_trace(trace)] if single else [open_trace(p) for p in run_stores(trace).values()]
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
