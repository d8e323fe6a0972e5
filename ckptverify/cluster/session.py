"""One command across ranks: :func:`open_session` gives ``None`` (one process) or a :class:`Session`. On rank 0,
:attr:`Session.executor` takes the command's work units and :meth:`Session.finish` adds each rank's bytes to the
report; every other rank calls :meth:`Session.serve` until rank 0 says it is done."""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ckptverify.cluster.env import cores_per_rank, detect
from ckptverify.cluster.group import CommandRanks, connect
from ckptverify.cluster.split import assign, balance
from ckptverify.cluster.units import (
    RankFiles,
    Unit,
    UnitExecutor,
    execute,
    opened_in,
    unit_bytes,
    unit_file,
    unit_range,
)
from ckptverify.errors import CkptVerifyError, FileChangedError, UsageError

if TYPE_CHECKING:
    from ckptverify.checks.dcp_pipeline import VerificationRun

#: Test-only ``RANK:ACTION`` (rank not 0): ``kill``, ``exit`` (3) or ``stop`` at its first work, or after its first
#: unit ``kill-reading`` or ``raise``: proves a failing rank is named and never passes without its share.
FAULT_ENV = "CKPTVERIFY_TEST_RANK_FAULT"


def open_session(command: str, path: str, *, readers: int | None, rank_timeout: float, jobs: int | None,
                 child_options: dict[str, Any]) -> Session | None:
    """This process's session, or ``None`` to run alone. ``readers``: start that many ranks here (this is rank 0);
    else the launcher's environment decides. ``child_options``: options for ranks 1..N-1 under ``readers``."""
    env = detect()
    if readers is not None and readers > 1:
        if env is not None:
            raise UsageError(f"--readers starts the ranks itself, but this process is already rank {env.rank} of "
                             f"{env.world_size} under {env.launcher}: leave --readers out")
        from ckptverify.cluster.launch import LocalRanks, child_argv

        per_rank = jobs or cores_per_rank(readers)
        ranks = LocalRanks(readers, child_argv(command, path, {**child_options, "jobs": per_rank,
                                                               "rank-timeout": rank_timeout}), rank_timeout)
        try:
            beat = connect("127.0.0.1", ranks.port, readers, rank_timeout, server=False)
            group = CommandRanks(ranks.store, beat, 0, readers, rank_timeout, _namespace(), liveness=ranks.liveness)
            session = Session(group, path, per_rank, "local", ranks)
            group.start(command, path)
        except BaseException:
            ranks.close(grace=0)
            raise
        return session
    if env is None:
        return None
    # torchrun's agent hosts the store; under srun and --readers, rank 0 does.
    agent = env.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    meet = (env.master_addr, env.master_port, env.world_size, rank_timeout)
    store = connect(*meet, server=env.rank == 0 and not agent and env.launcher != "local")
    group = CommandRanks(store, connect(*meet, server=False), env.rank, env.world_size, rank_timeout, _namespace())
    session = Session(group, path, jobs or cores_per_rank(env.local_world_size), env.launcher, None)
    group.start(command, path)
    return session


