"""``load``: restore a :class:`~ckptverify.state.train_state.TrainState` from a checkpoint, verified first and
checked after.

1. **Verify** (on the coordinator; the verdict is broadcast): a corrupt checkpoint is refused with
   :class:`~ckptverify.errors.CheckpointRefusedError` naming what is wrong, before anything is loaded.
2. **Load** through DCP with :class:`~ckptverify.dcp.loading.SafeLoadPlanner` (non-tensor values are
   unpickled with ``weights_only=True``, never executed).
3. **Restore check**: every restored tensor's logical fingerprint is compared with the manifest's (taken
   from memory at save time), and every other field's digest with the digest saved beside it. A difference
   is a finding: state the loader silently ignored, or restored wrongly.

Given a run directory and ``pick="latest-verified"``, :func:`load` first picks the newest checkpoint that
verifies (:func:`~ckptverify.runs.latest.latest_verified`: a current stamp is trusted, any other checkpoint is
verified on the spot; a suspect checkpoint, saved after a replica mismatch, and one moved into the run's
``quarantine/`` are never picked), then loads that one and says which, and what it skipped, in its report. A
production ``Run`` resumes through the same two steps (:func:`pick_checkpoint`, :func:`load_picked`).

Every rank of the process group calls :func:`load`.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING, Any

from ckptverify.errors import (
    CheckpointNotFoundError,
    CheckpointRefusedError,
    CkptVerifyError,
    LoadFailedError,
    UsageError,
)
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, info, warning
from ckptverify.state.train_state import TrainState

if TYPE_CHECKING:
    from ckptverify.runs.latest import Latest

#: What ``load(..., pick=)`` can pick from a run directory.
PICKS = ("latest-verified",)
_log = logging.getLogger(__name__)


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _verify_on_coordinator(path: str, deep: bool, full: bool = True) -> None:
    """Verify on the coordinator and broadcast the verdict; with ``full=False`` only check that the save
    that wrote ``path`` committed (cheap, and never skipped)."""
    from ckptverify.checks.commit import check_commit
    from ckptverify.verify import verify_checkpoint

    dist = _dist()
    report = None
    if dist is None or dist.get_rank() == 0:
        if full:
            report = verify_checkpoint(path, deep=deep)
        else:
            report = Report(command="load", target=path, findings=tuple(check_commit(path)))
    if dist is not None:
        box = [None if report is None else [f.to_dict() for f in report.errors]]
        dist.broadcast_object_list(box, src=0)
        errors = box[0]
    else:
        errors = [f.to_dict() for f in report.errors]  # type: ignore[union-attr]
    if errors:
        first = errors[0]
        where = ", ".join(f"{k}={v}" for k, v in first.get("location", {}).items())
        raise CheckpointRefusedError(
            f"refusing to load {path}: it fails verification with {len(errors)} error(s); first: "
            f"{first['check']} ({where}): {first['message']}",
            report,
        )


def _private_copy(obj: Any) -> Any:
    """``obj`` with every container and tensor copied (tensors detached, same device, same DTensor layout),
    other leaves shared: DCP loads into the copy, never into the live state."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _private_copy(v)) for k, v in obj.items())  # dict, OrderedDict
    if isinstance(obj, list):
        return [_private_copy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_private_copy(v) for v in obj)
    return obj


