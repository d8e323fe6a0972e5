"""Multi-process tests: N CPU ranks joined by a gloo group, rendezvous through a file.

:func:`spawn_ranks` is the one way the tests start ranks inside the test process's machinery. The group meets
through a ``FileStore`` in a fresh private directory, so there is no TCP port to pick: choosing a "free" port by
binding and releasing it races with every other job on the machine (another test, another xdist worker) that
binds between the release and the ranks' own bind.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# How long a rank waits for the others in a collective before it fails. Generous: on a loaded 2-core machine
# a rank can be descheduled for many seconds, and a hung test is stopped by pytest-timeout, which prints where.
GROUP_TIMEOUT = timedelta(minutes=5)


def exit_without_teardown() -> None:
    """End a rank that has finished (results written, process group destroyed) without interpreter teardown.

    After FSDP2 has used a gloo group, ``destroy_process_group`` does not free it: the group's worker and
    transport threads live on until the process exits. A normal exit then finalizes the interpreter and runs
    C++ static destructors around those live threads, and now and then (2 of 100 runs of a bare FSDP2 job on a
    loaded machine) a rank aborts with "terminate called without an active exception". Leaving with
    ``os._exit`` skips that teardown; the work is done and flushed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init_group(rank: int, world: int, init_method: str) -> None:
    """Join the gloo group of ``world`` ranks that meets at ``init_method`` (``file://PATH``)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)


class FileRendezvous:
    """A fresh ``file://`` rendezvous for one group: ``with FileRendezvous() as init_method: ...``.

    The store's file lives in a private temporary directory, removed on exit; a store file must never be
    reused by a second group.
    """

    def __enter__(self) -> str:
        self._dir = tempfile.mkdtemp(prefix="ckptverify-rdzv-")
        return f"file://{os.path.join(self._dir, 'store')}"

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def _rank_main(rank: int, world: int, init_method: str, launcher_env: bool, fn: Callable[..., None],
               args: tuple[Any, ...], env: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    from ckptverify.resume.launch import _take_environment

    _take_environment(env)  # the test's environment now, not the fork server's from when it started
    torch.set_num_threads(1)  # the ranks share a few cores: one thread each keeps them from starving each other
    # The group meets through the file store; this is only the address torch's own helpers (the process-based
    # async checkpointer's store) bind on, loopback as on one machine.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    if launcher_env:
        # What torchrun sets, for code (frameworks) that reads its rank from the environment.
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    init_group(rank, world, init_method)
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank tears down while another is still in a collective
    except BaseException:
        _note_first_failure(init_method, rank)
        raise
    finally:
        dist.destroy_process_group()
    exit_without_teardown()  # only after success: a failure propagates to the parent with its traceback


def _failure_file(init_method: str) -> str:
    return init_method.removeprefix("file://") + ".first-failure"


def _note_first_failure(init_method: str, rank: int) -> None:
    """Record this rank's error unless another rank's came first. A rank's failure makes the others fail too
    (a collective's peer is gone), and whichever the launcher notices first is what it raises; the first one
    noted is the cause, written before this rank lets go of the group."""
    try:
        fd = os.open(_failure_file(init_method), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(f"{rank} {os.getpid()}\n{traceback.format_exc()}")


def spawn_ranks(fn: Callable[..., None], world: int, *args: Any, launcher_env: bool = False) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined by a gloo group, started as
    ``resume-check`` starts its ranks (:func:`ckptverify.resume.launch.start_method`: from a fork server that
    imported torch once), with the test's environment of the moment.

    Each rank runs with one torch thread, joins the group, calls ``fn``, meets the others at a barrier and
    destroys the group. ``fn`` must be importable by name (a module-level function). Raises
    ``torch.multiprocessing.ProcessRaisedException`` with the traceback of the first rank that failed (not of
    another that failed because of it), or ``ProcessExitedException`` when a rank died without one; the other
    ranks are then terminated. ``launcher_env`` also sets ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` in each rank, as torchrun does.
    """
    import torch.multiprocessing as mp

    from ckptverify.resume.launch import start_method

    with FileRendezvous() as init_method:
        try:
            mp.start_processes(_rank_main, args=(world, init_method, launcher_env, fn, args, dict(os.environ)),
                               nprocs=world, join=True, start_method=start_method())
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            try:
                with open(_failure_file(init_method)) as f:
                    head, trace = f.read().split("\n", 1)
            except OSError:
                raise exc from None
            rank, pid = (int(x) for x in head.split())
            if rank == exc.error_index:
                raise
            msg = f"\n\n-- Process {rank} terminated with the following error (the first rank to fail):\n{trace}"
            raise mp.ProcessRaisedException(msg, rank, pid) from exc


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie of another parent counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"
