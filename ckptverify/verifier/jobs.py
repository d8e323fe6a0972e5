"""Named verifications the verifier process runs: ``stamp`` (a save's, :func:`stamp_job`), ``check-saved`` (an
integration's, :func:`~ckptverify.verifier.saved.saved_job`) and ``verify-part``
(:func:`~ckptverify.verifier.parts.part_job`).

A request names a job, never a module or function: the verifier process (``python -P`` in ``/``) runs only what
is imported here, so nothing on its standard input can make it import code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ckptverify.errors import UsageError
from ckptverify.safeparse.readers import pacing
from ckptverify.verifier.parts import part_job, stamp_parts_locked
from ckptverify.verifier.saved import saved_job
from ckptverify.verifier.stamper import stamp_locked
from ckptverify.verifier.throttle import Throttle
from ckptverify.verifier.verification import Verification

__all__ = ["CHECK_SAVED", "JOBS", "STAMP", "VERIFY_PART", "job_function", "run_job", "stamp_job", "stamp_save"]

STAMP = "stamp"
CHECK_SAVED = "check-saved"
VERIFY_PART = "verify-part"


def stamp_save(path: str, *, step: int | None, deep: bool, jobs: int | None, settle: float, parts: bool = False,
               throttle: Throttle | None = None) -> Verification:
    """A save's verification and stamp, its verifying lock held (in a verifier thread or process):
    :func:`~ckptverify.verifier.stamper.stamp_locked`, or with ``parts``
    :func:`~ckptverify.verifier.parts.stamp_parts_locked`."""
    verify = stamp_parts_locked if parts else stamp_locked
    return verify(path, step=step, jobs=jobs, deep=deep, settle=settle, throttle=throttle)


def stamp_job(path: str, step: int | None, deep: bool, jobs: int | None, settle: float, parts: bool = False,
              throttle: Throttle | None = None) -> dict[str, Any]:
    """The ``stamp`` job (the parent holds the verifying lock): :func:`stamp_save` on one core unless ``jobs`` says
    more; the :class:`~ckptverify.verifier.verification.Verification` as JSON values."""
    return stamp_save(path, step=step, deep=deep, jobs=jobs or 1, settle=float(settle), parts=parts,
                      throttle=throttle).to_dict()


def _paced(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with its reads paced by the ``throttle`` it is called with (it records no throttling itself)."""
    @functools.wraps(function)
    def paced(*, throttle: Throttle | None = None, **args: Any) -> Any:
        with pacing(throttle):
            return function(**args)

    return paced


#: Job name -> the function that runs it, called with the task's ``args`` (JSON values) and ``throttle`` (the
#: pacing of its reads); it returns JSON values.
JOBS: dict[str, Callable[..., Any]] = {
    STAMP: stamp_job,
    CHECK_SAVED: _paced(saved_job),
    VERIFY_PART: _paced(part_job),
}


def job_function(job: object) -> Callable[..., Any]:
    """The function that runs the job named ``job``; :class:`~ckptverify.errors.UsageError` when there is none."""
    function = JOBS.get(job) if isinstance(job, str) else None
    if function is None:
        raise UsageError(f"no such verification job: {job!r} (known: {', '.join(sorted(JOBS))})")
    return function


def run_job(job: object, args: object, throttle: Throttle | None = None) -> Any:
    """Run the job named ``job`` with ``args`` (a JSON object), reads paced by ``throttle``;
    :class:`~ckptverify.errors.UsageError` when there is no such job or ``args`` is not an object."""
    function = job_function(job)
    if not isinstance(args, dict):
        raise UsageError(f"the arguments of {job} are not an object: {type(args).__name__}")
    return function(**args, throttle=throttle)
