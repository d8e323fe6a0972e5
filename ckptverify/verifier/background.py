"""Verify each checkpoint once its save has committed, and stamp it: in the background or inline.

A ``verify="background"`` save hands the committed checkpoint to the coordinator's :class:`BackgroundVerifier`
and returns. Its one worker thread verifies checkpoints in submission order and stamps each
(:mod:`~ckptverify.runs.stamp`), holding the checkpoint's verifying lock from submission to stamp so retention
never deletes it meanwhile. The work runs in a verifier process (:mod:`~ckptverify.verifier.worker`, no torch,
``SCHED_IDLE``/nice 19): a low-priority *thread* could be descheduled holding the training's GIL
(``isolation="thread"`` keeps that mode). Reads are also paced (:mod:`~ckptverify.verifier.throttle`) until
someone waits.

Results are :class:`Verification` s and ``events.jsonl`` events (``docs/json-schema.md``); a failure is a
:class:`VerifyFailedWarning` and, with ``on_failure="raise"``, a :class:`~ckptverify.errors.VerifyFailedError`
from the next save on every rank. A checkpoint left without a verdict is verified when a resume picks it.
Pending work is waited for at exit up to ``CKPTVERIFY_VERIFY_EXIT_TIMEOUT`` s (600); a job ending with
``os._exit`` must call :func:`wait_for_verifications`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptverify.errors import CkptVerifyWarning, UsageError, VerifyFailedWarning
from ckptverify.options import VerifyOptions
from ckptverify.ownfiles.events import EventLog
from ckptverify.ownfiles.partsplan import nodes_of
from ckptverify.runs.stamp import SETTLE_SECONDS, read_stamp
from ckptverify.state.distributed import Group, rank_world
from ckptverify.verifier.jobs import STAMP, VERIFY_PART, job_function, run_job, stamp_save
from ckptverify.verifier.parts import node_name
from ckptverify.verifier.stamper import VerifyingLock
from ckptverify.verifier.throttle import IdleProbe, Throttle, env_number, throttle_enabled
from ckptverify.verifier.verification import Verification, event_of, from_stamp, unverified
from ckptverify.verifier.worker import PRIORITIES, VerifierProcess, lower_priority, restore_priority

__all__ = [
    "DEFAULT_EXIT_TIMEOUT",
    "EXIT_TIMEOUT_ENV",
    "REMOVED",
    "AfterSave",
    "BackgroundVerifier",
    "Task",
    "default_verifier",
    "exit_timeout",
    "last_verification",
    "node_hosts",
    "submit_part",
    "wait_for_checkpoint",
    "wait_for_verifications",
]

#: Where background verifications run: a verifier process (the default) or the worker thread itself.
ISOLATIONS = ("process", "thread")
EXIT_TIMEOUT_ENV = "CKPTVERIFY_VERIFY_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT = 600.0
#: Why a checkpoint (or a task's) has no verdict when it was gone before its verification began.
REMOVED = "removed before it was verified"
#: How often a verification waits for a verifying lock someone else (``ckptverify watch``) holds.
_LOCK_POLL_SECONDS = 0.2


#: No verification after a save (a frozen value: one instance serves as every default).
_OFF = VerifyOptions(when="off")


@dataclass(frozen=True, slots=True, kw_only=True)
class AfterSave:
    """What a save does once committed: its validated :class:`~ckptverify.options.VerifyOptions` and where results go.
    """

    #: When and how deep the checkpoint is verified, and what a failure does.
    verify: VerifyOptions = _OFF
    #: Called with every :class:`Verification`, in the thread that verified.
    on_verified: Callable[[Verification], None] | None = None
    #: An :class:`~ckptverify.ownfiles.events.EventLog`, or the directory of the ``events.jsonl`` to append to.
    events: Any = None

    def __post_init__(self) -> None:  # ``verify`` comes through verify_options, checked there
        if self.on_verified is not None and not callable(self.on_verified):
            raise UsageError(f"on_verified must be callable, got {type(self.on_verified).__name__}")

    def event_log(self) -> Any:
        """The event log to append to, or ``None``."""
        if self.events is None or hasattr(self.events, "emit"):
            return self.events
        return EventLog(os.fspath(self.events), rank=rank_world()[0])


@dataclass(frozen=True, eq=False)
class Task:
    """A verification a front end defines itself (the integrations), for :meth:`BackgroundVerifier.submit`.

    ``job`` (a :data:`~ckptverify.verifier.jobs.JOBS` name; anything else is a :class:`~ckptverify.errors.UsageError`)
    runs with JSON ``args`` in the verifier process once the verifying lock is held (``locked=False``: without it, for
    a node's part whose coordinator holds it). Then ``done(result, None)`` or ``done(None, why)`` runs in the worker
    thread; ``cut_short(why)`` if it never ran. The task reports its own results (no event, warning or
    :func:`last_verification` entry from the verifier).
    """

    job: str
    args: dict[str, Any]
    done: Callable[[Any, str | None], None]
    cut_short: Callable[[str], None] | None = None
    locked: bool = True

    def __post_init__(self) -> None:
        job_function(self.job)


@dataclass(eq=False)
class _Job:
    path: str
    step: int | None
    options: AfterSave
    lock: VerifyingLock
    #: A failure in ``raise`` mode is kept for the next save to raise (else it was raised already).
    deliver_later: bool = True
    events: Any = None
    task: Task | None = None
    #: The verification is shared out among nodes: this one checks the whole and gathers the parts.
    parts: bool = False


class BackgroundVerifier:
    """Verifies and stamps checkpoints one at a time from one daemon worker thread (started at the first
    :meth:`submit`).

    Args: ``isolation`` (``"process"`` default, or ``"thread"``), ``priority`` (:data:`PRIORITIES`), ``jobs`` (threads
    per verification), ``settle`` (seconds a failure waits before judging: a checkpoint being deleted is not
    corrupt), ``throttle`` (pace reads; default on unless ``CKPTVERIFY_VERIFY_THROTTLE=0``). Verifications that
    :meth:`wait`/:meth:`wait_for` waits on read at full speed, at the waiter's priority where allowed.
    """

    def __init__(self, *, isolation: str = "process", priority: str = "idle", jobs: int = 1,
                 settle: float = SETTLE_SECONDS, throttle: bool | None = None) -> None:
        if priority not in PRIORITIES:
            raise UsageError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
        if isolation not in ISOLATIONS:
            raise UsageError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
        self.isolation = isolation
        self.priority = priority
        self.jobs = jobs
        self.settle = settle
        self.throttle = throttle_enabled() if throttle is None else bool(throttle)
        #: Called with a checkpoint's path right before it is verified (fault drills and tests plant damage here).
        self.before_verify: Callable[[str], None] | None = None
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending: list[_Job] = []
        self._last: Verification | None = None
        self._unraised: list[Verification] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._waiting = 0  # callers of wait() or wait_for() now: while any, verifications are hurried
        self._throttle_now: Throttle | None = None  # the in-thread verification's throttle
        self._child = VerifierProcess(priority)
        self._worker_tid: int | None = None

    # ------------------------------------------------------------------ public

    def submit(self, path: str | os.PathLike[str], *, step: int | None = None,
               options: AfterSave | None = None, task: Task | None = None, parts: bool = False) -> None:
        """Queue the committed checkpoint ``path`` (or ``task``) and return at once; its verifying lock is taken now if
        free (not for a ``locked=False`` task). ``parts``: verification shared among the writing nodes; this verifier
        checks the whole and its node's files, gathers the others and stamps (:mod:`~ckptverify.verifier.parts`)."""
        options = options or AfterSave(verify=VerifyOptions(when="background"))
        job = self._job(path, step, options, deliver_later=True, task=task, parts=parts)
        with self._cond:
            if self._closed:
                job.lock.release()
                raise UsageError("this BackgroundVerifier was closed")
            self._pending.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="ckptverify-verify", daemon=True)
                self._thread.start()
        self._queue.put(job)

    def verify_now(self, path: str | os.PathLike[str], *, step: int | None = None,
                   options: AfterSave | None = None, deliver_later: bool = False) -> Verification:
        """Verify and stamp ``path`` in the calling thread (all cores), handle the result as :meth:`submit` would, and
        return it. ``deliver_later``: keep a ``raise``-mode failure for the next save."""
        options = options or AfterSave(verify=VerifyOptions(when="inline"))
        job = self._job(path, step, options, deliver_later=deliver_later)
        with self._cond:
            self._pending.append(job)
        result = self._run(job, jobs=None, background=False)
        assert result is not None  # a verification's, not a task's
        return result

    def pending(self) -> list[str]:
        """Paths submitted and not yet verified, oldest first."""
        with self._cond:
            return [j.path for j in self._pending]

    def last(self) -> Verification | None:
        """The newest result, or ``None`` before the first one."""
        with self._cond:
            return self._last

    def take_failures(self) -> list[Verification]:
        """The failures of ``raise``-mode saves not raised yet (and forget them)."""
        with self._cond:
            out, self._unraised = self._unraised, []
            return out

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted checkpoint is verified; ``True`` if so. On ``timeout``, warn and log
        ``checkpoint-cut-short`` for each unfinished one (they stay queued) and return ``False``."""
        if self._wait_while(lambda: bool(self._pending), timeout):
            return True
        with self._cond:
            left = list(self._pending)
        if left:
            self._cut_short(left, timeout)
        return not left

    def wait_for(self, paths: list[str] | set[str], timeout: float | None = None) -> bool:
        """Wait until none of ``paths`` is pending; ``False`` on ``timeout`` (nothing reported)."""
        wanted = {os.path.abspath(os.fspath(p)) for p in paths}
        return self._wait_while(lambda: any(j.path in wanted for j in self._pending), timeout)

    def _wait_while(self, busy: Callable[[], bool], timeout: float | None) -> bool:
        """Wait (hurrying the verifications) while ``busy()`` holds; ``False`` on ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._waited_for(), self._cond:
            while busy():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    @contextlib.contextmanager
    def _waited_for(self) -> Iterator[None]:
        """While someone waits, verifications read at full speed at the waiter's priority."""
        with self._cond:
            self._waiting += 1
            hurry = bool(self._pending)
            current = self._throttle_now
        try:
            if hurry:
                self._child.hurry()
                if current is not None:
                    current.lift()
                if self.isolation == "thread" and self._worker_tid is not None and self.priority != "normal":
                    with contextlib.suppress(OSError):
                        restore_priority(os.getpriority(os.PRIO_PROCESS, os.getpid()), self._worker_tid)
            yield
        finally:
            with self._cond:
                self._waiting -= 1

    def close(self, timeout: float | None = None) -> bool:
        """:meth:`wait` (up to ``timeout``), then stop the worker; later submissions are refused."""
        done = self.wait(timeout)
        with self._cond:
            self._closed = True
        self._queue.put(None)
        if not done:
            self._child.close(now=True)  # no verifier process outlives the job
        return done

    # ------------------------------------------------------------------ internals

    def _job(self, path: str | os.PathLike[str], step: int | None, options: AfterSave, deliver_later: bool,
             task: Task | None = None, parts: bool = False) -> _Job:
        root = os.path.abspath(os.fspath(path))
        lock = VerifyingLock(root)
        if task is None or task.locked:
            with contextlib.suppress(OSError):
                lock.acquire()  # busy (a watcher) or gone: the worker sorts it out
        return _Job(root, step, options, lock, deliver_later=deliver_later, events=options.event_log(), task=task,
                    parts=parts)

    def _work(self) -> None:
        # With a process this thread only relays, at the process's priority, so awaited replies never starve.
        self._worker_tid = threading.get_native_id()
        while True:
            job = self._queue.get()
            if job is None:
                self._child.close()
                return
            if self.isolation == "thread" and not self._urgent():
                lower_priority(self.priority)
            self._run(job, jobs=self.jobs, background=True)

    def _run(self, job: _Job, jobs: int | None, background: bool) -> Verification | None:
        """Verify ``job`` (or run its task), then report the result: a task's to its ``done``. The worker never dies:
        a failure is a result without a verdict."""
        task = job.task
        try:
            result = self._locked(job, jobs, background)
        except Exception as exc:  # worded as the verifier process words a job's: "Type: message"
            result = _NoResult(f"{type(exc).__name__}: {exc}")
        finally:
            job.lock.release()
        why = result.why if isinstance(result, _NoResult) else None
        if why is not None:
            result = None
        try:
            if task is not None:
                _guarded(f"reporting the verification of {job.path}", task.done, result, why)
                return None
            if why is not None:
                result = _unverified(job, "error", f"the verification itself failed: {why}")
            with self._cond:
                self._last = result
                if result.verdict == "failed" and job.options.verify.on_failure == "raise" and job.deliver_later:
                    self._unraised.append(result)
            self._report(job, result)
            return result
        finally:
            with self._cond:  # only now: a wait that returns has seen the events written
                with contextlib.suppress(ValueError):
                    self._pending.remove(job)
                self._cond.notify_all()

    def _locked(self, job: _Job, jobs: int | None, background: bool) -> Any:
        """``job``'s verification (or its task's result, or a :class:`_NoResult`), its verifying lock held (waiting
        while ``watch`` holds it); the caller releases it."""
        task = job.task
        if task is None or task.locked:
            waited = not job.lock.held
            while not job.lock.held:
                try:
                    if job.lock.acquire():
                        break
                except OSError:  # the checkpoint is gone
                    return _NoResult(REMOVED) if task is not None else _unverified(job, "deleted", REMOVED)
                time.sleep(_LOCK_POLL_SECONDS)
            if task is None and waited:
                # Someone else (``ckptverify watch``) verified it meanwhile: their current stamp stands.
                stamp = read_stamp(job.path)
                if stamp is not None and stamp.current and (bool(stamp.data.get("deep"))
                                                            or not job.options.verify.deep):
                    return from_stamp(job.path, job.step, stamp.data)
        if self.before_verify is not None:
            self.before_verify(job.path)
        if background and self.isolation == "process":
            args = task.args if task is not None else {"path": job.path, "step": job.step, "jobs": jobs or 1,
                                                       "deep": job.options.verify.deep, "settle": self.settle,
                                                       "parts": job.parts}
            try:
                answer = self._child.run(STAMP if task is None else task.job, args, throttle=self._throttled,
                                         urgent=self._urgent)
            except RuntimeError as exc:  # the job's own "Type: message", or why the process gave no answer
                return _NoResult(str(exc))
            return answer if task is not None else Verification.from_dict(answer)
        if task is not None:
            return run_job(task.job, task.args)
        probe = IdleProbe.open() if background and self.throttle and jobs == 1 else None  # this thread's reads
        throttle = None if probe is None else Throttle(probe)
        if throttle is not None:
            with self._cond:  # with wait()'s count: either it sees this throttle, or this sees it waiting
                if self._waiting:
                    throttle.lift()
                self._throttle_now = throttle
        try:
            return stamp_save(job.path, step=job.step, jobs=jobs, deep=job.options.verify.deep, settle=self.settle,
                              parts=job.parts, throttle=throttle)
        finally:
            if throttle is not None:
                with self._cond:
                    self._throttle_now = None

    def _throttled(self) -> bool:
        with self._cond:
            return self.throttle and not self._waiting

    def _urgent(self) -> bool:
        with self._cond:
            return bool(self._waiting)

    def _report(self, job: _Job, result: Verification) -> None:
        """The event, the warning and the callback of one result."""
        _emit(job.events, event_of(result), result)
        if result.verdict == "failed":
            warnings.warn(result.describe(), VerifyFailedWarning, stacklevel=2)
        elif result.verdict == "unverified":
            warnings.warn(f"{result.describe()}; it carries no stamp and is verified when a resume picks it",
                          CkptVerifyWarning, stacklevel=2)
        if job.options.on_verified is not None:
            _guarded("the on_verified callback", job.options.on_verified, result)

    def _cut_short(self, left: list[_Job], timeout: float | None) -> None:
        why = f"not verified within the {timeout} s waited"
        unsaid = []  # a task with a cut_short says it itself
        for job in left:
            if job.task is not None and job.task.cut_short is not None:
                _guarded(f"reporting the cut-short verification of {job.path}", job.task.cut_short, why)
            else:
                unsaid.append(job)
        if not unsaid:
            return
        names = ", ".join(j.path for j in unsaid)
        warnings.warn(f"{len(unsaid)} checkpoint verification(s) not finished after waiting {timeout} s: {names}; "
                      "they carry no stamp and are verified when a resume picks them", CkptVerifyWarning,
                      stacklevel=3)
        for job in unsaid:
            cut = _unverified(job, "cut-short", why)
            _emit(job.events, event_of(cut), cut)


