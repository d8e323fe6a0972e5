"""ckptverify inside the frameworks users train with: verify every checkpoint right after the framework saves it,
and refuse to resume from one that fails, before the framework loads it.

One module per framework, each importing its framework only when it is itself imported (``import ckptverify``
never needs one):

- :mod:`ckptverify.integrations.lightning`: ``VerifyCheckpointsCallback``, a PyTorch Lightning ``Callback``;
- :mod:`ckptverify.integrations.transformers`: ``VerifyCheckpointsCallback``, a ``TrainerCallback``, and
  ``verified_resume_checkpoint(output_dir)``;
- :mod:`ckptverify.integrations.accelerate`: ``save_state`` / ``load_state`` around the ``Accelerator``'s;
- :mod:`ckptverify.integrations.torchtitan`: ``VerifiedCheckpointManager``, a torchtitan ``CheckpointManager``
  that saves through ckptverify's hashing writer.

A class is named for the framework class it extends, with what ckptverify adds in front: a callback that verifies
the checkpoints is ``VerifyCheckpointsCallback`` in either framework (its module says which), a checkpoint manager
whose checkpoints are verified is ``VerifiedCheckpointManager``.

Each takes ``verify=`` a :class:`~ckptverify.options.VerifyOptions` (``when``, ``deep``, ``on_failure``; torchtitan:
the ``verify_when``, ``verify_deep`` and ``verify_on_failure`` fields of its config). With ``verify="background"``
the save returns at once and the checkpoint is verified by the process's background verifier
(:mod:`ckptverify.verifier.background`).

What they share (:mod:`ckptverify.integrations._core`): :class:`Verifier`, :class:`VerifyFailedWarning`,
and the result of every check, :class:`~ckptverify.verifier.verification.Verification` (``ckptverify.Verification``,
the result of a save's ``verify=`` too). See ``docs/integrations.md``.
"""

from ckptverify.integrations._core import Group, Verifier, VerifyFailedWarning, torch_group
from ckptverify.options import VerifyOptions
from ckptverify.verifier.verification import Verification

__all__ = ["Group", "Verification", "Verifier", "VerifyFailedWarning", "VerifyOptions", "torch_group"]
