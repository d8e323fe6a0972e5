"""ckptverify inside training frameworks: verify every checkpoint right after the framework saves it, and refuse to
resume from one that fails, before the framework loads it (``docs/integrations.md``).

One module per framework (``lightning``, ``transformers``, ``accelerate``, ``torchtitan``), importing it only when
imported itself; what they share (:class:`Verifier`) is :mod:`ckptverify.integrations._core`.
"""

from ckptverify.integrations._core import Verifier
from ckptverify.state.distributed import Group, torch_group

__all__ = ["Group", "Verifier", "torch_group"]