@dataclass(frozen=True, slots=True)
class _NoResult:
    """A verification or task that ended without a result, and why, as the user reads it."""

    why: str


def _guarded(what: str, call: Callable[..., Any], *args: Any) -> None:
    """``call(*args)``: reporting code (a task's, a user's callback) that must not stop the verifier; a failure is a
    warning."""
    try:
        call(*args)
    except Exception as exc:
        warnings.warn(f"{what} failed: {type(exc).__name__}: {exc}", CkptVerifyWarning, stacklevel=3)


def _unverified(job: _Job, no_verdict: str, reason: str) -> Verification:
    return unverified(job.path, job.step, no_verdict, reason, deep=job.options.verify.deep)


def _emit(log: Any, event: str, result: Verification) -> None:
    if log is None:
        return
    try:
        log.emit(event, **result.to_dict())
    except OSError as exc:  # the run directory went away or is read-only: the warning still says it
        warnings.warn(f"cannot append the {event} event for {result.path}: {exc}", CkptVerifyWarning,
                      stacklevel=2)


# ---------------------------------------------------------------------- the process's verifier

_default: BackgroundVerifier | None = None
_default_lock = threading.Lock()
_atexit_registered = False


def default_verifier() -> BackgroundVerifier:
    """The process's verifier (made at first use), used by saves with ``verify=``; waited for at exit up to
    :func:`exit_timeout` seconds."""
    global _default, _atexit_registered
    with _default_lock:
        if _default is None:
            _default = BackgroundVerifier()
            if not _atexit_registered:
                atexit.register(_at_exit)
                _atexit_registered = True
        return _default


