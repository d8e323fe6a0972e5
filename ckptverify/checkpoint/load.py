"""``load``: restore a :class:`~ckptverify.state.train_state.TrainState` from a checkpoint, verified first and
checked after. Every rank calls it.

1. **Verify** on the coordinator (verdict broadcast): a corrupt checkpoint is refused before anything is loaded.
2. **Load** via DCP with :class:`~ckptverify.dcp.loading.SafeLoadPlanner` (``weights_only=True``), **proving**
   each item in the read that loads it (:class:`~ckptverify.dcp.storage_reader.ProvingFileSystemReader`); a
   failure raises :class:`~ckptverify.errors.ProofFailedError` on every rank, nothing applied.
3. **Restore check**: restored tensors' fingerprints against the manifest, other fields' digests against those
   saved; a difference refuses the load and restores the state (``on_restore_mismatch="warn"`` reports instead).

With ``pick="latest-verified"``, the newest verifying checkpoint of a run directory is loaded (never a suspect or
quarantined one); a pick failing its proof is stamped failed and the next older one tried
(:func:`load_newest_proven`). A production ``Run`` uses :func:`load_picked` with its own rules.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptverify.errors import (
    CheckpointNotFoundError,
    CheckpointRefusedError,
    CkptVerifyError,
    CkptVerifyWarning,
    ProofFailedError,
    UsageError,
    dcp_failures,
    first_failure,
    reported_as_itself,
)
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info, warning
from ckptverify.options import VerifyOptions, failure_policy, verify_options
from ckptverify.safeparse import paths
from ckptverify.state.distributed import torch_group
from ckptverify.state.train_state import TrainState

if TYPE_CHECKING:
    from ckptverify.dcp.layout import Layout
    from ckptverify.ownfiles.manifest import Manifest
    from ckptverify.runs.latest import Latest

#: What ``load(..., pick=)`` can pick from a run directory.
PICKS = ("latest-verified",)
#: The ``when`` of ``load(..., verify=)``: a load needs the verdict before it reads (no ``"background"``).
LOAD_WHEN = ("inline", "off")
_log = logging.getLogger(__name__)


def _verify_on_coordinator(path: str, deep: bool, full: bool = True) -> None:
    """Verify on the coordinator and broadcast the verdict; ``full=False`` checks only that the save committed (cheap,
    never skipped)."""
    from ckptverify.audit.verify import verify_checkpoint
    from ckptverify.checks.commit import check_commit

    report = None

    def errors_of() -> list[dict[str, Any]]:
        nonlocal report
        report = verify_checkpoint(path, deep=deep) if full else \
            Report(command="load", target=path, findings=tuple(check_commit(path)))
        return [f.to_dict() for f in report.errors]

    errors = torch_group().share(errors_of)
    if errors:
        first = errors[0]
        where = ", ".join(f"{k}={v}" for k, v in first.get("location", {}).items())
        raise CheckpointRefusedError(
            f"refusing to load {path}: it fails verification with {len(errors)} error(s); first: "
            f"{first['check']} ({where}): {first['message']}",
            report,
        )


def _rebuild(obj: Any, tensor: Callable[[Any], Any], leaf: Callable[[Any], Any] = lambda o: o) -> Any:
    """``obj`` with its containers (dicts, lists, plain tuples) copied, each tensor as ``tensor(t)`` and every other
    leaf as ``leaf(o)``."""
    import torch

    if isinstance(obj, torch.Tensor):
        return tensor(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _rebuild(v, tensor, leaf)) for k, v in obj.items())  # dict, OrderedDict
    if isinstance(obj, list):
        return [_rebuild(v, tensor, leaf) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_rebuild(v, tensor, leaf) for v in obj)
    return leaf(obj)


def _load_template(sd: Any) -> Any:
    """The state dict DCP loads into: model and optimizer tensors are the live ones (in place, no second device copy;
    :func:`_restore_point` keeps a host copy), everything else a private copy, tensors detached on their device and
    DTensor layout (DCP replaces non-tensor values, and state dicts may share lists and tensors with live objects)."""
    return {k: _containers_copy(v) if k in ("model", "optim") else _rebuild(v, lambda t: t.detach().clone())
            for k, v in sd.items()}


def _in_place(t: Any) -> bool:
    """Whether ``t`` is loaded in place (plain tensor or DTensor); a wrapper subclass is privately copied instead."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return type(t.to_local()) in (torch.Tensor, torch.nn.Parameter)
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _containers_copy(obj: Any) -> Any:
    """``obj`` with containers copied, plain tensors shared, subclasses privately copied, other leaves shared."""
    return _rebuild(obj, lambda t: t if _in_place(t) else t.detach().clone())


