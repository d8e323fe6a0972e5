"""The verifier process: verifies and stamps for a :class:`~ckptverify.verifier.background.BackgroundVerifier` so
hashing never contends with the training for its GIL. :class:`VerifierProcess` is the parent's side, :func:`main`
the child's (``python -m ckptverify.verifier.worker [--priority P] [--waiter-nice N] [--hurry-fd FD]``).

One JSON request per stdin line (a ``job`` of :data:`~ckptverify.verifier.jobs.JOBS` with ``args``), one JSON
answer per stdout line; stray prints go to stderr. Requests name jobs, never code. Runs
without torch at idle priority; a ``seq`` on the hurry pipe (the parent now waits) lifts that request's throttle
and restores the parent's priority until answered (``urgent`` requests start so), where the system allows raising
priority again. Ends when stdin closes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from ckptverify.verifier.throttle import IdleProbe, Throttle

__all__ = ["PRIORITIES", "VerifierProcess", "lower_priority", "main", "restore_priority", "serve"]

#: CPU priority of a verification: ``idle`` (``SCHED_IDLE`` and nice 19), ``low`` (nice 19) or ``normal``.
PRIORITIES = ("idle", "low", "normal")


def serve(requests: Any, replies: Any, hurried: Callable[[int], bool] | None = None,
          priority: _Priority | None = None) -> None:
    """Answer each request line of ``requests`` with one line on ``replies``: ``{"result": ...}`` or ``{"call_error":
    ...}`` (:func:`~ckptverify.verifier.jobs.run_job`). ``hurried(seq)``: whether the parent asked for full speed;
    ``priority``: set per request."""
    from ckptverify.verifier.jobs import run_job

    def reply(answer: dict[str, Any]) -> None:
        replies.write(json.dumps(answer, default=str) + "\n")
        replies.flush()

    for line in requests:
        try:
            req = json.loads(line)
            job = req["job"]
        except (ValueError, KeyError, TypeError) as exc:
            reply({"protocol_error": f"{type(exc).__name__}: {exc}"})
            continue
        if priority is not None:
            priority.for_request(bool(req.get("urgent")))
        try:
            answer = {"result": run_job(job, req.get("args") or {}, _throttle(req, hurried, priority))}
        except Exception as exc:  # one request's failure is its answer; the process serves the next one
            answer = {"call_error": f"{type(exc).__name__}: {exc}"}
        reply({**answer, "seq": req.get("seq")})


def _arguments(argv: list[str]) -> tuple[str, int, str | None]:
    """``--priority``, ``--waiter-nice`` and ``--hurry-fd`` as :class:`VerifierProcess` sets them."""
    parser = argparse.ArgumentParser(prog="python -m ckptverify.verifier.worker", add_help=False)
    parser.add_argument("--priority", choices=PRIORITIES, default="idle")
    parser.add_argument("--waiter-nice", type=int, default=0)
    parser.add_argument("--hurry-fd", default=None)
    args, _ = parser.parse_known_args(argv)
    return args.priority, args.waiter_nice, args.hurry_fd


def main(argv: list[str] | None = None) -> int:
    priority, waiter_nice, hurry_fd = _arguments(sys.argv[1:] if argv is None else argv)
    mine = _Priority(priority, waiter_nice)
    mine.for_request(urgent=False)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints cannot corrupt the replies
    serve(sys.stdin, replies, _hurry_reader(hurry_fd), mine)
    return 0


class _Priority:
    """The process's CPU priority: ``low`` while nobody waits, the parent's while it waits (idle priority would starve
    an awaited verification on a busy machine)."""

    def __init__(self, low: str, waiter_nice: int) -> None:
        self.low = low
        self.waiter_nice = waiter_nice

    def for_request(self, urgent: bool) -> None:
        if urgent:
            self.raise_()
        else:
            lower_priority(self.low, whole_process=True)

    def raise_(self) -> None:
        if self.low != "normal":
            restore_priority(self.waiter_nice)  # refused by the system: it stays low (documented)


def _throttle(req: dict[str, Any], hurried: Callable[[int], bool] | None,
              priority: _Priority | None = None) -> Throttle | None:
    """A request's pacing, lifted when the parent hurries its ``seq`` (then, and for ``urgent``, at the parent's
    priority). Low priority without throttle still gets a probe-less one, to see the hurry."""
    probe = IdleProbe.open() if req.get("throttle") and not req.get("urgent") else None
    seq = req.get("seq")
    asked = None if hurried is None or not isinstance(seq, int) else functools.partial(hurried, seq)
    low = priority is not None and priority.low != "normal" and not req.get("urgent")
    if probe is None and not (low and asked is not None):
        return None
    return Throttle(probe, lifted=asked, on_lift=None if priority is None else priority.raise_)


def _hurry_reader(raw: str | None) -> Callable[[int], bool] | None:
    """``hurried(seq)``: whether the hurry pipe carried ``seq`` (never blocks; a late number never lifts a later
    request)."""
    try:
        fd = int(raw) if raw else -1
        os.set_blocking(fd, False)
    except (ValueError, OSError):
        return None
    seen: set[int] = set()
    partial = b""

    def hurried(seq: int) -> bool:
        nonlocal partial
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # nothing more now (or the parent is gone)
                break
            if not chunk:
                break
            *lines, partial = (partial + chunk).split(b"\n")
            seen.update(int(n) for n in lines if n.strip().isdigit())
        return seq in seen

    return hurried


class VerifierProcess:
    """The verifier process, started on first use and again after it died; one request at a time."""

    def __init__(self, priority: str) -> None:
        self.priority = priority
        self._proc: subprocess.Popen[str] | None = None
        self._hurry_w: int | None = None  # the parent's end of the hurry pipe
        self._hurry_lock = threading.Lock()
        self._seq = 0  # the number of the request in flight (or the last one)

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        # This ckptverify, and nothing importable from the job's working directory (a planted module would run):
        # `-P`, cwd "/", and only absolute PYTHONPATH entries.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        entries = [root, *(env.get("PYTHONPATH") or "").split(os.pathsep)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in entries if p and os.path.isabs(p)))
        # What the process needs from this one travels on its command line, not in the environment.
        argv = ["--priority", self.priority]
        with contextlib.suppress(OSError):
            argv += ["--waiter-nice", str(os.getpriority(os.PRIO_PROCESS, os.getpid()))]  # the main thread's
        # One thread for any numeric library a deep verification loads: the cores belong to the training.
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = "1"
        self._close_hurry()
        hurry_r, hurry_w = os.pipe()
        os.set_blocking(hurry_w, False)
        with self._hurry_lock:
            self._hurry_w = hurry_w
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "ckptverify.verifier.worker", *argv, "--hurry-fd", str(hurry_r)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8", env=env, close_fds=True,
                bufsize=1, pass_fds=(hurry_r,), cwd=os.path.abspath(os.sep))
        except BaseException:
            self._close_hurry()
            raise
        finally:
            os.close(hurry_r)
        return self._proc

    def hurry(self) -> None:
        """Ask the verification in progress (if any) to read at full speed, unthrottled."""
        with self._hurry_lock:
            if self._hurry_w is not None:
                with contextlib.suppress(OSError):  # full (asked already) or the process is gone
                    os.write(self._hurry_w, f"{self._seq}\n".encode())

    def _close_hurry(self) -> None:
        with self._hurry_lock:
            fd, self._hurry_w = self._hurry_w, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def run(self, job: str, args: dict[str, Any], throttle: Callable[[], bool] | None = None,
            urgent: Callable[[], bool] | None = None) -> Any:
        """Run job ``job`` with ``args`` in the process and return its result; ``RuntimeError`` if no answer (the
        message says why) or it raised (the message is the job's own ``Type: message``). ``throttle``/``urgent`` are
        asked once the process runs (so a :meth:`hurry` reaches it)."""
        try:
            proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            with self._hurry_lock:  # from now on a hurry names this request
                self._seq += 1
                seq = self._seq
            sent = {"job": job, "args": args, "throttle": bool(throttle and throttle()),
                    "urgent": bool(urgent and urgent()), "seq": seq}
            proc.stdin.write(json.dumps(sent) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except OSError as exc:  # could not start it, or it died as the request went out
            self.close(now=True)
            raise RuntimeError(f"the verifier process failed: {type(exc).__name__}: {exc}") from None
        try:
            data = json.loads(line) if line else None
        except ValueError:
            data = None
        if not isinstance(data, dict):
            self.close(now=True)
            raise RuntimeError(f"the verifier process ended without an answer (exit code {proc.poll()})")
        if "protocol_error" not in data and data.pop("seq", None) != seq:
            # an answer to another request: out of step, so no later answer can be trusted either
            self.close(now=True)
            raise RuntimeError("the verifier process answered another request")
        if "result" not in data:
            raise RuntimeError(str(data.get("call_error") or data.get("protocol_error")))
        return data["result"]

    def close(self, *, now: bool = False) -> None:
        """Let the process end (end of its input; killed after 10 s), or with ``now`` end it at once."""
        proc, self._proc = self._proc, None
        self._close_hurry()
        if proc is None:
            return
        if now and proc.poll() is None:
            proc.kill()
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=None if now else 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            if proc.stdout is not None:
                proc.stdout.close()


def restore_priority(nice: int, thread: int | None = None) -> bool:
    """Put the calling thread (or native ``thread``) back in normal scheduling at ``nice``; ``False`` where refused
    (needs ``CAP_SYS_NICE`` or a permissive ``RLIMIT_NICE``)."""
    linux = sys.platform.startswith("linux")
    tid = (thread or threading.get_native_id()) if linux else 0
    try:
        if hasattr(os, "SCHED_OTHER") and hasattr(os, "sched_getscheduler") \
                and os.sched_getscheduler(tid) != os.SCHED_OTHER:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        return False
    return True


def lower_priority(priority: str, *, whole_process: bool = False) -> None:
    """Lower the calling thread's CPU priority (per thread on Linux; elsewhere only with ``whole_process``)."""
    linux = sys.platform.startswith("linux")
    if priority == "normal" or not (linux or whole_process):
        return
    if priority == "idle" and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread (this process's only)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id() if linux else 0, 19)


if __name__ == "__main__":
    sys.exit(main())
