#!/usr/bin/env python
"""Kill ``ckptverify.save`` / ``async_save`` at random points, then verify and load what is left.

Each kill runs one save job (1 or 2 ranks over gloo, sync or async, one file per rank or one per item, into a
fresh directory or over a committed checkpoint of another step) and SIGKILLs all its ranks, either after a
random delay into the save or at a chosen point inside it (after the directory is locked, after the old
commit records are removed, after the N-th shard file, before the N-th write into a shard, before the
manifest, before the marker is removed). What is left is then verified (``verify_checkpoint``) and loaded
(``ckptverify.load``) in this process, and judged:

* ``refused``: verify fails and load refuses (the save had not committed);
* ``old`` / ``new``: verify and load pass and every tensor and counter is exactly that of the old save or of
  the new one (the kill came before the new save touched the directory, or after it committed);
* ``torn``: verify or load passed something that is not exactly one whole save. There must be none.

Usage::

    python scripts/chaos_save.py --kills 60            # prints "60 kills, 0 torn checkpoints passed"
    python scripts/chaos_save.py --kills 8 --json      # one JSON object

``worker`` is the save job itself (one rank); the driver starts it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers.multiproc import init_group  # noqa: E402

WIDTH, LAYERS = 384, 8
OLD_STEP, NEW_STEP = 1, 2
#: Points inside a save where a worker can kill its job (``NAME`` or ``NAME:N``).
KILL_POINTS = ("locked", "invalidated", "file", "write", "metadata", "manifest")
OUTCOMES = ("refused", "old", "new", "torn")


# ------------------------------------------------------------------------------------------ the job


def make_model(step: int) -> Any:
    """The model a job holds at ``step``: every tensor differs from one step to the next."""
    import torch

    torch.manual_seed(1000 + step)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def make_state(step: int, **kw: Any) -> Any:
    import ckptverify

    state = ckptverify.TrainState(model=make_model(step), **kw)
    state.counters.step = step
    return state


def _die() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)  # every rank of the job at once, like a lost node


def install_kill(spec: str) -> None:
    """Patch this process so that it kills its job at ``spec`` (see :data:`KILL_POINTS`)."""
    import ckptverify.dcp.commit as commit
    import ckptverify.dcp.writer as writer

    name, _, count = spec.partition(":")
    n = int(count or 1)
    seen = [0]

    def after(fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            out = fn(*a, **k)
            _die()
            return out
        return wrapped

    def before(fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            _die()
            return fn(*a, **k)
        return wrapped

    if name == "locked":
        writer.begin_save = after(writer.begin_save)
    elif name == "invalidated":
        writer.invalidate_previous = after(writer.invalidate_previous)
    elif name == "metadata":  # .metadata is in place, the manifest not yet
        writer.write_manifest = before(writer.write_manifest)
    elif name == "manifest":  # the manifest is in place, the marker not yet removed
        commit.SaveLock.commit = before(commit.SaveLock.commit)
    elif name == "file":
        original = writer._HashingFileSystem.create_stream

        @contextlib.contextmanager
        def create_stream(self: Any, path: Any, mode: str) -> Any:
            with original(self, path, mode) as stream:
                yield stream
            if "w" in mode and str(path).endswith(".distcp"):
                seen[0] += 1
                if seen[0] == n:
                    _die()

        writer._HashingFileSystem.create_stream = create_stream
    elif name == "write":
        original_write = writer._HashingStream.write

        def write(self: Any, b: Any) -> int:
            seen[0] += 1
            if seen[0] == n:
                _die()
            return original_write(self, b)

        writer._HashingStream.write = write
    else:
        raise SystemExit(f"unknown kill point {spec!r}; choose from {', '.join(KILL_POINTS)}")


def worker(args: argparse.Namespace) -> None:
    """One rank of a save job: optionally a committed save of the old step, then the save of the new one."""
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    import ckptverify

    if args.world > 1:
        init_group(args.rank, args.world, f"file://{args.rendezvous}")
    kw = {} if args.layout == "single" else {"single_file_per_rank": False}

    def save(state: Any) -> None:
        if args.mode == "async":
            ckptverify.async_save(state, args.path, **kw).result(timeout=300)
        else:
            ckptverify.save(state, args.path, **kw)

    if args.existing:
        save(make_state(OLD_STEP))
        if args.world > 1:
            dist.barrier()
    if (args.late or args.hold) and args.rank == args.late_rank:
        import ckptverify.dcp.writer as writer

        original = writer.HashingFileSystemWriter.write_data

        def late_write_data(self: Any, plan: Any, planner: Any) -> Any:
            time.sleep(args.late)  # this rank starts writing its shards late
            deadline = time.monotonic() + 300
            while args.hold and not os.path.exists(args.hold) and time.monotonic() < deadline:
                time.sleep(0.01)  # ... or only once told to
            return original(self, plan, planner)

        writer.HashingFileSystemWriter.write_data = late_write_data
    if args.kill_at and args.rank == args.kill_rank:
        install_kill(args.kill_at)
    state = make_state(NEW_STEP)
    if args.rank == 0 and args.signal:
        Path(args.signal).write_text(str(time.time()))
    started = time.perf_counter()
    save(state)
    if args.rank == 0 and args.signal:
        Path(args.signal + ".done").write_text(str(time.perf_counter() - started))
    if args.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    # Leave without interpreter teardown: c10d's background threads outlive destroy_process_group here (FSDP
    # keeps the group alive), and a process finalizing around them can abort (see docs/state.md).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------ the driver


@dataclass
class Job:
    world: int = 1
    mode: str = "sync"
    existing: bool = True
    layout: str = "single"
    kill_at: str | None = None
    kill_rank: int = 0
    late: float = 0.0
    late_rank: int = 1
    hold: str | None = None  # the late rank writes only once this file exists

    def describe(self) -> str:
        where = self.kill_at or "random time"
        late = f", rank {self.late_rank} late {self.late}s" if self.late else ""
        return (f"{self.world} rank(s) {self.mode} {'over old' if self.existing else 'fresh'} {self.layout}, "
                f"kill at {where}{late}")


def _worker_args(job: Job, path: Path, rank: int, rendezvous: str, signal_file: str) -> list[str]:
    cmd = ["--path", str(path), "--rank", str(rank), "--world", str(job.world), "--rendezvous", rendezvous,
           "--mode", job.mode, "--layout", job.layout, "--signal", signal_file, "--kill-rank", str(job.kill_rank),
           "--late", str(job.late), "--late-rank", str(job.late_rank)]
    if job.existing:
        cmd.append("--existing")
    if job.kill_at:
        cmd += ["--kill-at", job.kill_at]
    if job.hold:
        cmd += ["--hold", job.hold]
    return cmd


class Zygote:
    """A process that has imported torch and ckptverify once and forks the ranks of each job: a job then
    starts in milliseconds instead of paying the imports (seconds, more on a busy machine) per rank."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, __file__, "zygote"], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self._buf = b""

    def start(self, jobs: list[list[str]], log: str) -> int:
        """Fork one rank per argument list; return the process group of the job."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"ranks": jobs, "log": log}) + "\n").encode())
        self.proc.stdin.flush()
        line = self.reply(timeout=120)
        if line is None:
            raise RuntimeError("the zygote did not start the job")
        return int(line["pgid"])

    def reply(self, timeout: float) -> dict[str, Any] | None:
        """The zygote's next reply, or None if none came within ``timeout`` seconds."""
        import select

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the zygote exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def zygote() -> None:
    """Serve :class:`Zygote` requests on stdin: fork the ranks, report the group, then their exit codes."""
    # Imported once, before forking, so that no rank pays for it.
    import ckptverify
    import ckptverify.checkpoint.load
    import ckptverify.dcp.writer

    del ckptverify

    parser = _parser()
    for line in sys.stdin:
        request = json.loads(line)
        pids: list[int] = []
        for argv in request["ranks"]:
            pid = os.fork()
            if pid == 0:  # a rank
                code = 1
                try:
                    os.setpgid(0, pids[0] if pids else 0)
                    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    sys.stdin.close()
                    worker(parser.parse_args(["worker", *argv]))
                    code = 0
                except BaseException:  # reported through the exit code and the log
                    import traceback

                    traceback.print_exc()
                finally:
                    os._exit(code)
            with contextlib.suppress(OSError):  # the child does the same; whichever runs first wins
                os.setpgid(pid, pids[0] if pids else pid)
            pids.append(pid)
        print(json.dumps({"pgid": pids[0]}), flush=True)
        codes = []
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
        print(json.dumps({"returncodes": codes}), flush=True)