def _to_host(t: Any) -> Any:
    """A host copy of ``t``'s values (pinned for CUDA so copying back is plain DMA; pageable if pinning is refused)."""
    import torch

    pin = t.device.type == "cuda"
    try:
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    except RuntimeError:
        if not pin:
            raise
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t)
    return out


def _live_tensors(obj: Any) -> list[Any]:
    """Every tensor leaf of ``obj`` once, as detached aliases (a DTensor as its local shard), in a fixed order."""
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[tuple[Any, ...], Any] = {}

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if not _in_place(o):
                return  # a private copy (see _containers_copy): set back by set_state_dict, not in place
            t = (o.to_local() if isinstance(o, DTensor) else o).detach()
            # By what it covers: state dicts hold several aliases of one tensor (tied weights, DTensor shards).
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            out.setdefault(key, t)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, list | tuple):
            for v in o:
                walk(v)

    walk(obj)
    return list(out.values())


def saved_world_size(layout: Layout | None) -> int | None:
    """The world size a TrainState checkpoint was saved with (from its rank-keyed entries)."""
    import re

    if layout is None:
        return None
    ranks = {int(m.group(1)) for name in (*layout.tensors, *layout.byte_values)
             if (m := re.match(r"^digests\.rank(\d+)\.", name))}
    return max(ranks) + 1 if ranks else None


def load(state: TrainState, path: str | os.PathLike[str], *, verify: VerifyOptions | str = "inline",
         check: bool = True, pick: str | None = None, on_restore_mismatch: str = "raise") -> Report:
    """Restore ``state`` from the checkpoint at ``path``; return the restore check's findings. All ranks call it.

    ``verify``: a :class:`~ckptverify.options.VerifyOptions` or ``"inline"`` (default) / ``"off"`` (an uncommitted
    save is still refused and every item still proven); ``deep=True`` also compares every tensor's fingerprint. A
    failing checkpoint is always refused. ``check=False`` skips the restore check. ``on_restore_mismatch``:
    ``"raise"`` (put the state back) or ``"warn"`` (keep it, report findings). ``pick="latest-verified"``: ``path`` is a
    run directory; the newest verifying checkpoint is loaded (:func:`pick_checkpoint`), named in ``stats["picked"]``,
    ``stats["step"]``, ``stats["skipped"]``; cannot combine with ``verify="off"``; a pick failing its proof is stamped
    failed and the next older loaded (``stats["refused_at_load"]``).

    All or nothing: if this raises, ``state`` is exactly as before. Raises
    :class:`~ckptverify.errors.CheckpointRefusedError` (fails verification, uncommitted, restore check fails, nothing
    to pick; :class:`~ckptverify.errors.ProofFailedError` for an item failing its proof),
    :class:`~ckptverify.errors.CkptVerifyError` (DCP cannot load it into ``state``), and
    :class:`~ckptverify.errors.UsageError` (a world size change that cannot be restored exactly).
    """
    options = verify_options("load", verify, when=LOAD_WHEN)
    if options.when == "off" and options.deep:
        raise UsageError("load: verify.deep needs verify.when='inline' (a deep verification is a verification)")
    failure_policy("on_restore_mismatch", on_restore_mismatch)
    root = os.fspath(path)
    if not isinstance(state, TrainState):
        raise UsageError(f"load() restores a TrainState, got {type(state).__name__}")
    if pick is not None:
        if pick not in PICKS:
            raise UsageError(f"pick must be one of {', '.join(map(repr, PICKS))}, got {pick!r}")
        if options.when == "off":
            raise UsageError("pick='latest-verified' verifies the checkpoints it picks from; it cannot be "
                             "combined with verify='off'")
        return load_newest_proven(state, root, check=check, deep=options.deep,
                                  on_restore_mismatch=on_restore_mismatch)
    if not paths.isdir(root):
        raise CheckpointNotFoundError(f"not a checkpoint directory: {root}")
    _verify_on_coordinator(root, options.deep, full=options.when == "inline")
    from ckptverify.runs.stamp import read_stamp

    # A stamp beside it would keep vouching for bytes that fail their proof: it is replaced by a failed one.
    stamped = torch_group().share(lambda: read_stamp(root) is not None)
    return _load_verified(state, root, check, on_restore_mismatch, stamp_on_failure=stamped)


