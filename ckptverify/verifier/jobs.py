"""The verifications a front end can hand to the background verifier as a
:class:`~ckptverify.verifier.background.Task`, each under a name: what a task's ``job`` names, and what the
verifier process (:mod:`~ckptverify.verifier.worker`) runs for it.

A request names a job, never a module or a function: the verifier process runs only the functions imported here,
so nothing a request says can make it import code (it runs with ``python -P`` in ``/``, and whatever reaches its
standard input is data).

- ``check-saved``: :func:`~ckptverify.verifier.saved.saved_job`, the framework integrations' check of a
  checkpoint they just saved (fingerprinted when needed, verified, stamped).
- ``verify-part``: :func:`~ckptverify.verifier.parts.part_job`, one node's part of a save's verification
  shared out among the nodes that wrote it (the files its ranks wrote, verified; the part verdict written).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptverify.errors import UsageError
from ckptverify.verifier.parts import part_job
from ckptverify.verifier.saved import saved_job

__all__ = ["CHECK_SAVED", "JOBS", "VERIFY_PART", "run_job"]

CHECK_SAVED = "check-saved"
VERIFY_PART = "verify-part"

#: Job name -> the function that runs it, called with the task's ``args`` (JSON values); it returns JSON values.
JOBS: dict[str, Callable[..., Any]] = {
    CHECK_SAVED: saved_job,
    VERIFY_PART: part_job,
}


def run_job(job: str, args: dict[str, Any]) -> Any:
    """Run the job named ``job`` with ``args``; :class:`~ckptverify.errors.UsageError` when there is no such job."""
    function = JOBS.get(job)
    if function is None:
        raise UsageError(f"no such verification job: {job!r} (known: {', '.join(sorted(JOBS))})")
    return function(**args)