def run_job(job: Job, path: Path, *, kill_after: float | None = None, timeout: float = 240.0,
            zygote: Zygote | None = None) -> dict[str, Any]:
    """Run one save job into ``path``. With ``kill_after``, SIGKILL all its ranks that many seconds after
    the new save starts. Returns how it ended (``killed``, return codes, the seconds the save took if it
    finished). With a ``zygote``, the ranks are forked from it."""
    signal_file = str(path) + ".saving"
    rendezvous = str(path) + ".rendezvous"  # the ranks' file store: a fresh file for each job, no port to race for
    for f in (signal_file, signal_file + ".done", rendezvous):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f)
    if zygote is not None:
        return _run_forked(job, path, kill_after, timeout, zygote, signal_file, rendezvous)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(job.world):
        cmd = [sys.executable, __file__, "worker", *_worker_args(job, path, rank, rendezvous, signal_file)]
        group = {"process_group": 0 if rank == 0 else procs[0].pid}  # one process group per job
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **group))
    pgid = procs[0].pid
    deadline = time.monotonic() + timeout
    killed_by_us = False
    if kill_after is not None:
        while not os.path.exists(signal_file) and time.monotonic() < deadline \
                and any(p.poll() is None for p in procs):
            time.sleep(0.005)
        if os.path.exists(signal_file):
            time.sleep(kill_after)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            killed_by_us = True
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            out, _ = p.communicate()
            outputs.append(b"(timed out)\n" + (out or b""))
            continue
        outputs.append(out or b"")
    done = Path(signal_file + ".done")
    seconds = float(done.read_text()) if done.exists() else None
    return {"returncodes": [p.returncode for p in procs], "killed": killed_by_us or any(
        p.returncode == -signal.SIGKILL for p in procs), "save_seconds": seconds,
        "output": b"".join(outputs).decode(errors="replace")[-4000:]}