def pick_checkpoint(run_dir: str | os.PathLike[str]) -> Latest:
    """The newest checkpoint under ``run_dir`` that verifies and ``load`` can restore (a DCP TrainState; weights-only
    exports skipped), decided on the coordinator and broadcast (``path=None`` if none, or if a newer one may be hidden
    from the walk; ``report`` on the coordinator only). :class:`~ckptverify.errors.CheckpointNotFoundError` if not a
    directory."""
    from ckptverify.runs.latest import Latest, latest_verified

    root = os.fspath(run_dir)
    found: Latest | None = None

    def pick() -> dict[str, Any]:
        nonlocal found
        try:
            # What load restores: a DCP checkpoint holding a TrainState (a weights-only export is passed over).
            # Stamps trusted: the load proves the bytes as it reads them, and moves on from a pick that fails.
            found = latest_verified(root, formats={"dcp"}, train_state=True, trust_stamps=True)
            return found.to_dict()
        except CheckpointNotFoundError as exc:
            return {"error": str(exc)}

    data = torch_group().share(pick)
    if "error" in data:
        raise CheckpointNotFoundError(data["error"])
    if found is not None:
        return found
    return Latest.from_dict(data)


def load_picked(state: TrainState, picked: Latest, *, check: bool = True, deep: bool = False,
                on_restore_mismatch: str = "raise") -> Report:
    """Load :func:`pick_checkpoint`'s pick as :func:`load` does; only its commit (and with ``deep`` every tensor) is
    rechecked, and every item proven. Raises :class:`~ckptverify.errors.CheckpointRefusedError` if nothing verified,
    :class:`~ckptverify.errors.ProofFailedError` if the pick fails its proof (then stamped failed, nothing else
    changed; ``state`` as before)."""
    skipped = "; ".join(f"{s['path']}: {s['state']} ({s['reason']})" for s in picked.skipped)
    if picked.path is None:
        hidden = any(s["state"] == "unseen" for s in picked.skipped)
        raise CheckpointRefusedError(
            ("nothing was loaded: a newer checkpoint may be hidden where the walk of the run directory could not "
             "see" if hidden else "no checkpoint verifies, nothing was loaded")
            + (f"; skipped: {skipped}" if skipped else ": there is no checkpoint"),
            picked.report)
    _log.info("loading %s (step %s), the newest checkpoint that verifies%s", picked.path, picked.step,
              f"; skipped: {skipped}" if skipped else "")
    _verify_on_coordinator(picked.path, deep, full=deep)
    report = _load_verified(state, picked.path, check, on_restore_mismatch, stamp_on_failure=True,
                            step=picked.step)
    note = info("load-picked", f"loaded {picked.path} (step {picked.step}), the newest checkpoint that verifies"
                + (f"; skipped {len(picked.skipped)} newer: {skipped}" if skipped else ""),
                location=Location(file=picked.path))
    return Report(command="load", target=report.target, findings=(note, *report.findings),
                  coverage=report.coverage,
                  stats={**report.stats, "picked": picked.path, "step": picked.step, "skipped": picked.skipped})


