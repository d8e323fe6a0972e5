"""The ranks of one command meeting and talking through torch.distributed's TCP store (keys under ``ckptverify/``:
hellos, rank 0's rounds, replies). Each rank beats a heartbeat on its own connection; a waiter names a rank whose
heartbeat stopped for the timeout (with its host) and the command fails (exit 2) instead of hanging. A launcher
that knows exit codes (``--readers``) says so first."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ckptverify.errors import CkptVerifyError

#: Seconds between two heartbeats of a rank.
BEAT_SECONDS = 1.0


def connect(addr: str, port: int, world: int, timeout: float, *, server: bool) -> Any:
    """A client of the store at ``addr:port`` (started here first when ``server``)."""
    from torch.distributed import TCPStore

    wait = timedelta(seconds=timeout)
    try:
        if server:
            return TCPStore(addr, port, world, True, wait, wait_for_workers=False)
        return TCPStore(addr, port, world, False, wait)
    except Exception as exc:  # c10d raises RuntimeError subclasses whose type names vary by version
        role = "start the rendezvous store on" if server else "reach the rendezvous store at"
        raise CkptVerifyError(f"could not {role} {addr}:{port} within {timeout:g} s ({_short(exc)}): check that "
                           "rank 0 runs, that MASTER_ADDR names its host and that MASTER_PORT is free there "
                           "and reachable from every node") from None


class CommandRanks:
    """The ranks running one command, as this rank sees them: ``store`` and ``beat_store`` (separate connections;
    the heartbeat thread has its own); ``liveness(pending)`` may name a rank known to be gone, or return ``None``."""

    def __init__(self, store: Any, beat_store: Any, rank: int, world: int, timeout: float, namespace: str,
                 liveness: Callable[[set[int]], str | None] | None = None) -> None:
        from torch.distributed import PrefixStore

        self.store = PrefixStore(namespace, store)
        self._beat_store = PrefixStore(namespace, beat_store)
        self.rank, self.world, self.timeout = rank, world, timeout
        self.liveness = liveness
        self.host = socket.gethostname()
        self.roster: list[dict[str, Any]] = []
        self.command = ""  # the command the ranks run, once started
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._beating, name="ckptverify-heartbeat", daemon=True)

    # ---- lifecycle

    def start(self, command: str, path: str) -> None:
        """Say hello and learn every rank's host: rank 0 waits for all hellos (naming missing ranks) and publishes the
        roster."""
        self._beat.start()
        self.command = command
        hello = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "command": command, "path": path}
        if self.rank == 0:
            self.set("hello/0", hello)
            got = self.collect({r: f"hello/{r}" for r in range(1, self.world)}, "checking in", "hello", started=True)
            self.roster = [hello] + [got[r] for r in range(1, self.world)]
            for other in self.roster[1:]:
                if (other["command"], other["path"]) != (command, path):
                    raise CkptVerifyError(
                        f"rank {other['rank']} on {other['host']} runs `{other['command']} {other['path']}`, "
                        f"rank 0 runs `{command} {path}`: start the same command on every rank")
            self.set("roster", self.roster)
        else:
            self.send(f"hello/{self.rank}", hello, "hello")
            self.roster = self.collect({0: "roster"}, "starting")[0]

    def close(self) -> None:
        self._stop.set()
        if self._beat.is_alive():
            self._beat.join(timeout=2 * BEAT_SECONDS)

    def host_of(self, rank: int) -> str:
        return str(self.roster[rank]["host"]) if rank < len(self.roster) else "an unknown host"

    # ---- messages

    def set(self, key: str, value: Any) -> None:
        self._store(lambda: self.store.set(key, json.dumps(value)))

    def get(self, key: str) -> Any:
        return self._store(lambda: json.loads(self.store.get(key)))

    def send(self, key: str, value: Any, topic: str) -> None:
        """Rank 0 the message ``key``, counted under ``topic`` (what :meth:`collect` watches)."""
        self.set(key, value)
        self._store(self.store.add, f"arrived/{topic}", 1)

    def collect(self, keys: dict[int, str], what: str, topic: str | None = None, *,
                started: bool = False) -> dict[int, Any]:
        """Every rank's message (rank -> key), waiting while each heartbeat moves (``started``: also for ranks not
        heard from yet). With ``topic`` (sent by :meth:`send`), keys are read only when its count moved: one request
        per poll."""
        pending = dict(keys)
        got: dict[int, Any] = {}
        now = time.monotonic()
        # Last heartbeat value seen and when it last moved; a rank not yet heard from (started) has none.
        beats = {r: (None if started else self._beat_of(r), now) for r in pending}
        beat_every = min(BEAT_SECONDS, self.timeout / 4)
        beats_at = now
        # Requests to the store scale with the ranks waited for: the slowest poll grows with the world.
        slowest = min(1.0, 0.1 * max(1.0, self.world / 100))
        count: int | None = -1
        pause = 0.005
        while pending:
            moved = True
            if topic is not None:
                now_count = int(self._store(self.store.add, f"arrived/{topic}", 0))
                moved, count = now_count != count, now_count
            if moved:
                for r, key in list(pending.items()):
                    if self._store(self.store.check, [key]):
                        got[r] = self.get(key)
                        del pending[r]
            if not pending:
                break
            if self.liveness is not None:
                gone = self.liveness(set(pending))
                if gone is not None:
                    raise CkptVerifyError(f"{gone}, while {what}")
            now = time.monotonic()
            if now - beats_at >= beat_every:
                beats_at = now
                silent = []
                for r in pending:
                    value = self._beat_of(r)
                    if value != beats[r][0]:
                        beats[r] = (value, now)
                    elif now - beats[r][1] > self.timeout:
                        silent.append(r)
                if silent:
                    raise CkptVerifyError(self._silent(silent, what))
            time.sleep(pause)
            pause = min(slowest, pause * 2)
        return got

    # ---- internals

    def _beating(self) -> None:
        key = f"beat/{self.rank}"
        interval = min(BEAT_SECONDS, self.timeout / 4)
        while not self._stop.is_set():
            try:
                self._beat_store.add(key, 1)
            except Exception:  # the store is gone: the waits of the main thread say so
                return
            self._stop.wait(interval)

    def _beat_of(self, rank: int) -> int | None:
        key = f"beat/{rank}"
        return self._store(lambda: int(self.store.add(key, 0)) if self.store.check([key]) else None)

    def _silent(self, ranks: list[int], what: str) -> str:
        def name(r: int) -> str:
            if r < len(self.roster):
                return f"rank {r} on {self.host_of(r)} (pid {self.roster[r]['pid']})"
            return f"rank {r}"

        names = ", ".join(name(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
        if not self.roster and self.rank == 0:
            return (f"{names} never checked in within {self.timeout:g} s: {'they' if len(ranks) > 1 else 'it'} did "
                    "not start, or cannot reach MASTER_ADDR:MASTER_PORT")
        return (f"{names} gave no sign of life for {self.timeout:g} s while {what}: stopped, hung or dead (its "
                "heartbeat stopped); raise --rank-timeout if a node is that slow")

    def _store(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, a request to the store; any failure means the store is gone with rank 0 or the launcher."""
        try:
            return call(*args)
        except Exception as exc:
            who = "rank 0's rendezvous store" if self.rank else "the rendezvous store"
            raise CkptVerifyError(f"rank {self.rank} on {self.host} lost {who} ({_short(exc)}): rank 0 or the "
                                  "launcher ended") from None


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
