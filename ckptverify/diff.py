"""``diff``: compare two checkpoints tensor by tensor, whatever their sharding.

Tensors are compared by logical fingerprint (from each checkpoint's manifest when it has a valid one, else
rebuilt from the bytes), so checkpoints saved with different world sizes or chunkings compare correctly.
Only tensors whose fingerprints differ are loaded in full (both sides, one tensor at a time) to report how
they differ: number of differing elements, max absolute difference, max ULP distance, first differing index.
Both checkpoints are verified first; their errors are reported and their damaged tensors not compared.
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any

from ckptverify.checks import deep as deep_check
from ckptverify.dcp.tensors import read_chunk
from ckptverify.dcp.torchsave import Archive
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info
from ckptverify.readers import FileChangedError
from ckptverify.verify import ProgressSink, VerificationRun, cap_findings, default_jobs

if TYPE_CHECKING:
    import torch


def diff_checkpoints(a: str | os.PathLike[str], b: str | os.PathLike[str], *, jobs: int | None = None,
                     progress: ProgressSink | None = None) -> Report:
    """Compare checkpoints ``a`` and ``b``; exit code 0 when every tensor and value is bitwise equal."""
    from ckptverify.errors import CheckpointNotFoundError

    roots = (os.fspath(a), os.fspath(b))
    for root in roots:
        if not os.path.isdir(root):
            raise CheckpointNotFoundError(f"not a checkpoint directory: {root}")
    started = time.perf_counter()
    runs = [VerificationRun(r, jobs or default_jobs(), progress) for r in roots]
    findings: list[Finding] = []
    try:
        for tag, run in zip("AB", runs, strict=True):
            run.execute(deep=False, use_manifest=True)
            for f in run.findings:
                if f.severity.value == "error":
                    findings.append(error(f.check, f"[{tag}] {f.message}", location=f.location,
                                          expected=f.expected, actual=f.actual))
        fps = [_fingerprints(run) for run in runs]
        compared = 0
        la, lb = runs[0].layout, runs[1].layout
        if la is None or lb is None:
            return Report(command="diff", target=f"{roots[0]} {roots[1]}", findings=tuple(findings))
        for fqn in sorted(set(la.tensors) | set(lb.tensors)):
            ta, tb = la.tensors.get(fqn), lb.tensors.get(fqn)
            if ta is None or tb is None:
                side = "A" if ta is None else "B"
                findings.append(error("diff-missing", f"tensor {fqn!r} is missing from {side}",
                                      location=Location(fqn=fqn)))
                continue
            if (ta.dtype, ta.shape) != (tb.dtype, tb.shape):
                findings.append(error("diff-tensor", f"{fqn!r} is {ta.dtype}{list(ta.shape)} in A and "
                                      f"{tb.dtype}{list(tb.shape)} in B", location=Location(fqn=fqn),
                                      expected=f"{ta.dtype}{list(ta.shape)}", actual=f"{tb.dtype}{list(tb.shape)}"))
                continue
            fa, fb = fps[0].get(fqn), fps[1].get(fqn)
            if fa is None or fb is None:
                findings.append(info("diff-tensor", f"{fqn!r} could not be read back from "
                                     f"{'A' if fa is None else 'B'}; not compared", location=Location(fqn=fqn)))
                continue
            compared += 1
            if fa == fb:
                continue
            stats = _difference(runs[0], runs[1], fqn)
            findings.append(error(
                "diff-tensor",
                f"{fqn!r} differs: {stats['differing']} of {stats['elements']} elements, max |a-b| "
                f"{stats['max_abs_diff']}, max ULP distance {stats['max_ulp']}, first at {stats['first_index']}",
                location=Location(fqn=fqn, global_index_first=tuple(stats["first_index"] or ())),
                expected=fa, actual=stats,
            ))
        findings.extend(_values(runs[0], runs[1]))
        coverage = (CheckCoverage(check="diff-tensor", count=compared, unit="tensors"),)
        for tag, run in zip("AB", runs, strict=True):
            findings.extend(error(f.check, f"[{tag}] {f.message}", location=f.location) for f in run.changed_files())
    except FileChangedError as exc:
        findings.append(error("file-changed", f"file changed during the comparison: {exc}",
                              location=Location(file=exc.path if isinstance(exc.path, str) else None)))
        coverage = ()
    finally:
        for run in runs:
            run.close()
    return Report(command="diff", target=f"{roots[0]} {roots[1]}", findings=tuple(cap_findings(findings)),
                  coverage=coverage, stats={"seconds": round(time.perf_counter() - started, 6)})


def _fingerprints(run: VerificationRun) -> dict[str, str]:
    """Logical fingerprint per tensor: the manifest's if it is valid and the bytes match, else rebuilt."""

    layout = run.layout
    if layout is None:
        return {}
    damaged = {f.location.fqn for f in run.findings if f.severity.value == "error" and f.location.fqn}
    out: dict[str, str] = {}
    manifest_ok = run.manifest is not None and not any(
        f.check.startswith("manifest") and f.severity.value == "error" for f in run.findings)
    todo = []
    for fqn in layout.tensors:
        if fqn in damaged:
            continue
        saved = run.manifest.tensors.get(fqn) if manifest_ok and run.manifest is not None else None
        if saved is not None and saved.fingerprint is not None:
            out[fqn] = saved.fingerprint
        else:
            todo.append(fqn)
    scans, _ = deep_check.scan_tensors(run.plans, run.opened, layout, run.map, only=set(todo))
    for fqn in todo:
        scan = scans.get(fqn)
        shape = layout.tensors[fqn].shape
        value = scan.value(shape) if scan is not None else None
        if value is not None:
            out[fqn] = value
        elif math.prod(shape) == 0:
            out[fqn] = "empty"
    return out