def load_newest_proven(state: TrainState, run_dir: str | os.PathLike[str], *, check: bool = True,
                       deep: bool = False, on_restore_mismatch: str = "raise") -> Report:
    """Load the newest checkpoint under ``run_dir`` that verifies *and* proves while loading: picks fail over to older
    ones, each refusal reported (``stats["refused_at_load"]``, a ``load-proof-failed`` warning). A failed restore check
    is not about bytes: it raises without moving on. :class:`~ckptverify.errors.CheckpointRefusedError` when nothing
    verifies or a failed pick could not be stamped (it would be picked again)."""
    root = os.fspath(run_dir)
    refused: list[dict[str, Any]] = []
    while True:
        picked = pick_checkpoint(root)
        if picked.path is not None and any(r["abs_path"] == picked.path for r in refused):
            raise CheckpointRefusedError(
                f"refusing {picked.path}: its bytes failed their proof while loading and its failed stamp could "
                f"not be written, so it would be picked again; nothing was loaded. {_refused_text(refused)}")
        try:
            report = load_picked(state, picked, check=check, deep=deep, on_restore_mismatch=on_restore_mismatch)
        except ProofFailedError as exc:  # only a pick proves: with no pick, load_picked refuses first
            refused.append({"abs_path": picked.path, "path": os.path.relpath(picked.path, root),
                            "step": picked.step, "check": exc.info.get("check"), "reason": str(exc)})
            _log.warning("%s failed its proof while loading; trying the next older checkpoint: %s", picked.path, exc)
            continue
        except CheckpointRefusedError as exc:
            if refused and picked.path is None:
                raise CheckpointRefusedError(f"{exc} ({_refused_text(refused)})", exc.report) from exc
            raise
        if not refused:
            return report
        notes = tuple(warning("load-proof-failed", f"{r['path']} (step {r['step']}) was picked but failed its proof "
                              f"while loading ({r['reason']}); it is stamped failed and the next older checkpoint "
                              "was tried", location=Location(file=r["path"])) for r in refused)
        return Report(command="load", target=report.target, findings=(*notes, *report.findings),
                      coverage=report.coverage,
                      stats={**report.stats, "refused_at_load": [{k: v for k, v in r.items() if k != "abs_path"}
                                                                 for r in refused]})


def _refused_text(refused: list[dict[str, Any]]) -> str:
    return "refused while loading: " + "; ".join(f"{r['path']}: {r['reason']}" for r in refused)


def _proof_failure(exc: BaseException) -> tuple[int, Any] | None:
    """``(rank, ProofFailedError)`` when DCP failed because an item failed its proof (the lowest such rank)."""
    if isinstance(exc, ProofFailedError):
        return 0, exc
    return next(((rank, inner) for rank, inner in sorted(dcp_failures(exc).items())
                 if isinstance(inner, ProofFailedError)), None)


def _proof_report(root: str, inner: Any, rank: int) -> Report:
    info = inner.info
    offsets = info.get("chunk_offsets")
    where = Location(file=info.get("file"), fqn=info.get("fqn"), rank=rank,
                     chunk_offsets=None if offsets is None else tuple(offsets),
                     byte_range=None if info.get("byte_range") is None else tuple(info["byte_range"]))
    finding = error(info.get("check", "load-proof"), f"while loading: {inner}", location=where,
                    expected=info.get("expected"), actual=info.get("actual"))
    return Report(command="load", target=root, findings=(finding,))