def node_hosts(group: Group) -> list[str] | None:
    """Each rank's node (every rank calls it: one small collective) when ``group`` spans more than one node, else
    ``None``."""
    if group.gather is None:
        return None
    hosts = [str(h) for h in group.gather(node_name())]  # the same list on every rank: all take one way
    return hosts if len(set(hosts)) > 1 else None


def submit_part(path: str | os.PathLike[str], step: int | None, hosts: list[str], rank: int) -> None:
    """On the lowest rank of a node other than the coordinator's (else nothing): queue that node's part of a
    verification shared out among nodes (:mod:`~ckptverify.verifier.parts`); the coordinator reports the verdict, so
    only a part that wrote none is said (a warning)."""
    nodes = nodes_of(hosts)
    node = next(k for k, (_, ranks) in enumerate(nodes) if rank in ranks)
    if rank != nodes[node][1][0]:
        return
    where = os.path.abspath(os.fspath(path))

    def done(result: Any, why: str | None) -> None:
        if result is None or not result.get("written"):
            warnings.warn(f"node {node}'s part of the verification of {where} was not verified: "
                          f"{why if result is None else result.get('why')}; the coordinator leaves the checkpoint "
                          "unverified", CkptVerifyWarning, stacklevel=2)

    default_verifier().submit(where, step=step, task=Task(job=VERIFY_PART, args={"root": where, "node": node},
                                                          done=done, locked=False))