def load_global(run: VerificationRun, fqn: str) -> torch.Tensor:
    """Assemble tensor ``fqn`` from its chunks (memory: the whole tensor)."""
    import torch

    assert run.layout is not None
    tinfo = run.layout.tensors[fqn]
    from ckptverify.dcp.tensors import _torch_dtype

    out = torch.empty(tinfo.shape, dtype=_torch_dtype(tinfo.dtype))
    seen = set()
    for plan in run.plans:
        item = plan.item
        if item.fqn != fqn or item.chunk is None or item.chunk.offsets in seen or plan.header is None:
            continue
        seen.add(item.chunk.offsets)
        chunk = read_chunk(run.opened[item.file], item, plan.archive, plan.header)  # type: ignore[arg-type]
        view = out
        for dim, (o, n) in enumerate(zip(item.chunk.offsets, item.chunk.sizes, strict=True)):
            view = view.narrow(dim, o, n)
        view.copy_(chunk)
    return out


_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def _difference(run_a: VerificationRun, run_b: VerificationRun, fqn: str) -> dict[str, Any]:
    a, b = load_global(run_a, fqn), load_global(run_b, fqn)
    return tensor_difference(a, b)


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """Bitwise comparison of two same-shape, same-dtype tensors, with magnitudes where they make sense."""
    import torch

    if a.dtype == torch.bool:
        ia, ib = a.view(torch.uint8), b.view(torch.uint8)
    elif a.is_complex():
        ia, ib = torch.view_as_real(a).flatten(-2), torch.view_as_real(b).flatten(-2)
        ia = ia.contiguous().view(getattr(torch, _INT_OF_SIZE[ia.element_size()]))
        ib = ib.contiguous().view(getattr(torch, _INT_OF_SIZE[ib.element_size()]))
    else:
        ints = getattr(torch, _INT_OF_SIZE[a.element_size()])
        ia, ib = a.contiguous().view(ints), b.contiguous().view(ints)
    neq = (ia != ib).reshape(-1)
    if a.is_complex():
        neq = neq.view(-1, 2).any(dim=1)
    differing = int(neq.sum())
    first = None
    if differing:
        flat = int(torch.nonzero(neq)[0])
        first = [int(x) for x in torch.unravel_index(torch.tensor(flat), a.shape)] if a.dim() else []
    out: dict[str, Any] = {"elements": a.numel(), "differing": differing, "first_index": first,
                           "max_abs_diff": None, "max_ulp": None}
    if not differing:
        return out
    if a.is_floating_point() or a.is_complex():
        da = a.to(torch.complex128 if a.is_complex() else torch.float64)
        db = b.to(da.dtype)
        diff = (da - db).abs()
        finite = diff[torch.isfinite(diff)]
        out["max_abs_diff"] = float(finite.max()) if finite.numel() else float("nan")
        if not a.is_complex():
            out["max_ulp"] = _max_ulp(ia.reshape(-1).to(torch.int64), ib.reshape(-1).to(torch.int64),
                                      a.element_size())
    else:
        out["max_abs_diff"] = int((a.to(torch.int64) - b.to(torch.int64)).abs().max())
    return out


def _max_ulp(ia: torch.Tensor, ib: torch.Tensor, size: int) -> int:
    """Largest distance between the two bit patterns on the ordered line of floats of that width."""
    import torch

    sign = torch.tensor(1 << (8 * size - 1), dtype=torch.int64) if size < 8 else None

    def ordered(i: torch.Tensor) -> torch.Tensor:
        if size < 8:
            i = i & ((1 << (8 * size)) - 1)  # as unsigned
            neg = i >= sign
            return torch.where(neg, sign - i, i)  # -0 and +0 both map to 0
        return torch.where(i < 0, torch.iinfo(torch.int64).min - i, i)

    oa, ob = ordered(ia), ordered(ib)
    if size < 8:
        return int((oa - ob).abs().max())
    # 64-bit: the difference can exceed int64; compute it exactly in Python for the extreme pair.
    d = (oa.double() - ob.double()).abs()
    k = int(torch.argmax(d))
    return abs(int(oa[k]) - int(ob[k]))


def _values(run_a: VerificationRun, run_b: VerificationRun) -> list[Finding]:
    """Non-tensor values: equal when their pickled records are byte-identical."""
    out: list[Finding] = []

    def records(run: VerificationRun) -> dict[str, bytes]:
        got: dict[str, bytes] = {}
        for plan in run.plans:
            if plan.item.kind != "bytes" or plan.item.fqn in got:
                continue
            rec = _pkl(plan.archive)
            if rec is not None:
                got[plan.item.fqn] = run.opened[plan.item.file].pread(  # type: ignore[union-attr]
                    plan.item.offset + rec[0], rec[1])
        return got

    va, vb = records(run_a), records(run_b)
    for fqn in sorted(set(va) | set(vb)):
        if fqn not in va or fqn not in vb:
            out.append(error("diff-missing", f"value {fqn!r} is missing from {'A' if fqn not in va else 'B'}",
                             location=Location(fqn=fqn)))
        elif va[fqn] != vb[fqn]:
            out.append(error("diff-value", f"value {fqn!r} differs (its pickled bytes differ; not unpickled)",
                             location=Location(fqn=fqn)))
    return out


def _pkl(archive: Archive) -> tuple[int, int] | None:
    rec = archive.record("data.pkl")
    return None if rec is None else (rec.data_offset, rec.size)