def _stamp_failed(root: str, report: Report, fingerprint: str | None, step: int | None) -> None:
    """On the coordinator: a failed stamp beside ``root`` so no later pick trusts an earlier pass. Only the stamp is
    written; the checkpoint is evidence, kept."""
    if not torch_group().coordinator:
        return
    from ckptverify.ownfiles.manifest import MANIFEST_FILE
    from ckptverify.runs.stamp import write_stamp

    verdict = Report(command="verify", target=root, findings=report.findings,
                     stats={"manifest": paths.exists(os.path.join(root, MANIFEST_FILE)), "checked_by": "load"})
    try:
        write_stamp(root, verdict, step=step, fingerprint=fingerprint)
    except OSError as exc:
        _log.warning("could not write the failed stamp of %s: %s", root, exc)


def _read_manifest_for_load(root: str) -> Manifest | None:
    """The manifest that proves the items (``None`` if none); an untrustworthy one refuses the load."""
    from ckptverify.errors import ManifestError
    from ckptverify.ownfiles.manifest import read_manifest

    try:
        return read_manifest(root)
    except ManifestError as exc:
        report = Report(command="load", target=root, findings=(error("manifest-invalid", str(exc)),))
        raise ProofFailedError(f"refusing to load {root}: its manifest cannot be trusted (manifest-invalid): {exc}; "
                               "nothing was changed", report, {"check": "manifest-invalid"}) from None


def _load_verified(state: TrainState, root: str, check: bool, on_restore_mismatch: str = "raise", *,
                   stamp_on_failure: bool = False, step: int | None = None) -> Report:
    """Load ``root`` into ``state``, proving each item, all or nothing, then the restore check (refused and undone on
    failure with ``"raise"``, a warning with ``"warn"``). ``stamp_on_failure``: stamp failed on a proof failure."""
    import torch.distributed.checkpoint as dcp

    from ckptverify.dcp.loading import SafeLoadPlanner
    from ckptverify.dcp.storage_reader import ProvingFileSystemReader
    from ckptverify.runs.stamp import files_fingerprint

    # Taken before reading: a file that changes while it is loaded leaves the failed stamp already stale.
    fingerprint = files_fingerprint(root) if stamp_on_failure and torch_group().coordinator else None
    manifest = _read_manifest_for_load(root)
    reader = ProvingFileSystemReader(root, manifest)
    # All or nothing without a second device copy (which would cap resumable state at a third of device memory):
    # load in place after a host copy (:func:`_restore_point`); any failure restores from it, including a fresh
    # optimizer's state initialized by getting a template.
    before = (state.saved_world_size, [not opt.state for opt in state.optimizers])
    refuse = check and on_restore_mismatch == "raise"
    undo = None
    try:
        layout = reader.layout()  # the metadata read safely and proven, once: what DCP loads below
        state.saved_world_size = saved_world_size(layout)
        template = _load_template(state.state_dict())
        _match_saved_cuda_kinds(template, layout, state.rank)
        undo = _restore_point(state)
        with warnings.catch_warnings():
            # Loading in a single process without a process group is intended here, not a mistake.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            try:
                dcp.load(template, storage_reader=reader, planner=SafeLoadPlanner())
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                # The reader's ProofFailedError, raised as itself or inside DCP's; a metadata file's DCP folds
                # into a message, so the reader keeps it.
                proof = _proof_failure(exc) or (None if reader.refused_metadata is None
                                                else (state.rank, reader.refused_metadata))
                if proof is None and reported_as_itself(exc):
                    raise
                if proof is not None:
                    report = _proof_report(root, proof[1], proof[0])
                    if stamp_on_failure:
                        _stamp_failed(root, report, fingerprint, step)
                    raise ProofFailedError(
                        f"refusing to load {root}: rank {proof[0]}: {proof[1]}; nothing was changed"
                        + ("; it is stamped failed" if stamp_on_failure else ""), report, proof[1].info) from None
                # DCP's CheckpointException is a BaseException, which `except Exception` would miss.
                raise CkptVerifyError(f"DCP could not load {root} into this state; nothing was changed: "
                                      f"{first_failure(exc)}") from exc
        state.load_state_dict(template)
        del template
    except BaseException:
        if undo is not None:
            undo(before)
        else:
            _reset(state, before)
        raise
    findings: list[Finding] = [warning("restore-inexact", w) for w in state.warnings]
    coverage: list[CheckCoverage] = [CheckCoverage(check=f"load-proof ({reader.proven['method']})",
                                                   count=int(reader.proven["items"]), unit="items")]
    if check:
        try:
            found, cov = restore_check(state, manifest)
            failed = _agree([f for f in found if f.severity.value == "error"])
        except BaseException:
            undo(before)
            raise
        findings.extend(found)
        coverage.extend(cov)
        if failed:
            first = failed[0]
            what = (f"the restore check of {root} failed ({len(failed)} error(s)); first: rank {first['rank']}: "
                    f"{first['check']} at {first['fqn']}: {first['message']}")
            if refuse:
                undo(before)
                raise CheckpointRefusedError(f"refusing {root}: {what}; the state was put back as it was",
                                             Report(command="load", target=root, findings=tuple(findings),
                                                    coverage=tuple(coverage)))
            warnings.warn(f"{what}; the state stays as loaded (on_restore_mismatch='warn')", CkptVerifyWarning,
                          stacklevel=3)
    return Report(command="load", target=root, findings=tuple(findings), coverage=tuple(coverage),
                  stats={"proven_items": reader.proven["items"], "proven_bytes": reader.proven["bytes"],
                         "proof": reader.proven["method"]})


