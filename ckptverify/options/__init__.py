"""Options shared by every entry point that saves, loads or verifies: one name for each concept.

:class:`VerifyOptions` says what happens once a checkpoint is saved: :func:`ckptverify.save`,
:func:`ckptverify.async_save`, :meth:`ckptverify.Run.main` and every framework integration take it as ``verify=``
(a bare string is its ``when``).
"""

from __future__ import annotations

from ckptverify.options.verify import FAILURE_POLICIES, WHEN, VerifyOptions, verify_options

__all__ = ["FAILURE_POLICIES", "WHEN", "VerifyOptions", "verify_options"]
