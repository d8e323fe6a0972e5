"""``load``: restore a :class:`~ckptverify.state.train_state.TrainState` from a checkpoint, verified first and
checked after.

1. **Verify** (on the coordinator; the verdict is broadcast): a corrupt checkpoint is refused with
   :class:`~ckptverify.errors.CheckpointRefusedError` naming what is wrong, before anything is loaded.
2. **Load** through DCP with :class:`~ckptverify.dcp.loading.SafeLoadPlanner` (non-tensor values are
   unpickled with ``weights_only=True``, never executed).
3. **Restore check**: every restored tensor's logical fingerprint is compared with the manifest's (taken
   from memory at save time), and every other field's digest with the digest saved beside it. A difference
   is a finding: state the loader silently ignored, or restored wrongly.

Every rank of the process group calls :func:`load`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ckptverify.errors import CheckpointNotFoundError, CheckpointRefusedError, UsageError
from ckptverify.findings import CheckCoverage, Finding, Location, Report, error, warning
from ckptverify.state.train_state import TrainState


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _verify_on_coordinator(path: str, deep: bool) -> None:
    from ckptverify.verify import verify_checkpoint

    dist = _dist()
    report = None
    if dist is None or dist.get_rank() == 0:
        report = verify_checkpoint(path, deep=deep)
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
         deep_verify: bool = False) -> Report:
    """Restore ``state`` from the checkpoint at ``path``; return the restore check's findings.

    ``verify=False`` skips the verification (explicit opt-out); ``check=False`` skips the restore check.
    Raises :class:`~ckptverify.errors.CheckpointRefusedError` for a checkpoint that fails verification, and
    :class:`~ckptverify.state.rng.WorldSizeChangedError` /
    :class:`~ckptverify.state.sampler.CannotReshardError` when the world size changed in a way that cannot be
    restored exactly (and re-seeding was not allowed).
    """
    import torch.distributed.checkpoint as dcp

    from ckptverify.dcp.loading import SafeLoadPlanner
    from ckptverify.dcp.storage_reader import SafeFileSystemReader

    root = os.fspath(path)
    if not isinstance(state, TrainState):
        raise UsageError(f"load() restores a TrainState, got {type(state).__name__}")
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"not a checkpoint directory: {root}")
    if verify:
        _verify_on_coordinator(root, deep_verify)
    state.saved_world_size = saved_world_size(root)
    template = state.state_dict()
    with warnings.catch_warnings():
        # Loading in a single process without a process group is intended here, not a mistake.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(template, storage_reader=SafeFileSystemReader(root), planner=SafeLoadPlanner())
    state.load_state_dict(template)
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
