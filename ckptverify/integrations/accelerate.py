"""Hugging Face accelerate: ``save_state`` that verifies what it saved, ``load_state`` that verifies before loading.

::

    from ckptverify.integrations import accelerate as ckv

    ckv.save_state(accelerator, "ckpt/step-100")   # instead of accelerator.save_state("ckpt/step-100")
    ckv.load_state(accelerator, "ckpt/step-100")   # refused (nothing loaded) if it fails verification

Helpers, not hooks: accelerate's save pre-hook runs before the files are written, and its load pre-hook after
FSDP state is already loaded. :func:`save_state` verifies once every process wrote its files (DCP sub-folders in
full); :func:`load_state` refuses a failing folder before accelerate reads it, and without a folder under
``automatic_checkpoint_naming`` loads the newest ``checkpoint_N`` that verifies. Background mode and failure
policy work as in :mod:`ckptverify.integrations._core`; call :func:`wait_for_verifications` at the end.
``events.jsonl`` goes to ``accelerator.project_dir`` (never into ``checkpoints/``, whose entries accelerate reads
as checkpoints), else beside the folder. ``model.safetensors`` has no checksum: ``fingerprint="auto"`` writes a
manifest after each save.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptverify.errors import CheckpointRefusedError, UsageError
from ckptverify.integrations._core import Fingerprint, Verifier, integration_verify, warn_if_accumulating
from ckptverify.options import VerifyOptions, verify_options
from ckptverify.state.distributed import Group, torch_group
from ckptverify.verifier.verification import Verification

__all__ = ["load_state", "save_state", "wait_for_verifications"]

_LAST_NUMBER = re.compile(r"([0-9]+)(?=[^/]*$)")


def save_state(accelerator: Any, output_dir: str | os.PathLike[str] | None = None, *,
               verify: VerifyOptions | str = "inline", fingerprint: Fingerprint = "auto", jobs: int | None = None,
               events_dir: str | os.PathLike[str] | None = None, step: int | None = None,
               **save_kwargs: Any) -> Verification:
    """``accelerator.save_state(output_dir, **save_kwargs)``, then verify, stamp and log the folder it wrote. Every
    process calls it.

    ``step``: recorded in the stamp (default: the number ending the folder's name). ``verify``: a
    :class:`~ckptverify.options.VerifyOptions` or ``"inline"`` (default) / ``"background"`` (pending verdict; state kept
    on the accelerator; call :func:`wait_for_verifications` at the end). Returns the verdict on every process; raises
    :class:`~ckptverify.errors.CheckpointRefusedError` on every process for a failure (with ``background``, one found
    since the last call) when ``on_failure="raise"``.
    """
    verifier = Verifier(verify=integration_verify("save_state", verify), fingerprint=fingerprint, jobs=jobs,
                        events_dir=_events_dir(accelerator, events_dir))
    if verifier.background:
        verifier = _background_verifier(accelerator, verifier)
    warn_if_accumulating(list(getattr(accelerator, "_models", []) or []) or None,
                         "accelerator.save_state" if output_dir is None else output_dir)
    location = accelerator.save_state(None if output_dir is None else os.fspath(output_dir), **save_kwargs)
    path = os.fspath(location)
    if step is None:
        from ckptverify.formats.rundir import step_of

        step = step_of(os.path.basename(os.path.normpath(path)))
    return verifier.after_save(path, step=step, group=_group(accelerator))


def wait_for_verifications(accelerator: Any, *, timeout: float | None = None) -> list[Verification]:
    """Wait for this accelerator's background verifications, up to ``timeout`` (default
    ``CKPTVERIFY_VERIFY_EXIT_TIMEOUT``, 600 s; the rest are ``checkpoint-cut-short``). Every process calls it.
    Returns the verdicts arrived since the last call; raises :class:`~ckptverify.errors.CheckpointRefusedError` for an
    unraised failure with ``on_failure="raise"``."""
    verifier = getattr(accelerator, _VERIFIER, None)
    if verifier is None:
        return []
    return verifier.wait(group=_group(accelerator), timeout=timeout)


def load_state(accelerator: Any, input_dir: str | os.PathLike[str] | None = None, *,
               verify: VerifyOptions | str = "inline", jobs: int | None = None,
               events_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None,
               **load_model_func_kwargs: Any) -> Verification:
    """Verify the folder, then ``accelerator.load_state(folder, load_kwargs, **load_model_func_kwargs)``. Every process
    calls it. ``verify``: ``"inline"`` only (``deep=True`` also rebuilds tensors). Returns the loaded folder's verdict;
    raises :class:`~ckptverify.errors.CheckpointRefusedError` on every process, before loading, if it (or, without
    ``input_dir``, every ``checkpoint_N``) fails."""
    options = verify_options("load_state", verify, when=("inline",))
    verifier = Verifier(verify=options, jobs=jobs, events_dir=_events_dir(accelerator, events_dir))
    group = _group(accelerator)
    if input_dir is not None:
        verdict = verifier.before_resume(os.fspath(input_dir), group=group)
    elif not accelerator.project_configuration.automatic_checkpoint_naming:
        raise UsageError("load_state needs input_dir unless the Accelerator's ProjectConfiguration has "
                         "automatic_checkpoint_naming=True")
    else:
        folder = os.path.join(accelerator.project_dir, "checkpoints")
        found = verifier.newest_numbered(folder, _LAST_NUMBER.search, group=group)
        if found is None:
            raise CheckpointRefusedError(f"no checkpoint to load under {folder}")
        verdict = found
    accelerator.load_state(verdict.path, load_kwargs=load_kwargs, **load_model_func_kwargs)
    return verdict


_VERIFIER = "_ckptverify_background_verifier"


def _background_verifier(accelerator: Any, fresh: Verifier) -> Verifier:
    """The verifier kept on ``accelerator`` for background saves (``fresh`` the first time), with ``fresh``'s settings.
    """
    kept = getattr(accelerator, _VERIFIER, None)
    if kept is None:
        setattr(accelerator, _VERIFIER, fresh)
        return fresh
    vars(kept).update((k, v) for k, v in vars(fresh).items() if not k.startswith("_"))  # its queue stays
    return kept


def _events_dir(accelerator: Any, events_dir: str | os.PathLike[str] | None) -> str | os.PathLike[str] | None:
    return events_dir if events_dir is not None else accelerator.project_dir


def _group(accelerator: Any) -> Group:
    if accelerator.num_processes == 1:
        return Group()

    def broadcast(obj: Any) -> Any:
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj], from_process=0)[0]

    return Group(coordinator=accelerator.is_main_process, broadcast=broadcast, barrier=accelerator.wait_for_everyone,
                 rank=accelerator.process_index, gather=torch_group().gather)
