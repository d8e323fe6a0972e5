"""Launching a workload: each ``(target, RunConfig)`` job in a fresh set of processes, one per rank.

Processes come from a fork server that imported torch and ckptverify once (``forkserver`` with preloaded
modules; ``spawn`` where the platform has no fork server): each rank is still a fresh process that shares no
training state with any other run, and starts in milliseconds rather than the seconds an import of torch costs.
The server never initialises CUDA. Gloo on CPU, NCCL (with gloo beside it for host tensors) and one GPU per rank
on CUDA: rank ``r`` uses ``cuda:r``, so ``nproc`` may not exceed the visible devices (refused before any process
starts). A rank that fails leaves its process group without tearing it down (peers may sit in a collective
that would never complete), so the launch reports the crash at once instead of waiting. A rank runs its jobs in turn
in one process; its output goes to a per-rank log file or to the terminal labelled with the run (and rank). A
failure comes back as the user's error: :class:`~ckptverify.resume.harness_target.TargetError` (a usage error,
with the user's line at fault) or :class:`WorkloadCrashedError` (the user's traceback).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ckptverify.errors import UsageError, WorkloadCrashedError
from ckptverify.ownfiles.names import own_folder, write_atomic
from ckptverify.resume.harness_target import (
    TargetError,
    check_target,
    load_target,
    never_restored_message,
    usage_text,
    user_traceback,
)
from ckptverify.resume.run import Run, RunConfig, _group_backend, harness_job

T = TypeVar("T")

__all__ = ["WorkloadCrashedError", "at_once", "launch_jobs", "launches_at_once", "start_method", "workload_logs"]


def _unused_port() -> int:
    """A port no socket holds now: only for the ``MASTER_PORT`` a workload written for torchrun may read. The
    ranks' own group meets through a file store, never through it (no bind-and-release race between launches
    running side by side)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: torchdata's ``StatefulDataLoader`` calls ``torch.set_vital``, which torch deprecates with this warning: one
#: line per rank of every run, about neither the user's code nor ours. Only it is ignored (message, category
#: and the module that triggers it), in the ranks this module starts; every other warning shows as it would.
def _quiet_known_noise() -> None:
    import warnings

    warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated", category=UserWarning,
                            module=r"torchdata\.stateful_dataloader\.")


#: What the fork server imports before it forks any rank: torch, and what a rank of a run with saves and a
#: trace imports on its way (the first optimizer alone imports torch._dynamo: seconds per process). None of it
#: initialises CUDA.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
            "torch.distributed.tensor", "torch.multiprocessing", "zarr", "ckptverify", "ckptverify.resume.launch",
            "ckptverify.resume.run", "ckptverify.checkpoint.save", "ckptverify.checkpoint.load",
            "ckptverify.trace.recorder", "ckptverify.trace.store", "ckptverify.verifier.background"]


def start_method() -> str:
    """How ranks are started: ``"forkserver"`` (its server preloading torch and ckptverify) where the platform
    has it, else ``"spawn"``."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts, once per process
    return "forkserver"


def _take_environment(env: dict[str, str]) -> None:
    """Make this rank's environment the launcher's as it is now. A process forked from the fork server has the
    server's, from when it started; a spawned one already has this one."""
    import multiprocessing

    import torch

    os.environ.clear()
    os.environ.update(env)
    # multiprocessing made the launch's start method this process's default: the workload's own processes
    # (DataLoader workers) start as in a plain run instead (fork on Linux: from this rank, torch imported).
    multiprocessing.set_start_method(None, force=True)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch read it when the server imported it
        torch.set_num_threads(int(threads))


