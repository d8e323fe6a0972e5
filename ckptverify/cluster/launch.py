"""``--readers N``: the ranks of one command on this machine, started by the command itself. This process is rank 0
and hosts the store on 127.0.0.1; it names a child that exits early by code or signal at once (a silent one by the
heartbeat timeout), and no rank outlives the command (SIGKILL after a grace period)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from typing import IO, Any

#: Seconds the ranks get to exit by themselves once rank 0 said it is done.
GRACE_SECONDS = 5.0


class LocalRanks:
    """Ranks 1..N-1 of ``ckptverify ARGV...`` as child processes, meeting at ``store`` (hosted here)."""

    def __init__(self, nproc: int, argv: list[str], timeout: float) -> None:
        from ckptverify.cluster.group import connect

        # Start ranks before importing torch (seconds) so start-ups overlap; they retry until the store is up.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.host = socket.gethostname()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._stderr: dict[int, IO[bytes]] = {}
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("GROUP_RANK", "ROLE_RANK")}
        for rank in range(1, nproc):
            env = {**base, "CKPTVERIFY_CLUSTER": "local", "RANK": str(rank), "WORLD_SIZE": str(nproc),
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(self.port)}
            err = tempfile.TemporaryFile()  # noqa: SIM115 - kept for the rank's last words, closed in close()
            self._stderr[rank] = err
            self.procs[rank] = subprocess.Popen([sys.executable, "-m", "ckptverify", *argv], env=env,
                                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        try:
            self.store = connect("127.0.0.1", self.port, nproc, timeout, server=True)
        except BaseException:
            self.close(grace=0)
            raise

    def liveness(self, pending: set[int]) -> str | None:
        """The first rank among ``pending`` that has exited, with its exit code or signal and its last words."""
        for rank in sorted(pending):
            proc = self.procs.get(rank)
            if proc is None or proc.poll() is None:
                continue
            code = proc.returncode
            how = (f"was killed by signal {-code} ({_signal_name(-code)})" if code < 0
                   else f"exited with code {code}")
            tail = self._tail(rank)
            return (f"rank {rank} on {self.host} (pid {proc.pid}) {how}"
                    + (f"; its last words: {tail}" if tail else ""))
        return None

    def close(self, grace: float = GRACE_SECONDS) -> None:
        """Wait ``grace`` seconds for the ranks to exit, then kill any left (stopped ones too)."""
        for proc in self.procs.values():
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()  # SIGKILL ends a stopped process as well
                proc.wait()
        for err in self._stderr.values():
            err.close()

    def _tail(self, rank: int) -> str:
        err = self._stderr[rank]
        try:
            err.seek(0)
            lines = [ln for ln in err.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1].strip()[:300] if lines else ""


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return "unknown signal"


def child_argv(command: str, path: str, options: dict[str, Any]) -> list[str]:
    """The command line of ranks 1..N-1: the command, its path and the options that shape their work."""
    argv = [command, path]
    for name, value in options.items():
        if value is None or value is False:
            continue
        argv.append(f"--{name}")
        if value is not True:
            argv.append(str(value))
    return argv