def _agree(errors: list[Finding]) -> list[dict[str, Any]]:
    """The restore check's errors of every rank (each rank refuses alike, none is left in a collective)."""
    mine = [{"rank": f.location.rank, "check": f.check, "fqn": f.location.fqn, "message": f.message}
            for f in errors]
    return [e for part in torch_group().gathered(mine) for e in part]


def _restore_point(state: TrainState) -> Any:
    """A function putting ``state`` back as now: model and optimizer tensors from a host copy into the same live
    tensors, then their structure re-applied; other fields via :meth:`TrainState.fields_restore_point`."""
    import copy

    from torch.distributed.checkpoint.state_dict import set_state_dict

    fields = state.fields_restore_point()
    model_sd, optim_sd = state.model_optim_state()
    # The structure as it is now, tensors shared (they get their values back in place), everything else copied.
    kept = _containers_copy({"model": model_sd, "optim": optim_sd})
    live = _live_tensors(kept)
    kept = _rebuild(kept, lambda t: t, copy.deepcopy)  # tensors shared, every other leaf deep-copied
    host = [_to_host(t) for t in live]
    digests = dict(state.saved_digests)

    def undo(before: tuple[Any, list[bool]]) -> None:
        for t, h in zip(live, host, strict=True):
            t.copy_(h)
        if state.model is not None:
            set_state_dict(state.model, state.optimizers, model_state_dict=kept["model"],
                           optim_state_dict=kept["optim"])
        fields()
        state.saved_digests = digests
        _reset(state, before)

    return undo


def _reset(state: TrainState, before: tuple[int | None, list[bool]]) -> None:
    """Put back the saved world size and empty the optimizers that were fresh (getting a template initializes them)."""
    state.saved_world_size = before[0]
    for opt, was_fresh in zip(state.optimizers, before[1], strict=True):
        if was_fresh:
            opt.state.clear()


