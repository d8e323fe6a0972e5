"""The verifier process: verifies and stamps checkpoints for a :class:`~ckptverify.runs.background.BackgroundVerifier`
in another process, so that hashing never contends with the training process for its interpreter lock.

    python -m ckptverify.runs.verify_worker

Reads one JSON request per line on standard input (``path``, ``step``, ``deep``, ``jobs``, ``settle``; the
parent holds the checkpoint's verifying lock meanwhile) and writes one JSON
:class:`~ckptverify.runs.background.Verification` per line on the standard output it was started with; anything
else printed goes to standard error. Runs at the lowest CPU priority (``SCHED_IDLE``, nice 19; the parent may
ask for another with ``CKPTVERIFY_VERIFY_PRIORITY``), without torch.
Ends at the end of its input (its parent closed the pipe, or died).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def serve(requests: Any, replies: Any) -> None:
    """Answer every request line of ``requests`` with one line on ``replies``."""
    from ckptverify.runs.background import Verification, from_outcome
    from ckptverify.runs.stamper import stamp_locked

    for line in requests:
        try:
            req = json.loads(line)
            path, step, deep = str(req["path"]), req.get("step"), bool(req.get("deep"))
        except (ValueError, KeyError, TypeError) as exc:
            replies.write(json.dumps({"protocol_error": f"{type(exc).__name__}: {exc}"}) + "\n")
            replies.flush()
            continue
        try:
            outcome = stamp_locked(path, step=step, jobs=req.get("jobs") or 1, deep=deep,
                                   settle=float(req.get("settle", 1.0)))
            result = from_outcome(path, step, deep, outcome)
        except Exception as exc:  # one request's failure is its result; the process serves the next one
            result = Verification(path=path, step=step, verdict="unverified", deep=deep,
                                  reason=f"the verification itself failed: {type(exc).__name__}: {exc}")
        replies.write(json.dumps(result.to_dict(), default=str) + "\n")
        replies.flush()


def main() -> int:
    from ckptverify.runs.background import PRIORITIES, lower_priority

    priority = os.environ.get("CKPTVERIFY_VERIFY_PRIORITY", "idle")
    lower_priority(priority if priority in PRIORITIES else "idle", whole_process=True)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints cannot corrupt the replies
    serve(sys.stdin, replies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
