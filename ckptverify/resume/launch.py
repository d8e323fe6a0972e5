"""Launching a workload: each ``(target, RunConfig)`` job in a fresh set of processes, one per rank.

Ranks fork from a server that preloaded torch and ckptverify (``spawn`` where there is none): fresh processes sharing
no training state, started in milliseconds; the server never initialises CUDA. On CUDA rank ``r`` uses ``cuda:r``
(``nproc`` beyond the visible devices is refused up front). Trap: a failed rank abandons its group without teardown
(peers may sit in a collective forever), so a crash is reported at once. Failures come back as
:class:`~ckptverify.errors.UsageError` (an unusable target) or :class:`~ckptverify.errors.CkptVerifyError` (a crash)
with the user's traceback."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.ownfiles.names import own_folder, write_atomic
from ckptverify.resume.harness_target import (
    check_target,
    load_target,
    never_restored_message,
    usage_text,
    user_traceback,
)
from ckptverify.resume.run import Run, RunConfig, _group_backend, harness_job, rank_files

__all__ = ["launch_each", "launch_jobs", "launches_at_once", "log_files", "scratch", "start_method", "workload_logs"]


#: Silence only torchdata's ``set_vital`` deprecation (a line per rank per run, nobody's fault).
def _quiet_known_noise() -> None:
    import warnings

    warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated", category=UserWarning,
                            module=r"torchdata\.stateful_dataloader\.")


#: Preloaded by the fork server (torch._dynamo alone costs seconds per process); none initialises CUDA.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
            "torch.distributed.tensor", "torch.multiprocessing", "zarr", "ckptverify", "ckptverify.resume.launch",
            "ckptverify.resume.run", "ckptverify.checkpoint.save", "ckptverify.checkpoint.load",
            "ckptverify.trace.recorder", "ckptverify.trace.store", "ckptverify.verifier.background"]


def start_method() -> str:
    """``"forkserver"`` (preloading torch and ckptverify) where available, else ``"spawn"``."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts, once per process
    return "forkserver"


def _take_environment(env: dict[str, str]) -> None:
    """Make this rank's environment the launcher's current one (a forkserver child has the server's, from when it
    started)."""
    import multiprocessing

    import torch

    os.environ.clear()
    os.environ.update(env)
    # The workload's own processes (DataLoader workers) start as in a plain run, not by our start method.
    multiprocessing.set_start_method(None, force=True)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch read it when the server imported it
        torch.set_num_threads(int(threads))


