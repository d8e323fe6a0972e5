"""Options shared by every entry point that saves, loads or verifies: one name for each concept.

:class:`VerifyOptions` says when a checkpoint is verified and what its failure does: :func:`ckptverify.save`,
:func:`ckptverify.async_save`, :func:`ckptverify.load`, :meth:`ckptverify.Run.main` and every framework
integration take it as ``verify=`` (a bare string is its ``when``). :data:`FAILURE_POLICIES` is the one value
set of every failure knob. The vocabulary, its defaults and why they differ: :mod:`ckptverify.options.verify`.
"""

from __future__ import annotations

from ckptverify.options.verify import FAILURE_POLICIES, WHEN, VerifyOptions, failure_policy, verify_options

__all__ = ["FAILURE_POLICIES", "WHEN", "VerifyOptions", "failure_policy", "verify_options"]