def _match_saved_cuda_kinds(template: dict[str, Any], layout: Layout | None, rank: int) -> None:
    """Make this rank's CUDA stream entries of ``template`` (and their digests) match the checkpoint's, so DCP neither
    refuses a missing key nor skips a saved one: a process may have initialised CUDA at save but not now, or the
    reverse (see :mod:`ckptverify.state.rng`)."""
    import torch

    from ckptverify.state.rng import rank_key

    me = rank_key(rank)
    mine = template.get("rng", {}).get(me)
    digests = template.get("digests", {}).get(me)
    if not isinstance(mine, dict) or layout is None:
        return
    mine.pop("cuda", None)
    mine.pop("cuda_device", None)
    prefix = f"rng.{me}."
    entry = layout.tensors.get(f"{prefix}cuda")
    if entry is not None:
        mine["cuda"] = torch.empty(tuple(entry.shape), dtype=torch.uint8)
    for name in layout.byte_values:
        if name.startswith(f"{prefix}cuda_device."):
            mine.setdefault("cuda_device", {})[name[len(f"{prefix}cuda_device."):]] = 0  # loaded over
    if isinstance(digests, dict):
        for field in [k for k in digests if k.startswith("rng.cuda")]:
            del digests[field]
        dprefix = f"digests.{me}."
        for name in layout.byte_values:
            if name.startswith(f"{dprefix}rng.cuda"):
                digests[name[len(dprefix):]] = ""  # loaded over


def restore_check(state: TrainState, manifest: Manifest | None) -> tuple[list[Finding], list[CheckCoverage]]:
    """Compare the restored state with what was saved: tensors by fingerprint against ``manifest`` (``None``: the
    checkpoint has none), other fields by digest."""
    from ckptverify.fingerprint import tensor_fingerprint

    findings: list[Finding] = []
    tensors_checked = 0
    if manifest is not None:
        import torch

        from ckptverify.dcp.loading import flat_names

        model_sd, optim_sd = state.model_optim_state()
        flat = flat_names({"model": model_sd, "optim": optim_sd} if state.optimizers else {"model": model_sd})
        for name in sorted(flat):  # same order on every rank: DTensor fingerprints are collective
            value = flat[name]
            if not isinstance(value, torch.Tensor):
                continue
            saved = manifest.tensors.get(name)
            live = tensor_fingerprint(value)
            tensors_checked += 1
            if saved is None:
                findings.append(error("restore-mismatch", f"restored tensor {name!r} is not in the checkpoint",
                                      location=Location(fqn=name)))
            elif saved.fingerprint is not None and live.value != saved.fingerprint:
                findings.append(error(
                    "restore-mismatch",
                    f"{name!r} after loading is not the tensor that was saved (category "
                    f"{'optimizer' if name.startswith('optim.') else 'parameters'})",
                    location=Location(fqn=name, rank=state.rank), expected=saved.fingerprint, actual=live.value,
                ))
    now = state.digests()
    skip_rng = bool(state.warnings)
    saved_digests = dict(state.saved_digests)
    device = "rng.cuda_device"
    if device in saved_digests and device in now and saved_digests[device] != now[device]:
        saved_digests[device] = now[device]  # a differing device is only a warning
        if not skip_rng:
            findings.append(warning(
                "restore-device", "this rank's CUDA random stream was saved on another device (index or UUID) than "
                "the one it uses now; the stream was restored into the device it uses now (checked as rng.cuda)",
                location=Location(fqn="rng.cuda", rank=state.rank)))
    for field, saved_digest in sorted(saved_digests.items()):
        if skip_rng and field.startswith("rng."):
            continue
        if now.get(field) != saved_digest:
            findings.append(error(
                "restore-mismatch",
                f"{field} after loading differs from what was saved on rank {state.rank}: its loader ignored or "
                "changed part of the saved state",
                location=Location(fqn=field, rank=state.rank), expected=saved_digest, actual=now.get(field),
            ))
    for field in sorted(set(now) - set(saved_digests)):
        findings.append(warning("restore-mismatch", f"{field} was not saved in this checkpoint; not restored",
                                location=Location(fqn=field, rank=state.rank)))
    coverage = [CheckCoverage(check="restore-tensors", count=tensors_checked, unit="tensors"),
                CheckCoverage(check="restore-fields", count=len(saved_digests), unit="fields")]
    return findings, coverage
