"""Hugging Face transformers ``Trainer``: verify every ``checkpoint-N`` it saves; resume only from one that verifies.

::

    from ckptverify.integrations.transformers import VerifyCheckpointsCallback, verified_resume_checkpoint

    trainer = Trainer(..., callbacks=[VerifyCheckpointsCallback()])
    trainer.train(resume_from_checkpoint=verified_resume_checkpoint(args.output_dir))

**Saving.** ``TrainerCallback.on_save`` runs on every rank right after ``Trainer._save_checkpoint`` has written
``OUTPUT_DIR/checkpoint-N`` (weights, optimizer, scheduler, RNG states, ``trainer_state.json``) and rotated old
ones away. The callback waits for every rank (each writes its own ``rng_state_R.pth``), then rank 0 verifies the
folder, writes its stamp inside it and appends to ``OUTPUT_DIR/events.jsonl``; the verdict is broadcast, so with
``on_failure="raise"`` every rank stops.

**In the background.** With ``verify="background"`` rank 0 queues the folder for the background verifier and
``on_save`` returns at once; the manifest (when needed), the stamp and the event are written when its verification
finishes. ``on_train_end`` waits for the pending ones (bounded: ``CKPTVERIFY_VERIFY_EXIT_TIMEOUT``, 600 s). A failure
is a warning and a ``checkpoint-failed`` event when it is found; with ``on_failure="raise"`` every rank raises at
the next save, or at the end of training. A ``checkpoint-N`` that ``save_total_limit`` rotated away before its
turn is a ``checkpoint-deleted`` event, not a failure.

**Resuming.** No callback runs before the ``Trainer`` loads ``resume_from_checkpoint``: ``on_train_begin``
comes after the weights, optimizer and scheduler are loaded. So the check is made before ``train`` is called:
:func:`verified_resume_checkpoint` returns the newest ``checkpoint-N`` that verifies (skipping newer ones that
fail, each a warning and a ``resume-refused`` event), ``None`` when there is none to resume from, and raises
when there are some but none verifies; :func:`verify_before_resume` refuses one given path.

Weights in ``model.safetensors`` carry no checksum: with ``fingerprint="auto"`` (the default) the folder gets a
manifest right after the save, which every later verification checks them against (with
``fingerprint=False`` they are left unchecked, and every verdict names them in ``unchecked``);
``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth`` and ``training_args.bin`` are ``torch.save`` archives
whose every record's CRC-32 is checked.

Hyperparameter search (checkpoints under ``OUTPUT_DIR/run-*``) is not supported: the callback looks for
``checkpoint-N`` in ``args.output_dir``.
"""

from __future__ import annotations

import os
import re
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckptverify.integrations._core import (
    Fingerprint,
    Verifier,
    VerifyOptions,
    integration_verify,
    numbered_folders,
    plain_folder,
    settle_verdicts,
    torch_group,
    warn_if_accumulating,
)
from ckptverify.verifier.verification import Verification

__all__ = ["VerifyCheckpointsCallback", "verified_resume_checkpoint", "verify_before_resume"]

_CHECKPOINT = re.compile(r"^" + PREFIX_CHECKPOINT_DIR + r"-(\d+)$")


class VerifyCheckpointsCallback(TrainerCallback):
    """Verify, stamp and log each ``checkpoint-N`` right after the ``Trainer`` saves it.

    Args:
        verify: a :class:`~ckptverify.options.VerifyOptions` or its ``when``: ``"inline"`` (default) or
            ``"background"`` (see the module docstring; ``on_train_end`` waits for them); ``on_failure``:
            ``"warn"`` (default) or ``"raise"`` (:class:`~ckptverify.errors.CheckpointRefusedError` on every rank)
            when a checkpoint fails; ``deep``: as for :class:`~ckptverify.integrations.Verifier`.
        fingerprint, jobs, events_dir: as for :class:`~ckptverify.integrations.Verifier`.

    ``verdicts`` lists the verdicts so far (with ``background``, pending ones until ``on_train_end`` replaces
    them with the verdicts that arrived).
    """

    def __init__(self, *, verify: VerifyOptions | str = "inline", fingerprint: Fingerprint = "auto",
                 jobs: int | None = None, events_dir: str | os.PathLike[str] | None = None) -> None:
        options = integration_verify("VerifyCheckpointsCallback", verify)
        self.verifier = Verifier(verify=options, fingerprint=fingerprint, jobs=jobs, events_dir=events_dir)
        self.verdicts: list[Verification] = []

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        warn_if_accumulating(kwargs.get("model"), path)
        self.verdicts.append(self.verifier.after_save(path, step=state.global_step, group=torch_group()))
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.verifier.background:
            self.verdicts = settle_verdicts(self.verdicts, self.verifier.wait(group=torch_group()))
        return control


def verified_resume_checkpoint(output_dir: str | os.PathLike[str], *, jobs: int | None = None,
                               events_dir: str | os.PathLike[str] | None = None) -> str | None:
    """The newest ``checkpoint-N`` under ``output_dir`` that verifies, for ``trainer.train(resume_from_checkpoint=)``.

    Newer ones that fail are skipped, each with a warning and a ``resume-refused`` event naming what is wrong.
    Returns ``None`` when ``output_dir`` holds no ``checkpoint-N`` (a fresh start); raises
    :class:`~ckptverify.errors.CheckpointRefusedError` when it holds some and none verifies (starting over
    would silently throw the run away). Every rank calls it; rank 0 verifies and all get its answer.
    """
    root = os.fspath(output_dir)
    group = torch_group()
    found = [n for _, n in numbered_folders(root, _CHECKPOINT.match, plain_folder)] if group.coordinator else None
    if group.broadcast is not None:
        found = group.broadcast(found)
    assert found is not None
    verifier = Verifier(jobs=jobs, events_dir=events_dir or root)
    verdict = verifier.newest_verified([os.path.join(root, n) for n in found], root, group=group)
    return None if verdict is None else verdict.path


def verify_before_resume(path: str | os.PathLike[str], *, jobs: int | None = None,
                         events_dir: str | os.PathLike[str] | None = None) -> str:
    """Verify the ``checkpoint-N`` folder ``path``; return it when it passes, raise
    :class:`~ckptverify.errors.CheckpointRefusedError` (naming the first error's file) when it does not."""
    verifier = Verifier(jobs=jobs, events_dir=events_dir)
    return verifier.before_resume(path, group=torch_group()).path


