"""``ckptverify ...`` run in the test's own process (click's CliRunner), answered like a finished subprocess.

For tests where the command's words, exit code and JSON are the point, not the process that prints them: a fresh
``python -m ckptverify`` pays an interpreter, an import of torch and a fork server of its own, while in-process the
runs it launches come from this process's fork server (already warm after the first). The command goes through
the same ``main`` (its exit codes and error printing included) as ``python -m ckptverify`` does.

Keep a real process where the process is the point: output written to descriptors 1 and 2 (labelled rank lines,
a JSON stdout kept clean of what the user's code prints), signals, exit status of the interpreter itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner

__all__ = ["Done", "invoke"]


@dataclass(frozen=True)
class Done:
    """What ``subprocess.run`` would have returned: ``returncode``, ``stdout``, ``stderr``."""

    returncode: int
    stdout: str
    stderr: str


def invoke(*args: str, cwd: Path | str | None = None, env: Mapping[str, str | None] | None = None) -> Done:
    """Run ``ckptverify ARGS`` in this process from ``cwd`` (the working directory is restored after), with ``env``
    set for the call (a value of ``None`` unsets the variable)."""
    from ckptverify.cli import main

    with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
        result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=True)
    # The command ends by sys.exit (its exit code) or returns: any other exception is a crash that a real process
    # would have shown as a traceback; fail here with it instead of reading it as an exit code.
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"ckptverify {' '.join(args)} raised {result.exception!r}\n{result.stderr[-4000:]}") \
            from result.exception
    return Done(result.exit_code, result.stdout, result.stderr)