def _first_line(exc: BaseException) -> str:
    """The innermost failure DCP reported (its ``CheckpointException`` text is a traceback per rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(exc).__name__}: {exc}"


def saved_world_size(path: str) -> int | None:
    """The world size a TrainState checkpoint was saved with (from its rank-keyed entries), read safely."""
    import re

    from ckptverify.dcp.metadata import read_layout

    layout, _ = read_layout(path)
    if layout is None:
        return None
    ranks = {int(m.group(1)) for name in (*layout.tensors, *layout.byte_values)
             if (m := re.match(r"^digests\.rank(\d+)\.", name))}
    return max(ranks) + 1 if ranks else None


def load(state: TrainState, path: str | os.PathLike[str], *, verify: bool = True, check: bool = True,
         deep_verify: bool = False, pick: str | None = None) -> Report:
    """Restore ``state`` from the checkpoint at ``path``; return the restore check's findings.

    ``verify=False`` skips the verification (explicit opt-out; a directory whose save did not commit is
    still refused); ``check=False`` skips the restore check.

    ``pick="latest-verified"``: ``path`` is a run directory; the newest checkpoint under it that verifies is
    loaded (see :func:`pick_checkpoint`), and the report names it (``stats["picked"]``, ``stats["step"]``) and
    every newer one skipped, with why (``stats["skipped"]``). When none verifies,
    :class:`~ckptverify.errors.CheckpointRefusedError` lists what was skipped. Picking verifies, so
    ``verify=False`` cannot be combined with it; ``deep_verify`` verifies the pick deeply before loading.

    All or nothing: if this raises, ``state`` (parameters, optimizer, every random stream, counters,
    schedulers, scaler, data position, extras) is exactly what it was before the call. Raises
    :class:`~ckptverify.errors.CheckpointRefusedError` for a checkpoint that fails verification or whose save
    did not commit, :class:`~ckptverify.errors.LoadFailedError` when DCP cannot load it into ``state`` or a
    saved field does not fit, and :class:`~ckptverify.state.rng.WorldSizeChangedError` /
    :class:`~ckptverify.state.sampler.CannotReshardError` when the world size changed in a way that cannot be
    restored exactly (and re-seeding was not allowed). Every one is an ``Exception``.
    """
    root = os.fspath(path)
    if not isinstance(state, TrainState):
        raise UsageError(f"load() restores a TrainState, got {type(state).__name__}")
    if pick is not None:
        if pick not in PICKS:
            raise UsageError(f"pick must be one of {', '.join(map(repr, PICKS))}, got {pick!r}")
        if not verify:
            raise UsageError("pick='latest-verified' verifies the checkpoints it picks from; it cannot be "
                             "combined with verify=False")
        return load_picked(state, pick_checkpoint(root), check=check, deep_verify=deep_verify)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"not a checkpoint directory: {root}")
    _verify_on_coordinator(root, deep_verify, full=verify)
    return _load_verified(state, root, check)


def pick_checkpoint(run_dir: str | os.PathLike[str]) -> Latest:
    """The newest checkpoint under ``run_dir`` that verifies and that load can restore (a DCP checkpoint holding
    a TrainState's keys: a newer weights-only DCP export is skipped, with why), decided on the coordinator and
    broadcast, so that every rank gets the same pick (``path=None`` when none verifies, or when a newer one may
    be hidden where the walk could not see; ``report`` only on the coordinator).

    Raises :class:`~ckptverify.errors.CheckpointNotFoundError` when ``run_dir`` is not a directory.
    """
    from ckptverify.runs.latest import Latest, latest_verified

    root = os.fspath(run_dir)
    dist = _dist()
    found: Latest | None = None
    box: list[Any] = [None]
    if dist is None or dist.get_rank() == 0:
        try:
            # What load restores: a DCP checkpoint holding a TrainState (a weights-only export is passed over).
            found = latest_verified(root, formats={"dcp"}, train_state=True)
            box[0] = found.to_dict()
        except CheckpointNotFoundError as exc:
            box[0] = {"error": str(exc)}
    if dist is not None and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    data = box[0]
    if "error" in data:
        raise CheckpointNotFoundError(data["error"])
    if found is not None:
        return found
    return Latest(path=data["path"], step=data["step"], skipped=list(data["skipped"]),
                  quarantined=list(data.get("quarantined", [])), unseen=list(data.get("unseen", [])))


def load_picked(state: TrainState, picked: Latest, *, check: bool = True, deep_verify: bool = False) -> Report:
    """Load the checkpoint :func:`pick_checkpoint` picked into ``state``, as :func:`load` does; the pick
    verified it already, so only its commit is checked again (and, with ``deep_verify``, every tensor).
    Raises :class:`~ckptverify.errors.CheckpointRefusedError` naming what was skipped when nothing verified."""
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
    _verify_on_coordinator(picked.path, deep_verify, full=deep_verify)
    report = _load_verified(state, picked.path, check)
    note = info("load-picked", f"loaded {picked.path} (step {picked.step}), the newest checkpoint that verifies"
                + (f"; skipped {len(picked.skipped)} newer: {skipped}" if skipped else ""),
                location=Location(file=picked.path))
    return Report(command="load", target=report.target, findings=(note, *report.findings),
                  coverage=report.coverage,
                  stats={**report.stats, "picked": picked.path, "step": picked.step, "skipped": picked.skipped})


def _load_verified(state: TrainState, root: str, check: bool) -> Report:
    """Load ``root`` (verified already) into ``state``, all or nothing, then run the restore check."""
    import torch.distributed.checkpoint as dcp

    from ckptverify.dcp.loading import SafeLoadPlanner
    from ckptverify.dcp.storage_reader import SafeFileSystemReader

    # All or nothing: DCP loads into a private copy of the state (twice the model and optimizer memory
    # while this runs), the copy is checked field by field, and only then applied. On any refusal the
    # state is put back as it was: getting a template initializes a fresh optimizer's state, undone here.
    before = (state.saved_world_size, [not opt.state for opt in state.optimizers])
    try:
        state.saved_world_size = saved_world_size(root)
        template = _private_copy(state.state_dict())
        with warnings.catch_warnings():
            # Loading in a single process without a process group is intended here, not a mistake.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            try:
                dcp.load(template, storage_reader=SafeFileSystemReader(root), planner=SafeLoadPlanner())
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit, CkptVerifyError)):
                    raise
                # DCP's CheckpointException is a BaseException, which `except Exception` would miss.
                raise LoadFailedError(f"DCP could not load {root} into this state; nothing was changed: "
                                      f"{_first_line(exc)}") from exc
        state.load_state_dict(template)
    except BaseException:
        state.saved_world_size = before[0]
        for opt, was_fresh in zip(state.optimizers, before[1], strict=True):
            if was_fresh:
                opt.state.clear()
        raise
    findings: list[Finding] = [warning("restore-inexact", w) for w in state.warnings]
    coverage: list[CheckCoverage] = []
    if check:
        found, cov = restore_check(state, root)
        findings.extend(found)
        coverage.extend(cov)
    return Report(command="load", target=root, findings=tuple(findings), coverage=tuple(coverage))


def restore_check(state: TrainState, root: str) -> tuple[list[Finding], list[CheckCoverage]]:
    """Compare the restored state with what was saved: tensors by logical fingerprint against the manifest,
    other fields by digest against the digests saved beside them."""
    from ckptverify.fingerprint import tensor_fingerprint
    from ckptverify.manifest import ManifestError, read_manifest

    findings: list[Finding] = []
    try:
        manifest = read_manifest(root)
    except ManifestError as exc:
        manifest = None
        findings.append(error("manifest-invalid", f"cannot check restored tensors: {exc}"))
    tensors_checked = 0
    if manifest is not None:
        import torch

        from ckptverify.dcp.loading import flat_names

        model_sd, optim_sd = state._model_optim()
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
    for field, saved_digest in sorted(state.saved_digests.items()):
        if skip_rng and field.startswith("rng."):
            continue
        if now.get(field) != saved_digest:
            findings.append(error(
                "restore-mismatch",
                f"{field} after loading differs from what was saved on rank {state.rank}: its loader ignored or "
                "changed part of the saved state",
                location=Location(fqn=field, rank=state.rank), expected=saved_digest, actual=now.get(field),
            ))
    for field in sorted(set(now) - set(state.saved_digests)):
        findings.append(warning("restore-mismatch", f"{field} was not saved in this checkpoint; not restored",
                                location=Location(fqn=field, rank=state.rank)))
    coverage = [CheckCoverage(check="restore-tensors", count=tensors_checked, unit="tensors"),
                CheckCoverage(check="restore-fields", count=len(state.saved_digests), unit="fields")]
    return findings, coverage