def last_verification() -> Verification | None:
    """The newest result of a save's verification in this process (``None`` before one, and off the coordinator)."""
    return None if _default is None else _default.last()


def wait_for_checkpoint(path: str | os.PathLike[str], timeout: float | None = None) -> bool:
    """Wait until this process's verifier is done with ``path`` (at once if not queued); ``False`` on ``timeout``."""
    return True if _default is None else _default.wait_for([os.fspath(path)], timeout)


def wait_for_verifications(timeout: float | None = None) -> bool:
    """Wait until every checkpoint this process saved with ``verify=`` is verified and stamped; ``True`` if so. On
    ``timeout``, warn (and log ``checkpoint-cut-short``) naming the unfinished ones and return ``False``."""
    return True if _default is None else _default.wait(timeout)


def exit_timeout() -> float:
    """Seconds a job waits at exit for its pending verifications (``CKPTVERIFY_VERIFY_EXIT_TIMEOUT``)."""
    return env_number(EXIT_TIMEOUT_ENV, DEFAULT_EXIT_TIMEOUT, warn=True)


def _at_exit() -> None:
    verifier = _default
    if verifier is not None:
        verifier.close(timeout=exit_timeout())


def _forget_after_fork() -> None:
    global _default, _default_lock
    _default_lock = threading.Lock()
    if _default is not None:  # let go of the inherited lock descriptors (the parent still holds the locks)
        for job in _default._pending:
            fd, job.lock._fd = job.lock._fd, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
    _default = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
