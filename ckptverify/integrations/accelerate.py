"""Hugging Face accelerate: ``save_state`` that verifies what it saved, ``load_state`` that verifies before loading.

::

    from ckptverify.integrations import accelerate as ckv

    ckv.save_state(accelerator, "ckpt/step-100")   # instead of accelerator.save_state("ckpt/step-100")
    ckv.load_state(accelerator, "ckpt/step-100")   # refused (nothing loaded) if it fails verification

**Why helpers, not hooks.** ``Accelerator.register_save_state_pre_hook`` runs *before* the files are written,
and ``register_load_state_pre_hook`` runs after an FSDP model and optimizer have already been loaded; neither
runs at the right moment. These two functions call the ``Accelerator``'s own methods, with the check after the
save (once every process has written its ``random_states_R.pkl``) and before the load.

- :func:`save_state`: ``accelerator.save_state``, then every process waits for the others, the main process
  verifies the folder (DCP folders inside it, FSDP ``SHARDED_STATE_DICT`` saves, are verified in full, part by
  part), writes the stamp inside it and appends to ``events.jsonl``; the verdict is shared, so with
  ``on_failure="raise"`` every process raises.
- :func:`load_state`: a given folder is verified and refused (every process raises
  :class:`~ckptverify.errors.CheckpointRefusedError`) before ``accelerator.load_state`` reads it. Without a
  folder, under ``automatic_checkpoint_naming``, the newest ``checkpoints/checkpoint_N`` that verifies is
  loaded (newer ones that fail are skipped, each a warning and an event) where accelerate would take the newest
  whatever its state.

With ``verify="background"`` the main process queues the folder for the background verifier and :func:`save_state`
returns at once (a pending verdict); the manifest (when needed), the stamp and the event are written when its
verification finishes. Call :func:`wait_for_verifications` at the end of training, on every process: it waits for
the pending ones (bounded) and returns their verdicts. A failure is a warning and a ``checkpoint-failed`` event
when it is found; with ``on_failure="raise"`` every process raises at the next :func:`save_state` (or at
:func:`wait_for_verifications`). A folder deleted (``total_limit`` rotation) before its turn is a
``checkpoint-deleted`` event, not a failure; :func:`load_state` of a folder still queued waits for it.

``events.jsonl`` goes to ``accelerator.project_dir`` when there is one (never into ``checkpoints/``, whose
every entry accelerate reads as a checkpoint), else beside the checkpoint folder. Weights saved as
``model.safetensors`` carry no checksum: with ``fingerprint="auto"`` (the default) the folder gets a manifest
right after the save, which every later verification (and :func:`load_state`) checks them against;
``optimizer.bin``, ``scheduler.bin`` and ``random_states_R.pkl`` are ``torch.save`` archives whose every
record's CRC-32 is checked.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptverify.errors import CheckpointRefusedError, UsageError
from ckptverify.integrations._core import (
    Fingerprint,
    Group,
    Verifier,
    VerifyOptions,
    integration_verify,
    numbered_folders,
    plain_folder,
    torch_gather,
    warn_if_accumulating,
)
from ckptverify.options import verify_options
from ckptverify.verifier.verification import Verification

__all__ = ["load_state", "save_state", "wait_for_verifications"]

_LAST_NUMBER = re.compile(r"([0-9]+)(?=[^/]*$)")


def save_state(accelerator: Any, output_dir: str | os.PathLike[str] | None = None, *,
               verify: VerifyOptions | str = "inline", fingerprint: Fingerprint = "auto", jobs: int | None = None,
               events_dir: str | os.PathLike[str] | None = None, step: int | None = None,
               **save_kwargs: Any) -> Verification:
    """``accelerator.save_state(output_dir, **save_kwargs)``, then verify, stamp and log the folder it wrote.

    Every process calls it, as it calls ``save_state``. ``step`` is recorded in the stamp (default: the number
    the folder's name ends with). Returns the verdict (its ``path`` is where ``save_state`` wrote) on every
    process; raises :class:`~ckptverify.errors.CheckpointRefusedError` on every process when the folder fails
    and ``verify=VerifyOptions(on_failure="raise")``. ``verify``: a :class:`~ckptverify.options.VerifyOptions`
    or its ``when`` (``"inline"``, the default, or ``"background"``); ``deep``: as for
    :class:`~ckptverify.integrations.Verifier`. Every other keyword goes to ``accelerator.save_state``.

    ``verify="background"``: the verdict returned is pending; the verification runs in the background (see the
    module docstring), and a failure found since the last call is raised here, on every process, with
    ``on_failure="raise"``. The accelerator keeps the background verifier's state between calls; call
    :func:`wait_for_verifications` at the end.
    """
    options = integration_verify("save_state", verify)
    settings = {"verify": options, "fingerprint": fingerprint, "jobs": jobs,
                "events_dir": _events_dir(accelerator, events_dir)}
    background = options.when == "background"
    verifier = _background_verifier(accelerator, settings) if background else Verifier(**settings)
    warn_if_accumulating(list(getattr(accelerator, "_models", []) or []) or None,
                         "accelerator.save_state" if output_dir is None else output_dir)
    location = accelerator.save_state(None if output_dir is None else os.fspath(output_dir), **save_kwargs)
    path = os.fspath(location)
    if step is None:
        from ckptverify.formats.rundir import step_of

        step = step_of(os.path.basename(os.path.normpath(path)))
    return verifier.after_save(path, step=step, group=_group(accelerator))


def wait_for_verifications(accelerator: Any, *, timeout: float | None = None) -> list[Verification]:
    """Wait for the background verifications of this accelerator's :func:`save_state` calls, up to ``timeout``
    seconds (default: ``CKPTVERIFY_VERIFY_EXIT_TIMEOUT``, 600; those cut short are a warning and a
    ``checkpoint-cut-short`` event each). Every process calls it. Returns the verdicts that arrived since the
    last call, on every process; raises :class:`~ckptverify.errors.CheckpointRefusedError` on every process for
    a failure not raised yet when it was saved with ``VerifyOptions(on_failure="raise")``."""
    verifier = getattr(accelerator, _VERIFIER, None)
    if verifier is None:
        return []
    return verifier.wait(group=_group(accelerator), timeout=timeout)


def load_state(accelerator: Any, input_dir: str | os.PathLike[str] | None = None, *,
               verify: VerifyOptions | str = "inline", jobs: int | None = None,
               events_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None,
               **load_model_func_kwargs: Any) -> Verification:
    """Verify the folder, then ``accelerator.load_state(folder, load_kwargs, **load_model_func_kwargs)``; see the
    module docstring.

    Every process calls it. ``verify``: as for :func:`ckptverify.load` (``when`` ``"inline"`` only: every folder
    loaded is verified first; ``VerifyOptions(deep=True)`` also rebuilds every tensor). Returns the verdict of
    the folder loaded; raises :class:`~ckptverify.errors.CheckpointRefusedError` on every process, before
    anything is loaded, when the folder (or, without ``input_dir``, every ``checkpoint_N``) fails verification.
    """
    options = verify_options("load_state", verify, when=("inline",))
    verifier = Verifier(verify=options, jobs=jobs, events_dir=_events_dir(accelerator, events_dir))
    group = _group(accelerator)
    if input_dir is not None:
        verdict = verifier.before_resume(os.fspath(input_dir), group=group)
    else:
        verdict = _newest_verified(accelerator, verifier, group)
    accelerator.load_state(verdict.path, load_kwargs=load_kwargs, **load_model_func_kwargs)
    return verdict


_VERIFIER = "_ckptverify_background_verifier"


def _background_verifier(accelerator: Any, settings: dict[str, Any]) -> Verifier:
    """The verifier kept on ``accelerator`` for its background saves (what is pending, failures not raised yet),
    with this call's settings."""
    verifier = getattr(accelerator, _VERIFIER, None)
    fresh = Verifier(**settings)  # validates the settings
    if verifier is None:
        setattr(accelerator, _VERIFIER, fresh)
        return fresh
    verifier.verify, verifier.on_failure, verifier.fingerprint = fresh.verify, fresh.on_failure, fresh.fingerprint
    verifier.deep, verifier.jobs, verifier.events_dir = fresh.deep, fresh.jobs, fresh.events_dir
    return verifier


def _newest_verified(accelerator: Any, verifier: Verifier, group: Group) -> Verification:
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise UsageError("load_state needs input_dir unless the Accelerator's ProjectConfiguration has "
                         "automatic_checkpoint_naming=True")
    folder = os.path.join(accelerator.project_dir, "checkpoints")
    names = [n for _, n in numbered_folders(folder, _LAST_NUMBER.search, plain_folder)] \
        if group.coordinator else None
    if group.broadcast is not None:
        names = group.broadcast(names)
    assert names is not None
    verdict = verifier.newest_verified([os.path.join(folder, n) for n in names], folder, group=group)
    if verdict is None:
        raise CheckpointRefusedError(f"no checkpoint to load under {folder}")
    return verdict


def _events_dir(accelerator: Any, events_dir: str | os.PathLike[str] | None) -> str | None:
    if events_dir is not None:
        return os.fspath(events_dir)
    project = accelerator.project_dir
    return None if project is None else os.fspath(project)


def _group(accelerator: Any) -> Group:
    if accelerator.num_processes == 1:
        return Group()

    def broadcast(obj: Any) -> Any:
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj], from_process=0)[0]

    return Group(coordinator=accelerator.is_main_process, broadcast=broadcast, barrier=accelerator.wait_for_everyone,
                 rank=accelerator.process_index, gather=torch_gather())