def _run_forked(job: Job, path: Path, kill_after: float | None, timeout: float, zygote: Zygote,
                signal_file: str, rendezvous: str) -> dict[str, Any]:
    log = str(path) + ".log"
    pgid = zygote.start([_worker_args(job, path, rank, rendezvous, signal_file) for rank in range(job.world)], log)
    deadline = time.monotonic() + timeout
    killed_by_us = timed_out = False
    reply = None
    if kill_after is not None:
        while not os.path.exists(signal_file) and time.monotonic() < deadline:
            reply = zygote.reply(timeout=0.002)
            if reply is not None:
                break  # the job ended before its save began (it failed)
        if reply is None and os.path.exists(signal_file):
            reply = zygote.reply(timeout=kill_after)
            if reply is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                killed_by_us = True
    if reply is None:
        reply = zygote.reply(timeout=max(0.0, deadline - time.monotonic()))
    if reply is None:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        reply = zygote.reply(timeout=60) or {"returncodes": []}
    codes = reply["returncodes"]
    done = Path(signal_file + ".done")
    output = Path(log).read_text(errors="replace")[-4000:] if os.path.exists(log) else ""
    return {"returncodes": codes, "killed": killed_by_us or any(c == -signal.SIGKILL for c in codes),
            "save_seconds": float(done.read_text()) if done.exists() else None,
            "output": ("(timed out)\n" if timed_out else "") + output}


def judge(path: Path, *, existing: bool) -> tuple[str, str]:
    """Verify and load what a killed job left; return (outcome, detail)."""
    import warnings

    import torch

    import ckptverify
    from ckptverify.audit.verify import verify_checkpoint
    from ckptverify.errors import CkptVerifyError

    try:
        verified = verify_checkpoint(path, jobs=1).passed
    except CkptVerifyError:
        verified = False  # e.g. the directory was never created
    state = make_state(-1, allow_reseed=True)  # 2-rank saves are loaded by this one process
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = ckptverify.load(state, path).passed
    except CkptVerifyError as exc:
        loaded, why = False, f"{type(exc).__name__}: {str(exc)[:160]}"
    else:
        why = ""
    if not verified and not loaded:
        return "refused", why
    step = state.counters.step
    allowed = {NEW_STEP, OLD_STEP} if existing else {NEW_STEP}
    exact = step in allowed and all(
        torch.equal(a, b) for a, b in zip(state.model.state_dict().values(),
                                          make_model(step).state_dict().values(), strict=True))
    if not (verified and loaded and exact):
        return "torn", f"verify passed={verified}, load passed={loaded}, step {step}, exact={exact} {why}"
    return ("old" if step == OLD_STEP else "new"), ""


def random_job(rng: random.Random) -> Job:
    job = Job(world=rng.choice([1, 2]), mode=rng.choice(["sync", "async"]), existing=rng.random() < 0.7,
              layout=rng.choice(["single", "per-item"]))
    if job.world == 2 and rng.random() < 0.3:
        job.late, job.late_rank = round(rng.uniform(0.1, 0.6), 2), rng.choice([0, 1])
    if rng.random() < 0.5:
        point = rng.choice(KILL_POINTS)
        if point == "file":
            point += f":{rng.randint(1, 6 if job.layout == 'per-item' else 1)}"
        elif point == "write":
            point += f":{rng.randint(1, 40)}"
        job.kill_at = point
        # Shard writes happen on every rank; the commit steps on the coordinator only.
        job.kill_rank = rng.randrange(job.world) if point.startswith(("file", "write")) else 0
    return job