def _worker(rank: int, nproc: int, store: str, port: int, jobs: list[tuple[str, str]], device: str,
            env: dict[str, str]) -> None:
    """One rank: run each ``(target, RunConfig JSON)`` of ``jobs`` in turn, in this one process, with ``env``
    as its environment. The ranks meet through the file store ``store`` (a path in a folder of this launch
    alone). On ``device`` ``"cuda"`` the rank uses ``cuda:{rank}``."""
    import torch
    import torch.distributed as dist

    _take_environment(env)
    _quiet_known_noise()

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if device == "cuda":
        # Every rank, a single one too: the workload's bare "cuda" and the RNG state it saves mean this device.
        torch.cuda.set_device(rank)
    if nproc > 1:
        # device_id: NCCL binds its communicator to the rank's device now, not to whatever is current later.
        bound = {"device_id": torch.device("cuda", rank)} if device == "cuda" else {}
        dist.init_process_group(_group_backend(device, torch.cuda.is_available()), init_method=f"file://{store}",
                                rank=rank, world_size=nproc, **bound)
        _tolerate_init(dist)
    try:
        for target, config_json in jobs:
            _run_job(rank, nproc, target, config_json)
    except BaseException:
        if nproc > 1 and dist.is_initialized():
            _abandon_group(dist)
        raise
    if nproc > 1 and dist.is_initialized():
        dist.destroy_process_group()
    if nproc > 1:
        # Every job succeeded and its files are written: leave without interpreter teardown. After FSDP2 or DDP
        # used a gloo group, destroy_process_group leaves its threads alive, and finalizing the interpreter
        # around them now and then aborts the process (SIGABRT), which would fail a check that passed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _abandon_group(dist: Any) -> None:
    """Leave the process group of a rank that failed, without waiting for its peers.

    ``destroy_process_group`` waits for the group's pending work, and the peers may sit in a collective this
    rank will never join (with NCCL until the watchdog's timeout, minutes): the rank would never exit, and the
    launch would wait for it. NCCL's communicators are aborted instead (their peers' collectives then fail);
    a gloo group is left as it is: its peers' collectives fail when this process's connections close at exit.
    """
    with contextlib.suppress(Exception):  # leaving must not hide the failure being raised
        from torch.distributed.distributed_c10d import _abort_process_group

        if "nccl" in str(dist.get_backend()):
            _abort_process_group()