class Session:
    """This rank's part in one command (see the module docstring)."""

    def __init__(self, group: CommandRanks, path: str, jobs: int, launcher: str, local: Any) -> None:
        self.group, self.path, self.jobs, self.launcher, self._local = group, path, jobs, launcher, local
        self.executor = RankExecutor(group) if group.rank == 0 else None
        self._closed = False

    @property
    def is_root(self) -> bool:
        return self.group.rank == 0

    # ---- the other ranks

    def serve(self) -> int:
        """Read rank 0's units until it says done; returns this rank's exit code (2 when rank 0 could not be heard, with
        a :class:`CkptVerifyError` for the caller to print)."""
        group, files = self.group, RankFiles(self.path)
        at, fault = _fault(group.rank)

        def read(unit: Unit) -> Any:
            value = execute(unit, files, self.path, self.jobs)
            if at == "read":
                fault()
            return value

        pool = ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="ckptverify-rank")
        try:
            for k in itertools.count():
                msg = group.collect({0: f"round/{k}"}, "waiting for work")[0]
                if msg.get("kind") != "work":
                    group.send(f"bye/{group.rank}", True, "bye")  # rank 0 may host the store: it waits for this
                    return 0
                work = group.get(f"units/{k}/{group.rank}")
                if at == "work":
                    fault()
                files.expect.update(work.get("expect") or {})
                # A whole checkpoint (scan) is verified with all of this rank's threads: one at a time.
                run_map = map if any(u[0] == "checkpoint" for u in work["units"]) else pool.map
                try:
                    results = list(run_map(read, work["units"]))
                    reply: dict[str, Any] = {"results": results}
                except FileChangedError as exc:
                    where = os.path.relpath(exc.path, self.path) if isinstance(exc.path, str) else "?"
                    reply = {"error": "changed", "path": where, "message": str(exc)}
                except Exception as exc:  # reported by rank 0, which names this rank
                    reply = {"error": "failed", "message": f"{type(exc).__name__}: {exc}"[:500]}
                group.send(f"result/{k}/{group.rank}", reply, f"result/{k}")
        finally:
            pool.shutdown(wait=False)
            files.close()

    # ---- rank 0

    def finish(self, report: Any) -> Any:
        """``report`` with the bytes each rank read (``stats.ranks``, ``stats.world_size``, ``stats.balance``)."""
        assert self.executor is not None
        stats = dict(report.stats)
        stats.update(self.executor.summary(int(stats.get("bytes") or 0), deep=bool(stats.get("deep"))))
        stats["launcher"] = self.launcher
        return dataclasses.replace(report, stats=stats)

    def close(self, *, failed: bool = False) -> None:
        """Tell the other ranks to stop (rank 0) and, unless ``failed``, wait until each heard it; stop the heartbeat
        and end the ranks started here."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.executor is not None:
                try:
                    self.group.set(f"round/{self.executor.round}", {"kind": "done"})
                    # Under srun rank 0 hosts the store: the others must have read "done" before it goes.
                    if not failed:
                        self.group.collect({r: f"bye/{r}" for r in range(1, self.group.world)}, "saying goodbye",
                                           "bye")
                except CkptVerifyError:
                    pass  # a rank already named as failed, or gone since: nothing more to say to it
        finally:
            self.group.close()
            if self._local is not None:
                self._local.close()


class RankExecutor(UnitExecutor):
    """Rank 0's side: shares work units among the ranks and returns their results in order."""

    def __init__(self, group: CommandRanks) -> None:
        self.group = group
        self.world = group.world
        self.round = 0
        self.loads = [0] * self.world
        self.read = [0] * self.world
        self.units = [0] * self.world
        self.largest_unit = 0
        self._ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self._unranged = 0
        self._rank0_own: int | None = None

    def map_units(self, run: VerificationRun, units: Sequence[Unit]) -> list[Any]:
        """Results of ``units`` for a ``VerificationRun``, read through its opened files on rank 0 (an unopened one:
        ``FileChangedError``), advancing its progress as results arrive."""

        opened = opened_in(run)

        def size_of(name: str) -> int:
            return int(opened(name).size)

        if self._rank0_own is None:  # rank 0 read the rest itself: metadata, headers, small items
            total = sum(size_of(n) for n in run.opened_files())
            ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
            _spans(units, size_of, ranges)
            self._rank0_own = max(0, total - sum(_merged(r) for r in ranges.values()))
            self.loads[0] += self._rank0_own
        return self.map_plain(units, root=run.root, open_file=opened, size_of=size_of, local_map=run.map,
                              advance=run.advance)

    def map_plain(self, units: Sequence[Unit], *, root: str, open_file: Callable[[str], Any],
                  size_of: Callable[[str], int], local_map: Callable[..., list[Any]],
                  advance: Callable[[int], None] | None = None, jobs: int | None = 1) -> list[Any]:
        """Results of ``units`` in order: rank 0's share read here via ``open_file`` (``local_map``, ``jobs``), the
        others' sent out. A rank's ``file-changed`` raises :class:`~ckptverify.errors.FileChangedError`, other
        failures :class:`CkptVerifyError` naming it."""
        sizes = [unit_bytes(u, size_of) for u in units]
        owner = assign(sizes, self.loads)
        k, self.round = self.round, self.round + 1
        share: list[list[int]] = [[] for _ in range(self.world)]
        for n, r in enumerate(owner):
            share[r].append(n)
        for r in range(1, self.world):
            names = sorted({f for f in (unit_file(units[n]) for n in share[r]) if f is not None})
            self.group.set(f"units/{k}/{r}", {"units": [units[n] for n in share[r]],
                                              "expect": {m: _signature(root, m, size_of) for m in names}})
        self.group.set(f"round/{k}", {"kind": "work"})
        out: list[Any] = [None] * len(units)

        def mine(n: int) -> Any:
            value = execute(units[n], open_file, root, jobs)
            if advance is not None:
                advance(sizes[n])
            return value

        for n, value in zip(share[0], local_map(mine, share[0]), strict=True):
            out[n] = value
        try:
            replies = self.group.collect({r: f"result/{k}/{r}" for r in range(1, self.world)}, "reading its share",
                                         f"result/{k}")
        except CkptVerifyError as exc:
            raise CkptVerifyError(f"{exc}; {self._incomplete()}") from None
        for r in range(1, self.world):
            reply = replies[r]
            if reply.get("error") == "changed":
                raise FileChangedError(reply["message"], os.path.join(root, reply["path"]))
            if "error" in reply:
                raise CkptVerifyError(f"rank {r} on {self.group.host_of(r)} could not read its share: "
                                   f"{reply['message']}; {self._incomplete()}")
            for n, value in zip(share[r], reply["results"], strict=True):
                out[n] = value
                if advance is not None:
                    advance(sizes[n])
        for r in range(self.world):
            self.read[r] += sum(sizes[n] for n in share[r])
            self.units[r] += len(share[r])
        self.largest_unit = max([self.largest_unit, *sizes])
        self._unranged += _spans(units, size_of, self._ranges)
        return out

    def _incomplete(self) -> str:
        # An unread share is never a pass: stop without a verdict (exit 2).
        what = {"verify": "verification", "scan": "scan", "fingerprint": "fingerprint"}.get(self.group.command,
                                                                                        "command")
        return f"the {what} is incomplete: that rank's share was not checked, so nothing is concluded"

    def summary(self, total: int, *, deep: bool = False) -> dict[str, Any]:
        """``ranks`` (host, bytes, units each), ``world_size``, ``balance``; rank 0 is charged what no unit covered."""
        covered = sum(_merged(r) for r in self._ranges.values()) + self._unranged
        # What the first shared pass left to rank 0 (read while planning), else what no unit covered.
        own = self._rank0_own if self._rank0_own is not None else max(0, total - covered) if self.round else total
        per = list(self.read)
        per[0] += own
        ranks = [{"rank": r, "host": self.group.host_of(r), "bytes_read": per[r], "units": self.units[r]}
                 for r in range(self.world)]
        units = sum(self.units)
        # Against all bytes read: a command reading bytes twice is balanced when each pass is.
        bal = balance(per, sum(per), units, self.largest_unit, own)
        if not self.round:
            bal["why_not"] = ("nothing was shared out: this checkpoint is read by rank 0 alone (only DCP "
                              "checkpoints and run directories are split among ranks)")
        out: dict[str, Any] = {"world_size": self.world, "ranks": ranks, "balance": bal}
        if deep:
            out["ranks_note"] = ("--deep reads the tensors a second time (shared too, but for stream-transformed "
                                 "items and tensor subclasses, rebuilt on rank 0): the shares sum to more than "
                                 "the checkpoint's bytes")
        return out


