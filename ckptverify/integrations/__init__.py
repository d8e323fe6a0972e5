"""ckptverify inside training frameworks: verify every checkpoint right after the framework saves it, and refuse to
resume from one that fails, before the framework loads it (``docs/integrations.md``).

One module per framework, importing it only when imported itself: ``lightning`` and ``transformers``
(``VerifyCheckpointsCallback``; transformers also ``verified_resume_checkpoint``), ``accelerate`` (``save_state`` /
``load_state``) and ``torchtitan`` (``VerifiedCheckpointManager``, saving through the hashing writer). Each takes
``verify=`` a :class:`~ckptverify.options.VerifyOptions` (torchtitan: ``verify_when``/``verify_deep``/
``verify_on_failure`` config fields). Shared pieces (:mod:`ckptverify.integrations._core`): :class:`Verifier`,
:class:`~ckptverify.errors.VerifyFailedWarning`, and results as :class:`~ckptverify.verifier.verification.Verification`.
"""

from ckptverify.integrations._core import Verifier
from ckptverify.state.distributed import Group, torch_group

__all__ = ["Group", "Verifier", "torch_group"]