def chaos(kills: int, seed: int, workdir: Path, log: Any = None) -> dict[str, Any]:
    """Run ``kills`` killed save jobs; return the counts of each outcome and the torn cases."""
    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    torn: list[dict[str, Any]] = []
    hung = 0
    durations: dict[tuple[int, str, str], list[float]] = {}
    started = time.perf_counter()
    zygote = Zygote()
    try:
        for i in range(kills):
            job = random_job(rng)
            path = workdir / f"ckpt-{i}"
            kill_after = None
            key = (job.world, job.mode, job.layout)
            if job.kill_at is None:
                if key not in durations:  # calibrate: one uninterrupted save of this kind
                    cal = workdir / f"calibrate-{len(durations)}"
                    got = run_job(Job(world=job.world, mode=job.mode, existing=False, layout=job.layout), cal,
                                  zygote=zygote)
                    durations[key] = [got["save_seconds"] or 1.0]
                    shutil.rmtree(cal, ignore_errors=True)
                # A random instant of the save, by the median time saves of this kind took so far.
                seen = sorted(durations[key])
                kill_after = rng.uniform(0.0, 1.2 * seen[len(seen) // 2] + job.late)
            result = run_job(job, path, kill_after=kill_after, zygote=zygote)
            if result["save_seconds"] is not None:
                durations.setdefault(key, []).append(result["save_seconds"])
            if "(timed out)" in result["output"]:
                hung += 1
            outcome, detail = judge(path, existing=job.existing)
            counts[outcome] += 1
            by_kind[f"{'random' if job.kill_at is None else job.kill_at.split(':')[0]}:{outcome}"] += 1
            if outcome == "torn":
                torn.append({"job": asdict(job), "kill_after": kill_after, "detail": detail,
                             "output": result["output"][-1500:]})
            if log is not None:
                when = f"{kill_after:.3f}s" if kill_after is not None else job.kill_at
                print(f"[{i + 1}/{kills}] {job.describe()} ({when}): {outcome} {detail}", file=log, flush=True)
            shutil.rmtree(path, ignore_errors=True)
    finally:
        zygote.close()
    return {"kills": kills, "torn_passed": counts["torn"], "outcomes": {k: counts[k] for k in OUTCOMES},
            "by_kill_kind": dict(sorted(by_kind.items())), "hung": hung, "seed": seed,
            "seconds": round(time.perf_counter() - started, 1), "torn": torn}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("zygote", help="fork the ranks of jobs read from stdin (started by the driver)")
    w = sub.add_parser("worker", help="one rank of a save job (started by the driver)")
    w.add_argument("--path", required=True)
    w.add_argument("--rank", type=int, default=0)
    w.add_argument("--world", type=int, default=1)
    w.add_argument("--rendezvous", help="file of the ranks' store (world > 1)")
    w.add_argument("--mode", choices=["sync", "async"], default="sync")
    w.add_argument("--layout", choices=["single", "per-item"], default="single")
    w.add_argument("--existing", action="store_true")
    w.add_argument("--kill-at")
    w.add_argument("--kill-rank", type=int, default=0)
    w.add_argument("--late", type=float, default=0.0)
    w.add_argument("--late-rank", type=int, default=1)
    w.add_argument("--signal")
    w.add_argument("--hold", help="the late rank starts writing only once this file exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    parser.add_argument("--kills", type=int, default=50, help="killed saves to run (default 50)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="where to save (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no line per kill")
    args = parser.parse_args(argv)
    if args.command == "worker":
        worker(args)
        return 0
    if args.command == "zygote":
        zygote()
        return 0
    with tempfile.TemporaryDirectory(prefix="chaos-save-", dir=args.workdir) as tmp:
        result = chaos(args.kills, args.seed, Path(tmp), log=None if args.quiet or args.json else sys.stderr)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        outcomes = ", ".join(f"{k} {v}" for k, v in result["outcomes"].items())
        print(f"{result['kills']} kills, {result['torn_passed']} torn checkpoints passed ({outcomes}; "
              f"{result['hung']} hung; {result['seconds']} s)")
        for case in result["torn"]:
            print(json.dumps(case, indent=1))
    return 0 if result["torn_passed"] == 0 and result["hung"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
