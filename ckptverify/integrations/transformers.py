"""Hugging Face transformers ``Trainer``: verify every ``checkpoint-N`` it saves; resume only from one that verifies.

::

    from ckptverify.integrations.transformers import VerifyCheckpointsCallback, verified_resume_checkpoint

    trainer = Trainer(..., callbacks=[VerifyCheckpointsCallback()])
    trainer.train(resume_from_checkpoint=verified_resume_checkpoint(args.output_dir))

``on_save`` runs on every rank after the checkpoint is written and rotated: the callback waits for every rank,
then rank 0 verifies, stamps and logs to ``OUTPUT_DIR/events.jsonl``. Background mode as in
:mod:`ckptverify.integrations._core` (``on_train_end`` waits). No callback runs before the ``Trainer`` loads
``resume_from_checkpoint``, so the check is made before ``train``: :func:`verified_resume_checkpoint`, or
:func:`verify_before_resume` for one path. ``model.safetensors`` has no checksum: ``fingerprint="auto"`` writes a
manifest after each save (with ``False`` they stay in ``unchecked``). Hyperparameter search (``run-*``) is not
supported.
"""

from __future__ import annotations

import os
import re
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckptverify.integrations._core import Fingerprint, Verifier, integration_verify, warn_if_accumulating
from ckptverify.options import VerifyOptions
from ckptverify.state.distributed import torch_group
from ckptverify.verifier.verification import Verification

__all__ = ["VerifyCheckpointsCallback", "verified_resume_checkpoint", "verify_before_resume"]

_CHECKPOINT = re.compile(r"^" + PREFIX_CHECKPOINT_DIR + r"-(\d+)$")


class VerifyCheckpointsCallback(TrainerCallback):
    """Verify, stamp and log each ``checkpoint-N`` right after the ``Trainer`` saves it.

    Args:
        verify, fingerprint, jobs, events_dir: as for :class:`~ckptverify.integrations.Verifier` (``"background"``:
            ``on_train_end`` waits).

    ``verdicts``: the verdicts so far (pending ones until ``on_train_end``).
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
        self.verdicts = self.verifier.settle(self.verdicts, group=torch_group())
        return control


def verified_resume_checkpoint(output_dir: str | os.PathLike[str], *, jobs: int | None = None,
                               events_dir: str | os.PathLike[str] | None = None) -> str | None:
    """The newest ``checkpoint-N`` under ``output_dir`` that verifies, for ``trainer.train(resume_from_checkpoint=)``;
    newer failing ones are skipped (warning, ``resume-refused`` event). ``None`` if there is none (fresh start);
    :class:`~ckptverify.errors.CheckpointRefusedError` if some exist and none verifies. Every rank calls it."""
    root = os.fspath(output_dir)
    group = torch_group()
    verdict = Verifier(jobs=jobs, events_dir=events_dir or root).newest_numbered(root, _CHECKPOINT.match, group=group)
    return None if verdict is None else verdict.path


def verify_before_resume(path: str | os.PathLike[str], *, jobs: int | None = None,
                         events_dir: str | os.PathLike[str] | None = None) -> str:
    """Verify the folder ``path``; return it if it passes, else raise :class:`~ckptverify.errors.CheckpointRefusedError`
    (naming the first error's file)."""
    return Verifier(jobs=jobs, events_dir=events_dir).before_resume(path, group=torch_group()).path


