"""Save a DCP checkpoint and its manifest in one pass: ``save`` and ``async_save``. Every rank calls them, as DCP's.

A thin layer over DCP with :class:`~ckptverify.dcp.writer.HashingFileSystemWriter`: an ordinary DCP checkpoint,
with ``ckptverify.manifest.json`` written last by the coordinator (its presence marks a commit). The commit
protocol (:mod:`ckptverify.dcp.commit`) means a killed save never leaves something that verifies or loads, and a
concurrent save into the same directory fails. A save that does not commit raises
:class:`~ckptverify.errors.SaveFailedError` on every rank (DCP's ``CheckpointException`` is a ``BaseException``;
it is the ``__cause__``). ``verify=`` verifies and stamps after commit (``docs/verify-after-save.md``); with
``"background"`` on several nodes, the work is shared among nodes (:mod:`ckptverify.verifier.parts`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import TYPE_CHECKING, Any

from ckptverify.errors import (
    CkptVerifyWarning,
    SaveFailedError,
    UsageError,
    VerifyFailedError,
    dcp_failures,
    first_failure,
    reported_as_itself,
)
from ckptverify.options import VerifyOptions, verify_options
from ckptverify.ownfiles.manifest import DEFAULT_BLOCK_BYTES, Manifest
from ckptverify.state.distributed import Group, torch_group

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch.distributed as dist

    from ckptverify.dcp.writer import HashingFileSystemWriter
    from ckptverify.ownfiles.events import EventLog
    from ckptverify.verifier.background import AfterSave
    from ckptverify.verifier.verification import Verification

__all__ = ["async_save", "save"]

#: Keyword arguments forwarded to the storage writer (``FileSystemWriter``).
WRITER_KWARGS = frozenset({
    "single_file_per_rank", "sync_files", "per_thread_copy_ahead", "cache_staged_state_dict", "overwrite",
    "serialization_format", "_extensions",
})
#: Keyword arguments forwarded to ``dcp.save``.
SAVE_KWARGS = frozenset({"planner", "no_dist", "use_collectives"})
#: Keyword arguments forwarded to ``dcp.async_save`` (besides those of ``dcp.save``).
ASYNC_SAVE_KWARGS = SAVE_KWARGS | {"async_checkpointer_type", "async_stager"}


def _split_kwargs(kwargs: dict[str, Any], allowed: frozenset[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    writer_kw: dict[str, Any] = {}
    dcp_kw: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in WRITER_KWARGS:
            writer_kw[key] = value
        elif key in allowed:
            dcp_kw[key] = value
        elif key in ("storage_writer", "checkpoint_id"):
            raise UsageError(f"{key} cannot be given: ckptverify writes to `path` with its own storage writer")
        else:
            raise UsageError(
                f"unknown keyword argument {key!r}; accepted: {', '.join(sorted(WRITER_KWARGS | allowed))}"
            )
    return writer_kw, dcp_kw


def save_error(exc: BaseException, path: str | os.PathLike[str]) -> BaseException:
    """A failed DCP save as raised: a conflict or usage error as itself (the same type on every rank), anything else as
    :class:`SaveFailedError` naming the first failure."""
    failures = dcp_failures(exc)
    conflict = next((e for e in failures.values() if isinstance(e, SaveFailedError)), None)
    if conflict is not None:
        return SaveFailedError(str(conflict), failures)
    usage = next((e for e in failures.values() if isinstance(e, UsageError)), None)
    if usage is not None:
        return usage
    if reported_as_itself(exc):
        return exc
    return SaveFailedError(f"the save into {os.fspath(path)} did not commit; {first_failure(exc)}", failures)


def _run(fn: Any, writer: HashingFileSystemWriter, path: str | os.PathLike[str], *, upload: bool = False) -> Any:
    """``fn()``, a failure raised as :func:`save_error`'s. The lock is dropped after (normally at commit; here also when
    any rank failed), except while an async ``upload`` still writes."""
    try:
        out = fn()
    except BaseException as exc:
        writer._release_lock()
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise save_error(exc, path) from exc
    if not upload:
        writer._release_lock()
    return out


def _translated(future: Any, writer: HashingFileSystemWriter, path: str | os.PathLike[str],
                after_commit: Callable[[], object] | None = None) -> Any:
    """A future completing with ``future``, failures as :class:`SaveFailedError`; the lock is dropped when the upload
    ends; ``after_commit`` runs after commit, before completion."""
    from concurrent.futures import Future

    out: Future[Any] = Future()

    def done(f: Any) -> None:
        writer._release_lock()
        if f.cancelled():
            out.cancel()
            return
        exc = f.exception()
        if exc is None:
            if after_commit is not None:
                try:
                    after_commit()
                except Exception as failure:  # a verification that cannot start is said, the save stands
                    warnings.warn(f"the checkpoint {os.fspath(path)} was saved but its verification could not "
                                  f"start: {type(failure).__name__}: {failure}", CkptVerifyWarning,
                                  stacklevel=2)
            out.set_result(f.result())
            return
        error = save_error(exc, path)
        error.__cause__ = exc
        out.set_exception(error)

    future.add_done_callback(done)
    return out


def _plain(state: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """A :class:`~ckptverify.state.train_state.TrainState` as its state dict; a dict as is. Warns if the model holds
    accumulated gradients (not saved)."""
    import torch

    from ckptverify.state.train_state import TrainState, pending_gradients_warning

    model: Any = state.model if isinstance(state, TrainState) else None
    if isinstance(state, dict):
        # A module among the values, or a wrapper holding the model as torchtitan's ModelWrapper does.
        model = []
        for value in state.values():
            inner = value if isinstance(value, torch.nn.Module) else getattr(value, "model", None)
            inner = inner if isinstance(inner, list | tuple) else [inner]
            model += [m for m in inner if isinstance(m, torch.nn.Module)]
    text = pending_gradients_warning(model, f"the checkpoint {os.fspath(path)}") if model else None
    if text is not None:
        warnings.warn(text, CkptVerifyWarning, stacklevel=3)
    return state.state_dict() if isinstance(state, TrainState) else state


def _raise(verification: dict[str, Any] | None, prefix: str = "") -> None:
    """Raise :class:`VerifyFailedError` for a failed verification shared by the coordinator (``None``: none)."""
    from ckptverify.verifier.verification import Verification

    if verification is None:
        return
    failed = Verification.from_dict(verification)
    raise VerifyFailedError(prefix + failed.describe(), failed)


def _raise_earlier_failures(options: AfterSave, group: Group) -> None:
    """With ``on_failure="raise"``: raise on every rank an earlier save's verification failure (the coordinator's)
    before anything is written."""
    if options.verify.on_failure != "raise":
        return

    def first() -> dict[str, Any] | None:
        from ckptverify.verifier.background import default_verifier

        failures = default_verifier().take_failures()
        return failures[0].to_dict() if failures else None

    _raise(group.share(first), "an earlier checkpoint failed verification: ")


def _submit(options: AfterSave, path: str | os.PathLike[str], step: int | None, group: Group,
            hosts: list[str] | None) -> None:
    """Queue the committed checkpoint: on the coordinator (all, or, its plan written, the whole plus its node's part)
    and on each other node's lowest rank (its part)."""
    from ckptverify.verifier.background import default_verifier, submit_part

    if group.coordinator:
        from ckptverify.ownfiles.partsplan import share_out

        parts = hosts is not None and share_out(os.fspath(path), hosts, deep=options.verify.deep)
        default_verifier().submit(path, step=step, options=options, parts=parts)
    elif hosts is not None:
        submit_part(path, step, hosts, group.rank)


def _verify_committed(options: AfterSave, path: str | os.PathLike[str], step: int | None, group: Group,
                      hosts: list[str] | None) -> None:
    """After a synchronous save committed: queue it, or verify now (and with ``raise``, raise on every rank)."""
    if options.verify.when == "off":
        return
    if options.verify.when == "background":
        _submit(options, path, step, group, hosts)
        return
    from ckptverify.verifier.background import default_verifier

    result = default_verifier().verify_now(path, step=step, options=options) if group.coordinator else None
    if options.verify.on_failure == "raise":
        _raise(group.share(lambda: result.to_dict() if result is not None and result.verdict == "failed" else None))


def _after_upload(options: AfterSave, path: str | os.PathLike[str], step: int | None, group: Group,
                  hosts: list[str] | None) -> Callable[[], object] | None:
    """After an async upload committed: queue or verify before the future completes; a ``raise`` failure is raised by
    the next save."""
    from ckptverify.verifier.background import default_verifier

    if options.verify.when == "background" and (group.coordinator or hosts is not None):
        return lambda: _submit(options, path, step, group, hosts)
    if options.verify.when == "inline" and group.coordinator:
        return lambda: default_verifier().verify_now(path, step=step, options=options, deliver_later=True)
    return None


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    digest: str = "xxh3-128",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    fingerprint: bool = True,
    thread_count: int = 1,
    process_group: dist.ProcessGroup | None = None,
    verify: VerifyOptions | str = "off",
    on_verified: Callable[[Verification], None] | None = None,
    events: EventLog | str | os.PathLike[str] | None = None,
    **dcp_kwargs: Any,
) -> Manifest | None:
    """Save ``state_dict`` to the directory ``path`` with DCP, and write its manifest.

    Args:
        state_dict: as for :func:`torch.distributed.checkpoint.save`, or a
            :class:`~ckptverify.state.train_state.TrainState` (restore with :func:`ckptverify.checkpoint.load.load`).
        path: the checkpoint directory (created if missing).
        digest: ``"xxh3-128"`` (default, fast) or ``"sha256"`` (tamper evidence).
        block_bytes: block size each item is also digested in, to localize damage.
        fingerprint: record each tensor's logical fingerprint and NaN/Inf counts (on its device, before writing).
        thread_count: writer threads per rank, as for ``FileSystemWriter``.
        process_group: the group to save over (default: the default group, if initialized).
        verify: after commit, verify on the coordinator and stamp: a :class:`~ckptverify.options.VerifyOptions` or its
            ``when``: ``"background"`` (returns at once), ``"inline"`` or ``"off"`` (default: the save already digests
            every byte; :mod:`ckptverify.options`). ``on_failure="raise"`` raises
            :class:`~ckptverify.errors.VerifyFailedError` on every rank, from this save when inline, else from the
            next save called with ``"raise"``.
        on_verified: called with every :class:`~ckptverify.verifier.verification.Verification` (coordinator).
        events: an :class:`~ckptverify.ownfiles.events.EventLog` or run directory for ``events.jsonl``.
        **dcp_kwargs: ``FileSystemWriter`` options and ``dcp.save`` options (``planner``, ``no_dist``,
            ``use_collectives``).

    Returns:
        The manifest on the coordinator, ``None`` elsewhere.

    Raises:
        UsageError: bad digest, block size, thread count, keyword or ``verify``.
        SaveFailedError: another save into ``path`` is in progress (nothing written), or the save did not commit.
        VerifyFailedError: ``on_failure="raise"`` and a verification failed.
    """
    return _save("save", state_dict, path, digest=digest, block_bytes=block_bytes, fingerprint=fingerprint,
                 thread_count=thread_count, process_group=process_group, verify=verify, on_verified=on_verified,
                 events=events, dcp_kwargs=dcp_kwargs)