def _check_devices(nproc: int, device: str) -> None:
    """Refuse, before any process starts, ``nproc`` ranks that do not each get a CUDA device of their own."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible to this process")
    count = torch.cuda.device_count()
    if nproc > count:
        raise UsageError(f"--nproc {nproc} on --device cuda needs one CUDA device per rank, but {count} "
                         f"{'is' if count == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES)")


def _run_job(rank: int, nproc: int, target: str, config_json: str) -> None:
    from ckptverify.resume.harness_output import LabelledOutput, label, to_log_file

    config = RunConfig.from_json(config_json)
    if config.log_dir:
        # The workload's prints go to a per-rank log file, so the command's own stdout stays machine-readable.
        to_log_file(os.path.join(config.log_dir, f"{config.name}-rank{rank}.log"))
        with harness_job(config):
            _call_target(rank, nproc, target, config)
    else:
        with LabelledOutput(label(config.name, rank, nproc)), harness_job(config):
            try:
                _call_target(rank, nproc, target, config)
            finally:
                # The workload's objects end now (DataLoader workers among them, which hold the output pipe),
                # not whenever a reference cycle is collected: its output is then drained at once.
                gc.collect()
                _end_loader_workers()


def _end_loader_workers() -> None:
    """Stop the worker processes of every DataLoader iterator still alive once the training function returned
    (one the workload keeps, directly or through the sampler that notes its seed): they hold the output pipe
    open, and its end would otherwise wait for them, seconds per run."""
    for obj in gc.get_objects():
        if type(obj).__name__.endswith("MultiProcessingDataLoaderIter"):
            with contextlib.suppress(Exception):  # torch's private teardown: best effort, the run is over
                obj._shutdown_workers()


def _call_target(rank: int, nproc: int, target: str, config: RunConfig) -> None:
    """Run the training function once; on failure, leave what the user needs to see in the trace folder:
    ``usage-rank<r>.txt`` (a usage error: its message and the user's lines) or ``error-rank<r>.txt`` (the
    user's traceback), then re-raise."""
    import torch.distributed as dist

    run: Run | None = None
    try:
        func = load_target(target)
        run = Run(config)
        try:
            func(run)
            if run.state is None:
                raise UsageError(never_restored_message(target))
        finally:
            run.close()
        if nproc > 1 and dist.is_initialized():
            dist.barrier()  # no rank tears down while another is still in a collective
    except BaseException as exc:
        if config.trace_dir:
            trace_dir = own_folder(config.trace_dir)
            if isinstance(exc, TargetError):
                kind, text = "usage", str(exc)
            elif isinstance(exc, UsageError) and run is not None and run.state is None and _from_save(exc):
                kind, text = "usage", never_restored_message(target)  # the first checkpoint, and no state
            elif isinstance(exc, UsageError):
                kind, text = "usage", usage_text(exc)
            else:
                kind, text = "error", user_traceback(exc)
            write_atomic(os.path.join(trace_dir, f"{kind}-rank{rank}.txt"), text, prefix=f".{kind}-rank{rank}.",
                         durable=False)
        raise


def _from_save(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by ``Run._save`` (a checkpoint the harness asked for)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].name == "_save" and os.path.basename(frames[-1].filename) == "run.py"


def _tolerate_init(dist: Any) -> None:
    """Make the workload's own ``init_process_group`` call a no-op while the harness's group exists (a script
    written for torchrun calls it unconditionally)."""
    original = dist.init_process_group
    if getattr(original, "_ckptverify_tolerant", False):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            return None
        return original(*args, **kwargs)

    init_process_group._ckptverify_tolerant = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group


#: Set by :func:`workload_logs`: where the runs launched meanwhile write their output (None: the terminal).
_log_dir: str | None = None


@contextlib.contextmanager
def workload_logs(log_dir: str) -> Iterator[str]:
    """Within the block, every run launched sends each rank's stdout and stderr to
    ``<log_dir>/<run>-rank<r>.log`` (as a :class:`RunConfig` ``log_dir`` does) instead of the terminal: for a
    front end whose stdout must stay machine-readable around a call that launches runs (``replay --json``).
    Yields the absolute folder."""
    global _log_dir
    previous, _log_dir = _log_dir, os.path.abspath(log_dir)
    try:
        yield _log_dir
    finally:
        _log_dir = previous


def launch_jobs(nproc: int, device: str, jobs: list[tuple[str, RunConfig]], *,
                timeout_s: float | None = None) -> None:
    """Run each ``(target, config)`` in turn in one set of ``nproc`` fresh processes; raise if any rank fails.

    Each target is checked here first (:func:`check_target`), before any process starts. Several jobs share
    the processes' start-up (interpreter, torch import, process group); each job's training function still
    starts from its own seeds and state. Module-level state of a workload does carry from one job to the
    next, as it would in any long-lived process. Raises :class:`TargetError` (the message: the user's
    traceback or line at fault) when a target cannot run or uses the protocol wrongly, and
    :class:`WorkloadCrashedError` (the user's traceback) when it raises (promptly: a failed rank does not wait
    for its peers, see :func:`_abandon_group`), and :class:`~ckptverify.errors.UsageError` when ``device`` is
    ``"cuda"`` and fewer than ``nproc`` CUDA devices are visible. With ``timeout_s``, ranks still
    running after that many seconds are killed and :class:`WorkloadCrashedError` says so (a walk that re-runs
    a step must never hang the command that found the divergence).
    """
    import dataclasses

    import torch.multiprocessing as mp

    _check_devices(nproc, device)
    for target in dict.fromkeys(t for t, _ in jobs):
        check_target(target)
    if _log_dir is not None:
        jobs = [(t, c if c.log_dir else dataclasses.replace(c, log_dir=_log_dir)) for t, c in jobs]
    # The device travels in each job's config (run.device), not in the environment.
    jobs = [(t, dataclasses.replace(c, device=device)) for t, c in jobs]
    with tempfile.TemporaryDirectory(prefix="ckptverify-rendezvous-") as rendezvous:
        args = (nproc, os.path.join(rendezvous, "store"), _unused_port(),
                [(target, config.to_json()) for target, config in jobs], device, dict(os.environ))
        how = start_method()
        try:
            if timeout_s is None:
                mp.start_processes(_worker, args=args, nprocs=nproc, join=True, start_method=how)
            else:
                _join_within(mp.start_processes(_worker, args=args, nprocs=nproc, join=False,
                                                start_method=how), timeout_s, jobs)
        except WorkloadCrashedError:
            raise
        except Exception as exc:
            _raise_failure(jobs, exc)


def _join_within(context: Any, timeout_s: float, jobs: list[tuple[str, RunConfig]]) -> None:
    """Join the ranks of ``context`` (a ``torch.multiprocessing`` process context); past ``timeout_s`` seconds,
    kill those still running (only these processes, which this launch started) and raise."""
    import time

    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            for p in context.processes:
                p.join(5)
            raise WorkloadCrashedError(f"run {jobs[0][1].name} did not finish within {timeout_s:.0f} s; its "
                                       "processes were stopped", "")


def _raise_failure(jobs: list[tuple[str, RunConfig]], exc: Exception) -> None:
    """Turn a failed launch into the user's error: a usage error of any rank first, else the traceback of
    each rank that raised (ranks with the same traceback shown once)."""
    found: dict[str, dict[str, dict[str, list[int]]]] = {}  # run -> kind -> text -> ranks
    for _, config in jobs:
        d = config.trace_dir
        for name in sorted(os.listdir(d)) if d and os.path.isdir(d) else []:
            kind, _, rest = name.partition("-rank")
            if kind in ("usage", "error") and rest.endswith(".txt") and rest[:-4].isdigit():
                with open(os.path.join(d, name)) as f:
                    text = f.read()
                found.setdefault(config.name, {}).setdefault(kind, {}).setdefault(text, []).append(int(rest[:-4]))
    for kinds in found.values():
        if "usage" in kinds:
            raise TargetError(next(iter(kinds["usage"])))
    if not found:
        raise WorkloadCrashedError(f"the workload crashed in run {jobs[0][1].name}: {type(exc).__name__}",
                                   str(exc)) from None
    run, kinds = next(iter(found.items()))
    parts = []
    for text, ranks in kinds["error"].items():
        ranks.sort()
        if len(kinds["error"]) > 1:
            parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}:")
        parts.append(text)
    ranks = sorted(r for rs in kinds["error"].values() for r in rs)
    raise WorkloadCrashedError(f"the workload crashed in run {run} (rank{'s' if len(ranks) > 1 else ''} "
                               f"{', '.join(map(str, ranks))}):", "\n".join(parts)) from None

def launches_at_once(nproc: int, device: str) -> int:
    """How many launches of ``nproc`` ranks fit side by side: a core per rank on CPU (the built-in workloads
    run one intra-op thread per rank); one on CUDA (every launch uses devices ``0..nproc-1``)."""
    if device != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, nproc))


def at_once(fn: Callable[[T], None], items: list[T], width: int) -> None:
    """``fn(item)`` for every item, ``width`` at a time (each ``fn`` a launch of its own: independent runs side by
    side, :func:`launches_at_once` of them); once all have ended, the error of the first item (in order) that
    failed is raised."""
    if width <= 1:
        for item in items:
            fn(item)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=width, thread_name_prefix="ckptverify-launch") as pool:
        futures = [pool.submit(fn, item) for item in items]
    for future in futures:
        future.result()

