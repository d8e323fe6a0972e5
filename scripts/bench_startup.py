"""Benchmark the start-up of ``ckptverify verify``: what a cron job or ``watch`` pays once per checkpoint.

    python scripts/bench_startup.py [--runs 21] [--cold-bytecode] [--compare-with CHECKOUT] [--dir DIR] [--keep]

Builds a tiny DCP checkpoint (two small tensors and a step counter, one process), then times, alternating
the commands on every run, the median wall time of ``N`` runs of:

- ``python -c pass``: the interpreter's own start, the floor no command gets under;
- ``python -m ckptverify verify --json DIR`` and ``python -m ckptverify verify DIR`` (text report):
  the whole command on a checkpoint whose reading costs next to nothing, so the time is start-up.

Prints each median, each verify's ratio to the interpreter's start and its start-up above it, whether the
target (``verify`` start-up <= 0.2 s, the whole command) is met, and the ten modules with the largest import
time of ``python -X importtime -m ckptverify verify --json DIR`` (self time, and with what they import).
``--compare-with CHECKOUT`` times another checkout's commands in the same run, alternating with this one's
(start-up moves with the machine's load: figures from separate runs do not compare).

The commands import the ``ckptverify`` of the checkout this script is in (put first on ``PYTHONPATH``).
Bytecode: an installed package carries its compiled ``.pyc`` files, so by default the commands run with
bytecode caching allowed (``PYTHONDONTWRITEBYTECODE`` is dropped from their environment) after one warm-up
run of each. ``--cold-bytecode`` instead compiles ckptverify's modules from source on every run (a copy of
the package without ``__pycache__``, no bytecode written), as an environment with
``PYTHONDONTWRITEBYTECODE=1`` and a source checkout does. Exit 0 when every verify run passed (whatever
the times), 2 when one did not.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_S = 0.2


def build(path: str) -> None:
    """A tiny DCP checkpoint at ``path``, written in a subprocess (this process never imports torch)."""
    code = (
        "import warnings, torch, torch.distributed.checkpoint as dcp\n"
        "warnings.simplefilter('ignore')\n"
        "g = torch.Generator().manual_seed(0)\n"
        "state = {'model': {'w': torch.randn(16, 16, generator=g), 'b': torch.zeros(16)}, 'step': 3}\n"
        f"dcp.save(state, storage_writer=dcp.FileSystemWriter({path!r}))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


#: The checkout this script sits in: the commands import its ``ckptverify``, not another installed one.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(cold: bool, scratch: str, repo: str = REPO) -> dict[str, str]:
    """The commands' environment: ``repo``'s package first on the path; with ``cold``, a copy of that package
    without its ``__pycache__`` in ``scratch``, and no bytecode written (the interpreter's and the libraries'
    own cached bytecode is read as usual, as in an environment with ``PYTHONDONTWRITEBYTECODE=1``)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if cold:
        copy = tempfile.mkdtemp(dir=scratch)
        shutil.copytree(os.path.join(repo, "ckptverify"), os.path.join(copy, "ckptverify"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        repo = copy
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    return env


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    start = time.perf_counter()
    # Run from a neutral folder: `python -m` puts the working directory first on sys.path.
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    return time.perf_counter() - start, done.returncode


def import_top(cmd: list[str], env: dict[str, str], n: int = 10) -> list[tuple[int, int, str]]:
    """The ``n`` modules with the largest self import time (microseconds), with their cumulative time."""
    done = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())
    rows = []
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), m.group(4)))
    return sorted(rows, reverse=True)[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=21, help="runs of each command; the median is reported")
    ap.add_argument("--cold-bytecode", action="store_true",
                    help="compile ckptverify's modules from source on every run")
    ap.add_argument("--dir", default=None, help="where to build the checkpoint [default: a temporary folder]")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--compare-with", metavar="CHECKOUT", default=None,
                    help="also time the verify commands of another checkout (e.g. a `git worktree` of an older "
                         "commit), alternating with this one's, so that both meet the same load")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.compare_with is not None and not os.path.isfile(os.path.join(args.compare_with, "ckptverify",
                                                                         "__init__.py")):
        ap.error(f"--compare-with {args.compare_with}: not a checkout of ckptverify")

    work = args.dir or tempfile.mkdtemp(prefix="ckptverify-bench-startup-")
    ckpt = os.path.join(work, "ckpt")
    scratch = tempfile.mkdtemp(prefix="ckptverify-bench-source-")
    try:
        build(ckpt)
        env = child_env(args.cold_bytecode, scratch)
        py = sys.executable
        verify_json = [py, "-m", "ckptverify", "verify", "--json", ckpt]
        verify_text = [py, "-m", "ckptverify", "verify", ckpt]
        commands = {
            "python -c pass": ([py, "-c", "pass"], env),
            "verify --json": (verify_json, env),
            "verify (text)": (verify_text, env),
        }
        if args.compare_with is not None:
            other = child_env(args.cold_bytecode, scratch, os.path.abspath(args.compare_with))
            commands["compared --json"] = (verify_json, other)
            commands["compared (text)"] = (verify_text, other)
        for cmd, cmd_env in commands.values():  # warm-up: the page cache, the .pyc files (unless --cold-bytecode)
            timed(cmd, cmd_env)
        times: dict[str, list[float]] = {name: [] for name in commands}
        failed = []
        for _ in range(args.runs):
            for name, (cmd, cmd_env) in commands.items():
                seconds, rc = timed(cmd, cmd_env)
                times[name].append(seconds)
                if rc != 0:
                    failed.append(f"{name} exited {rc}")
        if failed:
            print(f"error: verify of the benchmark checkpoint did not pass: {failed[0]}", file=sys.stderr)
            return 2

        base = statistics.median(times["python -c pass"])
        mode = "ckptverify compiled from source each run" if args.cold_bytecode else "bytecode cached (as installed)"
        print(f"start-up of `python -m ckptverify verify`, median of {args.runs} runs, {mode}")
        print(f"  {'python -c pass':<16} {base:7.3f} s")
        if args.compare_with is not None:
            print(f"  (compared: the checkout at {args.compare_with})")
        for name in [n for n in commands if n != "python -c pass"]:
            med = statistics.median(times[name])
            met = "met" if med <= TARGET_S else "NOT met"
            print(f"  {name:<16} {med:7.3f} s   {med / base:5.1f}x interpreter start, +{med - base:.3f} s above it; "
                  f"target <= {TARGET_S} s {met}")
        print("top 10 imports of `verify --json` (python -X importtime; microseconds):")
        print(f"  {'self':>8} {'cumulative':>10}  module")
        for self_us, cum_us, module in import_top(verify_json, env):
            print(f"  {self_us:>8} {cum_us:>10}  {module}")
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            print(f"checkpoint kept at {ckpt}")


if __name__ == "__main__":
    sys.exit(main())
