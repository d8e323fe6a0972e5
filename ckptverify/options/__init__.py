"""Options shared by every entry point that saves, loads or verifies.

:class:`VerifyOptions` (``verify=`` of save, async_save, load, ``Run.main`` and the integrations; a bare string
is its ``when``) and :data:`FAILURE_POLICIES`, the one value set of every failure knob. Defaults and why they
differ: :mod:`ckptverify.options.verify`.
"""

from __future__ import annotations

from ckptverify.options.verify import FAILURE_POLICIES, WHEN, VerifyOptions, failure_policy, verify_options

__all__ = ["FAILURE_POLICIES", "WHEN", "VerifyOptions", "failure_policy", "verify_options"]
