"""Where a rank's workload output goes while the harness runs it.

Either a per-rank log file (``<log_dir>/<run>-rank<r>.log``: the command's stdout stays machine-readable), or
the harness's own stdout and stderr with every line labelled by its run, and by its rank when there are several:
``[A r0] step 3 loss 1.25``. Runs A and A2 may run side by side, each with several ranks, all writing to the same
terminal: labels say whose line it is, and each line is written whole (one ``write`` of at most ``PIPE_BUF``
bytes holds only whole lines, and a pipe or terminal does not split it).

Both work on the file descriptors, not on ``sys.stdout``: output of C extensions, of ``print`` and of the
processes the workload starts (DataLoader workers inherit descriptors 1 and 2) goes the same way.

The user's code also runs once in the command's own process, when its target is checked before any rank starts
(the file is imported: a script that prints at module level prints then). :func:`stdout_to_stderr` sends that
output to stderr, so the command's stdout holds nothing but its report.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Iterator
from types import TracebackType

__all__ = ["LabelledOutput", "label", "stdout_to_stderr", "to_log_file"]

#: Bytes one write may hold and still reach a pipe in one piece (POSIX ``PIPE_BUF``).
_ATOMIC = getattr(select, "PIPE_BUF", 512)
#: A "line" longer than this (a progress bar redrawn with ``\r``, never ended) is written out as it stands.
_LONGEST = 1 << 16
#: How long the end of a job waits for its output to drain (DataLoader workers may still hold the pipe).
_DRAIN_S = 10.0


def label(run: str, rank: int, nproc: int) -> str:
    """``[A]`` on one rank, ``[A r1]`` on several."""
    return f"[{run} r{rank}]" if nproc > 1 else f"[{run}]"


def to_log_file(path: str) -> None:
    """Send this process's stdout and stderr (descriptors 1 and 2) to ``path`` from now on."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Within the block, whatever this process writes to its standard output (``sys.stdout`` and descriptor 1,
    C extensions included) goes to its standard error instead; afterwards stdout is as it was.

    For the user's code run in the command's own process: ``--json`` promises one JSON document on stdout
    whatever the training script prints.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing to flush
            stream.flush()
    try:
        saved: int | None = os.dup(1)
    except OSError:  # no descriptor 1 (a daemon): nothing there to protect
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        _flush_c_stdio()  # printf output buffered in C must reach descriptor 1 while it still points at stderr
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _flush_c_stdio() -> None:
    import ctypes

    with contextlib.suppress(Exception):  # no C library to ask (not POSIX): nothing buffered there either
        ctypes.CDLL(None).fflush(None)


class LabelledOutput:
    """Within the block, each line written to descriptors 1 and 2 (by this process or its children) reaches
    the original descriptor with ``prefix`` and a space before it; the block's end drains what was written."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix.encode() + b" "
        self._streams: list[tuple[int, int, threading.Thread]] = []

    def __enter__(self) -> LabelledOutput:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            original = os.dup(fd)
            read, write = os.pipe()
            os.dup2(write, fd)  # inheritable: started processes write here too
            os.close(write)
            pump = threading.Thread(target=_pump, args=(read, original, self._prefix), daemon=True,
                                    name=f"ckptverify-output-{fd}")
            pump.start()
            self._streams.append((fd, original, pump))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing to flush
                stream.flush()
        for fd, original, _ in self._streams:
            os.dup2(original, fd)  # closes this process's end of the pipe: the pump sees the end of it
        for _, original, pump in self._streams:
            # After an error the traceback may keep the workload's DataLoader workers (holding the pipe) alive.
            pump.join(_DRAIN_S if exc is None else 1.0)
            if not pump.is_alive():
                os.close(original)
        self._streams = []


def _pump(read: int, out: int, prefix: bytes) -> None:
    pending = b""
    try:
        while True:
            chunk = os.read(read, 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            if len(pending) > _LONGEST:
                lines.append(pending)
                pending = b""
            if lines:
                _write_lines(out, [prefix + line + b"\n" for line in lines])
        if pending:
            _write_lines(out, [prefix + pending + b"\n"])
    except OSError:
        pass  # the original descriptor went away: nowhere left to write
    finally:
        os.close(read)


def _write_lines(out: int, lines: list[bytes]) -> None:
    """Write whole lines, grouped into writes of at most ``PIPE_BUF`` bytes (a longer line alone)."""
    batch = b""
    for line in lines:
        if batch and len(batch) + len(line) > _ATOMIC:
            _write_all(out, batch)
            batch = b""
        batch += line
    if batch:
        _write_all(out, batch)


def _write_all(out: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(out, view):]