def _namespace() -> str:
    """The prefix of this command's keys in the store: torchrun's agent store outlives a restart of the ranks."""
    return f"ckptverify/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _signature(root: str, name: str, size_of: Callable[[str], int]) -> list[int]:
    try:
        mtime = os.stat(os.path.join(root, name)).st_mtime_ns
    except OSError:
        mtime = -1
    return [size_of(name), mtime]


def _spans(units: Sequence[Unit], size_of: Callable[[str], int], ranges: dict[str, list[tuple[int, int]]]) -> int:
    """Add each unit's byte range to ``ranges`` (by file); returns the bytes of the units with none."""
    loose = 0
    for u in units:
        got = unit_range(u, size_of)
        if got is None:
            loose += unit_bytes(u, size_of)
        else:
            ranges[got[0]].append((got[1], got[2]))
    return loose


def _merged(ranges: list[tuple[int, int]]) -> int:
    """Bytes covered by the union of ``ranges``."""
    total, end = 0, -1
    for lo, hi in sorted(ranges):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def _fault(rank: int) -> tuple[str | None, Callable[[], None]]:
    """The test-only fault of :data:`FAULT_ENV` on this rank: when it strikes (``"work"``, ``"read"``, ``None``) and
    what it does."""
    spec = os.environ.get(FAULT_ENV, "")
    who, _, action = spec.partition(":")
    if not who.strip().isdigit() or int(who) != rank or rank == 0:
        return None, lambda: None

    def planted() -> None:
        raise RuntimeError(f"fault planted by {FAULT_ENV}")

    return {"kill": ("work", lambda: os.kill(os.getpid(), signal.SIGKILL)),
            "stop": ("work", lambda: os.kill(os.getpid(), signal.SIGSTOP)),
            "exit": ("work", lambda: os._exit(3)),
            "kill-reading": ("read", lambda: os.kill(os.getpid(), signal.SIGKILL)),
            "raise": ("read", planted)}.get(action.strip(), (None, lambda: None))