def async_save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    digest: str = "xxh3-128",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    fingerprint: bool = True,
    thread_count: int = 1,
    process_group: dist.ProcessGroup | None = None,
    verify: VerifyOptions | str = "off",
    on_verified: Callable[[Verification], None] | None = None,
    events: EventLog | str | os.PathLike[str] | None = None,
    **dcp_kwargs: Any,
) -> Any:
    """Like :func:`save`, through :func:`torch.distributed.checkpoint.async_save`; also accepts
    ``async_checkpointer_type`` and ``async_stager``.

    Returns DCP's future (or ``AsyncSaveResponse``); the upload future fails with
    :class:`~ckptverify.errors.SaveFailedError` instead of DCP's ``CheckpointException``. The manifest is written
    before the future completes (:func:`ckptverify.ownfiles.manifest.read_manifest`). ``verify``: queued
    (``"background"``) or done before the future completes (``"inline"``); a ``"raise"`` failure is raised on every rank
    by the next save called with ``"raise"``.
    """
    return _save("async_save", state_dict, path, digest=digest, block_bytes=block_bytes, fingerprint=fingerprint,
                 thread_count=thread_count, process_group=process_group, verify=verify, on_verified=on_verified,
                 events=events, dcp_kwargs=dcp_kwargs)


def _save(where: str, state_dict: Any, path: str | os.PathLike[str], *, digest: str, block_bytes: int,
          fingerprint: bool, thread_count: int, process_group: Any, verify: VerifyOptions | str, on_verified: Any,
          events: Any, dcp_kwargs: dict[str, Any]) -> Any:
    """:func:`save` (``where="save"``) or :func:`async_save`: checks, an earlier failure raised, the write, then the
    verification after commit."""
    import torch.distributed.checkpoint as dcp

    from ckptverify.dcp.writer import HashingFileSystemWriter
    from ckptverify.formats.rundir import step_of
    from ckptverify.state.train_state import TrainState
    from ckptverify.verifier.background import AfterSave, node_hosts

    options = AfterSave(verify=verify_options(where, verify), on_verified=on_verified, events=events)
    if not isinstance(path, (str, os.PathLike)) or "://" in os.fspath(path):
        raise UsageError(f"path must be a local directory path, got {path!r}")
    # The training step the checkpoint holds: a TrainState's step counter, else the one its directory's name carries.
    step = (int(state_dict.counters.step) if isinstance(state_dict, TrainState)
            else step_of(os.path.basename(os.path.normpath(os.fspath(path)))))
    state_dict = _plain(state_dict, path)
    writer_kw, save_kw = _split_kwargs(dcp_kwargs, ASYNC_SAVE_KWARGS if where == "async_save" else SAVE_KWARGS)
    group = Group() if save_kw.get("no_dist") else torch_group(process_group)
    _raise_earlier_failures(options, group)
    if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
        raise UsageError(f"thread_count must be a positive integer, got {thread_count!r}")
    writer = HashingFileSystemWriter(os.fspath(path), digest=digest, block_bytes=block_bytes, fingerprint=fingerprint,
                                     thread_count=thread_count, **writer_kw)  # checks digest and block size
    # Each rank's node when the background verification is shared among nodes (more than one).
    hosts = node_hosts(group) if options.verify.when == "background" else None
    with warnings.catch_warnings():
        # Saving in a single process without a process group is intended here, not a mistake.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        if where == "async_save":
            after_commit = _after_upload(options, path, step, group, hosts)
            response = _run(lambda: dcp.async_save(state_dict, storage_writer=writer, process_group=process_group,
                                                   **save_kw), writer, path, upload=True)
            upload = getattr(response, "upload_completion", None)
            if upload is not None:
                return dataclasses.replace(response, upload_completion=_translated(upload, writer, path, after_commit))
            return _translated(response, writer, path, after_commit)
        _run(lambda: dcp.save(state_dict, storage_writer=writer, process_group=process_group, **save_kw),
             writer, path)
    _verify_committed(options, path, step, group, hosts)
    return writer.manifest if writer.is_coordinator else None

