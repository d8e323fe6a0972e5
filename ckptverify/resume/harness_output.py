"""Where a rank's workload output goes: a per-rank log file, or the harness's stdout/stderr with each line labelled ``[A
r0]``.

Traps: redirection works on file descriptors, not ``sys.stdout``, so C extensions and child processes (DataLoader
workers) follow. Parallel runs share the terminal, so each line is written whole (writes of at most ``PIPE_BUF``).
The target check runs user code in the command's own process: :func:`stdout_to_stderr` keeps stdout for the report."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Iterator
from types import TracebackType

__all__ = ["LabelledOutput", "label", "stdout_to_stderr", "to_log_file"]

_ATOMIC = getattr(select, "PIPE_BUF", 512)
#: A "line" longer than this (a progress bar redrawn with ``\r``, never ended) is written out as it stands.
_LONGEST = 1 << 16
#: Drain wait at a job's end (DataLoader workers may still hold the pipe).
_DRAIN_S = 10.0


def label(run: str, rank: int, nproc: int) -> str:
    """``[A]`` on one rank, ``[A r1]`` on several."""
    return f"[{run} r{rank}]" if nproc > 1 else f"[{run}]"


def to_log_file(path: str) -> None:
    """Send this process's stdout and stderr (descriptors 1 and 2) to ``path`` from now on."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    _flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Within the block, everything written to stdout (``sys.stdout`` and descriptor 1, C included) goes to stderr
    instead; stdout is restored afterwards (``--json`` promises one document on stdout)."""
    _flush()
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
        # printf output buffered in C must reach descriptor 1 while it still points at stderr; without a C library
        # to ask (not POSIX) nothing is buffered there either.
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).fflush(None)
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing to flush
            stream.flush()


class LabelledOutput:
    """Within the block, each line on descriptors 1 and 2 (this process or its children) reaches the original with
    ``prefix``; the block's end drains what was written."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix.encode() + b" "
        self._streams: list[tuple[int, int, threading.Thread]] = []

    def __enter__(self) -> LabelledOutput:
        _flush()
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
        _flush()
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