def _worker(rank: int, nproc: int, store: str, port: int, jobs: list[tuple[str, RunConfig]], device: str,
            env: dict[str, str]) -> None:
    """One rank: run each ``(target, RunConfig)`` of ``jobs`` in turn in this process with ``env``, meeting
    peers through the launch-private file store ``store``; on CUDA it uses ``cuda:{rank}``."""
    import torch
    import torch.distributed as dist

    # What is loaded now (torch and ckptverify, preloaded by the fork server) lives as long as the rank: out of the
    # collector's sight, each collection (ours after every job, the automatic ones) walks the jobs' own objects,
    # not torch's 300k (0.2 s a full collection).
    gc.freeze()
    _take_environment(env)
    _quiet_known_noise()

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if device == "cuda":
        # Even one rank: a bare "cuda" and its saved RNG state must mean this device.
        torch.cuda.set_device(rank)
    if nproc > 1:
        # NCCL binds to the rank's device now, not whatever is current later.
        bound = {"device_id": torch.device("cuda", rank)} if device == "cuda" else {}
        dist.init_process_group(_group_backend(device, torch.cuda.is_available()), init_method=f"file://{store}",
                                rank=rank, world_size=nproc, **bound)
        # The workload's own init_process_group is a no-op while this group exists (torchrun scripts call it
        # unconditionally). Each rank process runs one _worker, so it is wrapped once.
        harness_init = dist.init_process_group

        def init_process_group(*args: Any, **kwargs: Any) -> None:
            return None if dist.is_initialized() else harness_init(*args, **kwargs)

        dist.init_process_group = init_process_group
    try:
        for target, config in jobs:
            _run_job(rank, nproc, target, config)
    except BaseException:
        # Leave the group without waiting for peers: ``destroy_process_group`` would wait on peers stuck in a
        # collective this rank never joins (NCCL: minutes). NCCL communicators are aborted; a gloo group fails its
        # peers when this process's connections close. Leaving must not hide the failure being raised.
        if nproc > 1 and dist.is_initialized():
            with contextlib.suppress(Exception):
                from torch.distributed.distributed_c10d import _abort_process_group

                if "nccl" in str(dist.get_backend()):
                    _abort_process_group()
        raise
    if nproc > 1:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Skip interpreter teardown: gloo threads left alive after FSDP2/DDP sometimes SIGABRT it, failing a
        # check that passed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _check_devices(nproc: int, device: str) -> None:
    """Refuse before any process starts ``nproc`` ranks that do not each get their own CUDA device."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible to this process")
    count = torch.cuda.device_count()
    if nproc > count:
        raise UsageError(f"--nproc {nproc} on --device cuda needs one CUDA device per rank, but {count} "
                         f"{'is' if count == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES)")


def _run_job(rank: int, nproc: int, target: str, config: RunConfig) -> None:
    """Run the training function once; on failure write ``usage-rank<r>.txt`` or ``error-rank<r>.txt`` to the trace
    folder for the user, then re-raise."""
    import torch.distributed as dist

    from ckptverify.resume.harness_output import LabelledOutput, label, to_log_file

    if config.log_dir:
        to_log_file(os.path.join(config.log_dir, f"{config.name}-rank{rank}.log"))
    run: Run | None = None
    with (contextlib.nullcontext() if config.log_dir else LabelledOutput(label(config.name, rank, nproc))), \
            harness_job(config):
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
                if isinstance(exc, UsageError) and run is not None and run.state is None and _from_save(exc):
                    kind, text = "usage", never_restored_message(target)  # the first checkpoint, and no state
                elif isinstance(exc, UsageError):
                    kind, text = "usage", usage_text(exc)
                else:
                    kind, text = "error", user_traceback(exc)
                write_atomic(os.path.join(trace_dir, f"{kind}-rank{rank}.txt"), text,
                             prefix=f".{kind}-rank{rank}.", durable=False)
            raise
        finally:
            # End the workload's objects now, and the workers of DataLoader iterators still alive: they hold the
            # output pipe (or the next job's log) open, costing seconds per run.
            run = None
            gc.collect()
            for obj in gc.get_objects():
                if type(obj).__name__.endswith("MultiProcessingDataLoaderIter"):
                    with contextlib.suppress(Exception):  # torch's private teardown: best effort, the run is over
                        obj._shutdown_workers()


def _from_save(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by ``Run._save`` (a checkpoint the harness asked for)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].name == "_save" and os.path.basename(frames[-1].filename) == "run.py"


#: Set by :func:`workload_logs` (None: the terminal).
_log_dir: str | None = None


@contextlib.contextmanager
def workload_logs(log_dir: str) -> Iterator[str]:
    """Within the block, launched runs send each rank's output to ``<log_dir>/<run>-rank<r>.log`` instead of the
    terminal (for ``--json`` front ends). Yields the absolute folder."""
    global _log_dir
    previous, _log_dir = _log_dir, os.path.abspath(log_dir)
    try:
        yield _log_dir
    finally:
        _log_dir = previous


@contextlib.contextmanager
def scratch(keep: str | None, prefix: str) -> Iterator[str]:
    """The absolute folder a command's runs write in: ``keep`` (made if missing, left afterwards), else a fresh
    temporary folder named ``prefix...`` removed when the block ends."""
    work = os.path.abspath(keep) if keep else tempfile.mkdtemp(prefix=prefix)
    os.makedirs(work, exist_ok=True)
    try:
        yield work
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def log_files() -> list[str] | None:
    """The per-rank log files written so far in the :func:`workload_logs` block this is called in, sorted; ``None``
    outside one, or when there are none."""
    if _log_dir is None or not os.path.isdir(_log_dir):
        return None
    return sorted(os.path.join(_log_dir, n) for n in os.listdir(_log_dir)) or None


def launch_jobs(nproc: int, device: str, jobs: list[tuple[str, RunConfig]], *,
                timeout_s: float | None = None) -> None:
    """Run each ``(target, config)`` in turn in one set of ``nproc`` fresh processes; raise if any rank fails.

    Targets are checked before any process starts. Jobs share process start-up but not seeds or state (module-level
    state does carry over). Raises :class:`UsageError` (unusable target, protocol misuse, too
    few CUDA devices), :class:`CkptVerifyError` (a crash, promptly: failed ranks do not wait for peers; a time limit
    passed). ``timeout_s``: kill ranks still running after it (a walk must never hang its command)."""
    import torch.multiprocessing as mp

    _check_devices(nproc, device)
    for target in dict.fromkeys(t for t, _ in jobs):
        check_target(target)
    jobs = [(t, replace(c, device=device, log_dir=c.log_dir or _log_dir)) for t, c in jobs]
    # A free port, only for the MASTER_PORT a torchrun-style workload may read: the ranks meet through a file store
    # (no bind-and-release race between parallel launches).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="ckptverify-rendezvous-") as rendezvous:
        args = (nproc, os.path.join(rendezvous, "store"), port, jobs, device, dict(os.environ))
        try:
            _join_within(mp.start_processes(_worker, args=args, nprocs=nproc, join=False,
                                            start_method=start_method()), timeout_s, jobs)
        except CkptVerifyError:  # a time limit passed: said already
            raise
        except Exception as exc:
            _raise_failure(jobs, exc)


def _join_within(context: Any, timeout_s: float | None, jobs: list[tuple[str, RunConfig]]) -> None:
    """Join the ranks of ``context``; past ``timeout_s`` (``None``: never) kill those still running (ours only) and
    raise."""
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
    while not context.join(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            for p in context.processes:
                p.join(5)
            raise CkptVerifyError(f"run {jobs[0][1].name} did not finish within {timeout_s:.0f} s; its processes "
                                  "were stopped")


def _raise_failure(jobs: list[tuple[str, RunConfig]], exc: Exception) -> None:
    """Turn a failed launch into the user's error: any rank's usage error first, else each failing rank's traceback
    (identical ones shown once)."""
    found: dict[str, dict[str, dict[str, list[int]]]] = {}  # run -> kind -> text -> ranks
    for _, config in jobs:
        for kind in ("usage", "error"):
            for rank, text in rank_files(config.trace_dir, kind, ".txt").items():
                found.setdefault(config.name, {}).setdefault(kind, {}).setdefault(text, []).append(rank)
    for kinds in found.values():
        if "usage" in kinds:
            raise UsageError(next(iter(kinds["usage"])))
    if not found:
        raise CkptVerifyError(f"the workload crashed in run {jobs[0][1].name}: {type(exc).__name__}\n{exc}") from None
    run, kinds = next(iter(found.items()))
    from ckptverify.resume.causes import ranks_text

    errors = kinds["error"]
    parts = [f"{ranks_text(ranks)}:\n{text}" if len(errors) > 1 else text for text, ranks in errors.items()]
    ranks = [r for rs in errors.values() for r in rs]
    raise CkptVerifyError(f"the workload crashed in run {run} ({ranks_text(ranks)}):\n" + "\n".join(parts)) from None


def launches_at_once(nproc: int, device: str) -> int:
    """How many launches of ``nproc`` ranks fit side by side: a core per rank on CPU; one on CUDA (every launch uses
    devices ``0..nproc-1``)."""
    if device != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, nproc))


def launch_each(nproc: int, device: str, runs: Sequence[tuple[str, list[tuple[str, RunConfig]]]], *,
                say: Callable[[str], None], timeout_s: float | None = None) -> float:
    """:func:`launch_jobs` of each ``(message, jobs)`` of ``runs`` in fresh processes of its own (``message`` said as
    it starts), as many side by side as :func:`launches_at_once` allows; after all end, raise the first failed run's
    error. Returns the longest launch's seconds (what bounds a later re-run's time limit)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(run: tuple[str, list[tuple[str, RunConfig]]]) -> float:
        message, jobs = run
        say(message)
        began = time.perf_counter()
        launch_jobs(nproc, device, jobs, timeout_s=timeout_s)
        return time.perf_counter() - began

    # One at a time on CUDA, each still run to its end.
    with ThreadPoolExecutor(launches_at_once(nproc, device), thread_name_prefix="ckptverify-launch") as pool:
        futures = [pool.submit(one, run) for run in runs]
    return max((future.result() for future in futures), default=0.0)
