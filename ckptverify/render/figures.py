"""Pictures of a resume check (``resume-check --report DIR``): ``index.html`` with the verdict and findings, and PNGs
of metrics per run, differing sites per category and (level ``module``) per module with the origin marked. Needs
matplotlib; without it :func:`write_report` raises :class:`UsageError`."""

from __future__ import annotations

import html
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ckptverify.errors import UsageError

__all__ = ["write_report"]

_COLORS = {"A": "#1f77b4", "A2": "#2ca02c", "B": "#d62728"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--report needs matplotlib: pip install 'ckptverify[report]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _metric_figure(plt: Any, traces: dict[str, dict[int, Any]], path: str) -> bool:
    runs = {name: ranks[0] for name, ranks in traces.items() if 0 in ranks}
    if "A" not in runs:
        return False
    metrics = [s.name for s in runs["A"].sites if s.kind == "metric" and s.encoding in ("f64", "i64")]
    if not metrics:
        return False
    fig, axes = plt.subplots(len(metrics), 2, figsize=(10, 2.6 * len(metrics)), squeeze=False)
    for row, name in enumerate(metrics):
        values: dict[str, dict[int, float]] = {}
        for run, trace in runs.items():
            if trace.has_site(name):
                values[run] = {int(s): float(v) for s in trace.steps if (v := trace.value(int(s), name)) is not None}
        ax, diff_ax = axes[row]
        for run, series in values.items():
            steps = sorted(series)
            ax.plot(steps, [series[s] for s in steps], marker="o", ms=3, label=run, color=_COLORS.get(run),
                    linestyle="--" if run == "B" else "-")
        ax.set_title(name.removeprefix("metric."))
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        if "B" in values:
            common = sorted(set(values["A"]) & set(values["B"]))
            diff_ax.plot(common, [abs(values["A"][s] - values["B"][s]) for s in common], marker="o", ms=3,
                         color=_COLORS["B"])
        diff_ax.set_title(f"|A - B| {name.removeprefix('metric.')}")
        diff_ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _differing(ta: Any, tb: Any) -> dict[int, list[Any]]:
    """Per common step, the sites (of ``ta``'s table, or ``tb``'s) whose values differ."""
    steps = sorted(set(int(s) for s in ta.steps) & set(int(s) for s in tb.steps))
    sites = {s.name: s for s in tb.sites}
    sites.update({s.name: s for s in ta.sites})
    return {step: [site for name, site in sites.items() if ta.value(step, name) != tb.value(step, name)]
            for step in steps}


def _heatmap(plt: Any, counts: Sequence[Sequence[int]], rows: Sequence[str], steps: Sequence[int], title: str,
             path: str, mark: tuple[int, int] | None = None) -> None:
    import numpy as np

    data = np.asarray(counts, dtype=float).reshape(len(rows), len(steps))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(steps) + 3), max(2.0, 0.3 * len(rows) + 1.5)))
    image = ax.imshow(data, aspect="auto", cmap="Reds", interpolation="nearest")
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=9)
    if mark is not None:
        ax.scatter([mark[1]], [mark[0]], marker="*", s=160, color="#1f77b4", label="origin")
        ax.legend(fontsize=7, loc="upper right")
    fig.colorbar(image, ax=ax, label="differing sites")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_report(report_dir: str, *, report: Any, verdict: Any, trace_dirs: Mapping[str, str],
                 steps: range) -> str:
    """Write ``index.html`` and its figures into ``report_dir``; return the page's path. ``trace_dirs``: run name ->
    trace directory; A and B are compared over ``steps``."""
    plt = _pyplot()
    from ckptverify.trace.compare import module_of, run_stores
    from ckptverify.trace.store import open_trace

    os.makedirs(report_dir, exist_ok=True)
    traces = {name: {rank: open_trace(path) for rank, path in run_stores(d).items()}
              for name, d in trace_dirs.items() if d and os.path.isdir(d)}
    figures: list[tuple[str, str]] = []
    if _metric_figure(plt, traces, os.path.join(report_dir, "metrics.png")):
        figures.append(("metrics.png", "Metrics per step: A, A2, B, and |A - B|"))
    if "A" in traces and "B" in traces:
        per_step: dict[int, list[Any]] = {}
        for rank in sorted(set(traces["A"]) & set(traces["B"])):
            for step, sites in _differing(traces["A"][rank], traces["B"][rank]).items():
                if step in steps:
                    per_step.setdefault(step, []).extend(sites)
        shown = sorted(per_step)
        if shown:
            categories = sorted({s.category for sites in per_step.values() for s in sites}) or ["(none)"]
            counts = [[sum(1 for s in per_step[step] if s.category == c) for step in shown] for c in categories]
            _heatmap(plt, counts, categories, shown, "A vs B: differing sites per category (all ranks)",
                     os.path.join(report_dir, "categories.png"))
            figures.append(("categories.png", "Where A and B differ, by category"))
            modules = sorted({module_of(s.name) for sites in per_step.values() for s in sites
                              if s.name.startswith("module.")})
            if modules:
                counts = [[sum(1 for s in per_step[step] if s.name.startswith("module.") and module_of(s.name) == m)
                           for step in shown] for m in modules]
                mark = None
                if verdict.origin in modules and verdict.step in shown:
                    mark = (modules.index(verdict.origin), shown.index(verdict.step))
                _heatmap(plt, counts, modules, shown, "A vs B: differing module sites (origin starred)",
                         os.path.join(report_dir, "modules.png"), mark)
                figures.append(("modules.png", "Where A and B differ, by module"))
    page = os.path.join(report_dir, "index.html")
    rows = "\n".join(
        f"<tr><td>{html.escape(f.severity.value)}</td><td>{html.escape(f.check)}</td>"
        f"<td>{html.escape(f.location.describe() or '-')}</td><td>{html.escape(f.message)}</td></tr>"
        for f in report.findings)
    images = "\n".join(f'<figure><img src="{name}" alt="{html.escape(caption)}"><figcaption>{html.escape(caption)}'
                       "</figcaption></figure>" for name, caption in figures)
    color = "#2a7" if verdict.passed else "#c33"
    with open(page, "w", encoding="utf-8") as f:
        f.write(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>resume-check: {html.escape(report.target)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}} td{{vertical-align:top;padding:2px 6px}}
table{{border-collapse:collapse;font-size:90%}} tr:nth-child(even){{background:#f4f4f4}} img{{max-width:100%}}</style>
</head><body>
<h1>resume-check: {html.escape(report.target)}</h1>
<p style="font-weight:bold;color:{color}">{html.escape(verdict.headline())}</p>
{images}
<h2>Findings</h2>
<table><tr><th>severity</th><th>check</th><th>where</th><th>what</th></tr>
{rows}
</table></body></html>
""")
    return page
