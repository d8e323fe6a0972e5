"""Child processes forked from one long-lived server that imported torch, ckptverify (and more) once.

For tests that need a *separate process* (a memory limit, a timeout that ends a hang, a crash by signal that must
not take the test with it, a canary that must not be created by the command line) but not a *fresh interpreter*:
``python -c``/``python -m ckptverify`` pays 2-4 s of CPU to import torch each time; a child forked from the server
pays only for its own work. Each child is a real process: its own address space and resource limits, its
descriptors 0-2 (stdin ``/dev/null``, stdout and stderr to files), its exit status as the server's ``waitpid``
sees it (negative: the signal that ended it), killed when it runs past its timeout. It runs the code it is given
as ``python -c CODE ARGV...`` would run it: as ``__main__``, ``sys.argv`` set, ``SystemExit`` turned into the exit
status, an uncaught exception printed as a traceback (exit 1), ``atexit`` handlers and non-daemon threads waited
for at the end.

What a fresh interpreter does and a child does not: import what it imports (the server did, once, before any
child). Tests about start-up or imports themselves keep their fresh interpreters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CLI_MAIN", "Done", "PreloadedServer"]

ROOT = Path(__file__).resolve().parents[2]

#: The code of ``python -m ckptverify``: what ``runpy`` runs for ``-m``.
CLI_MAIN = "import runpy\nrunpy.run_module('ckptverify', run_name='__main__', alter_sys=True)\n"

_SERVER = textwrap.dedent(r"""
    import importlib, json, os, select, signal, sys, time, types

    for name in sys.argv[1:]:
        importlib.import_module(name)
    requests, answers = sys.stdin, os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # nothing a child writes by mistake can reach the answers
    answers.write("ready\n")
    answers.flush()


    def child(req):
        code = 1
        try:
            os.close(answers.fileno())
            os.dup2(null, 0)
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(f, fd)
                os.close(f)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.chdir(req["cwd"])
            os.environ.update(req["env"])
            sys.argv = req["argv"]
            code = 0
            main = types.ModuleType("__main__")  # as ``python -c``: the code runs as the module __main__
            sys.modules["__main__"] = main
            try:
                exec(compile(req["code"], "<string>", "exec"), main.__dict__)
            except SystemExit as exc:
                if exc.code is None:
                    code = 0
                elif isinstance(exc.code, int):
                    code = exc.code
                else:
                    print(exc.code, file=sys.stderr)
                    code = 1
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            import atexit, threading
            threading._shutdown()  # as the interpreter does at exit: wait for non-daemon threads
            atexit._run_exitfuncs()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code & 0xFF)


    def ended(pid, timeout):
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd: poll
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
                time.sleep(0.01)
            return False
        try:
            return bool(select.select([fd], [], [], timeout)[0])
        finally:
            os.close(fd)


    def wait(pid, timeout):
        if not ended(pid, timeout):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)


    for line in requests:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(req)
        start = time.monotonic()
        code = wait(pid, req["timeout"])
        answers.write(json.dumps({"returncode": code, "seconds": time.monotonic() - start}) + "\n")
        answers.flush()
""")


@dataclass(frozen=True)
class Done:
    """What ``subprocess.run`` would have returned (``returncode`` negative: ended by that signal), and whether it
    ran past its timeout (then it was killed, ``returncode`` is None)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


class PreloadedServer:
    """A server process that imported ``preload``; :meth:`run` forks a child of it per call. Close it (or use it
    as a context manager) to end the server; its children's CPU time then counts to this process's children."""

    def __init__(self, preload: Iterable[str], env: Mapping[str, str] | None = None) -> None:
        base = dict(os.environ if env is None else env)
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH")) if p)
        self._tmp = tempfile.TemporaryDirectory(prefix="preloaded-children-")
        self._count = 0
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, *preload], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=base)
        assert self._proc.stdout is not None
        ready = self._proc.stdout.readline()
        if ready != "ready\n":
            self.close()
            raise RuntimeError(f"the preloading server did not start (exit {self._proc.returncode})")

    def run(self, code: str, *args: str, timeout: float, env: Mapping[str, str] | None = None,
            cwd: str | os.PathLike[str] | None = None, argv0: str = "-c") -> Done:
        """``python -c CODE ARGS`` in a child forked from the server (``env`` added to the server's
        environment), under ``timeout`` seconds."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._count += 1
        out = os.path.join(self._tmp.name, f"{self._count}.out")
        err = os.path.join(self._tmp.name, f"{self._count}.err")
        request = {"code": code, "argv": [argv0, *args], "timeout": timeout, "env": dict(env or {}),
                   "cwd": str(cwd if cwd is not None else os.getcwd()), "stdout": out, "stderr": err}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the preloading server died (exit {self._proc.poll()})")
        answer = json.loads(line)
        texts = []
        for path in (out, err):
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
            os.unlink(path)
        return Done(answer["returncode"], texts[0], texts[1], answer["returncode"] is None)

    def cli(self, *args: str, timeout: float, env: Mapping[str, str] | None = None) -> Done:
        """``python -m ckptverify ARGS`` in a child forked from the server."""
        return self.run(CLI_MAIN, *args, timeout=timeout, env=env)

    def script(self, path: str | os.PathLike[str], *args: str, timeout: float,
               env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> Done:
        """``python PATH ARGS`` in a child forked from the server: the script runs as ``__main__``, its folder
        first on ``sys.path``."""
        path = os.path.abspath(path)
        code = (f"import runpy, sys\nsys.path.insert(0, {os.path.dirname(path)!r})\n"
                f"runpy.run_path({path!r}, run_name='__main__')\n")
        return self.run(code, *args, timeout=timeout, env=env, cwd=cwd, argv0=path)

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._tmp.cleanup()

    def __enter__(self) -> PreloadedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
