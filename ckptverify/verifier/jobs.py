"""Named verifications a :class:`~ckptverify.verifier.background.Task` may request: ``check-saved``
(:func:`~ckptverify.verifier.saved.saved_job`) and ``verify-part`` (:func:`~ckptverify.verifier.parts.part_job`).

A request names a job, never a module or function: the verifier process (``python -P`` in ``/``) runs only what
is imported here, so nothing on its standard input can make it import code.
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
