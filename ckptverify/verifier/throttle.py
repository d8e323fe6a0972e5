"""Keep a background verification off the training's cores: read in slices, and wait while no core is idle.

Idle priority is not enough: torch's parallel regions wait for their slowest thread, and a verifier filling the
gaps (evicting caches, on SMT siblings) delays the next region. So :class:`Throttle` asks an :class:`IdleProbe`
every :data:`WINDOW_SECONDS` how many usable cores were idle (excluding its own CPU time, and capped by the tasks
ready now: averages count gaps as idle); below :data:`MIN_FREE_CORES` it backs off (25 ms doubling to
:data:`MAX_PAUSE_SECONDS`). It changes only *when* bytes are read, never the verdict. Off without ``/proc/stat``,
with ``CKPTVERIFY_VERIFY_THROTTLE=0``, and after :meth:`Throttle.lift`.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ckptverify.errors import CkptVerifyWarning

__all__ = [
    "CHECK_SECONDS",
    "MAX_PAUSE_SECONDS",
    "MIN_FREE_CORES",
    "MIN_FREE_ENV",
    "PREEMPTED_SHARE",
    "THROTTLE_ENV",
    "WINDOW_SECONDS",
    "CpuTimes",
    "IdleProbe",
    "Throttle",
    "env_number",
    "next_pause",
    "parse_proc_stat",
    "throttle_enabled",
]

#: ``0`` (or ``off``, ``false``, ``no``) turns the throttle off: verifications read at full speed (at idle priority).
THROTTLE_ENV = "CKPTVERIFY_VERIFY_THROTTLE"
#: Idle cores (averaged over the last window) the verifier needs to read on: fewer, and it waits.
MIN_FREE_CORES = 0.5
#: Overrides :data:`MIN_FREE_CORES` (a number of cores, for tuning).
MIN_FREE_ENV = "CKPTVERIFY_VERIFY_THROTTLE_MIN_FREE"
#: Seconds between looks: ``/proc/stat`` ticks are 10 ms; longer lets the verifier run on a needed core.
WINDOW_SECONDS = 0.05
#: The first wait when no core is idle, and the longest (each further wait doubles, up to it).
FIRST_PAUSE_SECONDS = 0.025
MAX_PAUSE_SECONDS = 0.1
#: How often it checks its CPU wait, and the share that means it was pushed aside (then it waits at once).
CHECK_SECONDS = 0.002
PREEMPTED_SHARE = 0.25
_OFF = ("0", "off", "false", "no")


def throttle_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether verifications pace themselves (:data:`THROTTLE_ENV`; on by default)."""
    raw = (os.environ if environ is None else environ).get(THROTTLE_ENV, "1")
    return raw.strip().lower() not in _OFF


def env_number(name: str, default: float, environ: dict[str, str] | None = None, *, warn: bool = False) -> float:
    """The non-negative number in environment variable ``name``; ``default`` when unset, unreadable, negative or NaN
    (``warn``: a :class:`~ckptverify.errors.CkptVerifyWarning` says so)."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value >= 0:  # not NaN
        return value
    if warn:
        warnings.warn(f"{name}={raw!r} is not a non-negative number; using {default}", CkptVerifyWarning,
                      stacklevel=3)
    return default


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Cumulative ``/proc/stat`` ticks of a CPU set (busy, all, count); ``running``: ``procs_running`` when the set is
    the whole machine, else ``None``."""

    busy: int
    total: int
    cpus: int
    running: int | None = None


def parse_proc_stat(text: str, cpus: Iterable[int] | None = None) -> CpuTimes | None:
    """Busy and total ticks of ``cpus`` (default all) from ``/proc/stat`` text, or ``None``. Idle and iowait are not
    busy; guest time (inside user) is not counted twice."""
    lines: dict[str, list[int]] = {}
    running = None
    for line in text.splitlines():
        if line.startswith("procs_running "):
            value = line.split()[1:2]
            running = int(value[0]) if value and value[0].isdigit() else None
        if not line.startswith("cpu"):
            continue
        name, *fields = line.split()
        try:
            lines[name] = [int(v) for v in fields[:8]]
        except ValueError:
            return None
    online = sorted(int(n[3:]) for n in lines if n[3:].isdigit())
    wanted = online if cpus is None else sorted(set(cpus) & set(online))
    if not wanted:
        return None
    # The all-CPU line is summed before rounding to ticks: use it when every CPU counts.
    rows = [lines["cpu"]] if wanted == online and "cpu" in lines else [lines[f"cpu{c}"] for c in wanted]
    busy = total = 0
    for row in rows:
        if len(row) < 5:
            return None
        row = row + [0] * (8 - len(row))
        total += sum(row)
        busy += sum(row) - row[3] - row[4]  # idle, iowait
    return CpuTimes(busy, total, len(wanted), running if wanted == online else None)


def _read_proc_stat() -> str:
    with open("/proc/stat", encoding="ascii", errors="replace") as f:
        return f.read()


class IdleProbe:
    """Idle cores this process may use since the last look, excluding the verifier's own CPU time, and no more than
    idle right now (``procs_running``, minus itself): averages count the gaps between parallel regions as idle.
    ``cpus`` defaults to this process's affinity."""

    def __init__(self, *, read_stat: Callable[[], str] = _read_proc_stat,
                 own_seconds: Callable[[], float] = time.thread_time, cpus: Iterable[int] | None = None,
                 hz: int | None = None) -> None:
        self._read = read_stat
        self._own = own_seconds
        try:
            self._cpus: set[int] | None = set(cpus) if cpus is not None else set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self._cpus = None
        try:
            self._hz = hz or int(os.sysconf("SC_CLK_TCK"))
        except (AttributeError, ValueError, OSError):
            self._hz = 100
        self._last: tuple[CpuTimes, float] | None = None

    @classmethod
    def open(cls) -> IdleProbe | None:
        """A probe of this machine, or ``None`` where ``/proc/stat`` cannot be read (no throttle there)."""
        try:
            return cls() if parse_proc_stat(_read_proc_stat()) is not None else None
        except OSError:
            return None

    def look(self) -> float | None:
        """Average idle cores since the previous look (``None`` at the first, when no tick passed, or unreadable)."""
        try:
            now = parse_proc_stat(self._read(), self._cpus)
        except OSError:
            now = None
        if now is None:
            return None
        own = self._own()
        last, self._last = self._last, (now, own)
        if last is None:
            return None
        before, own_before = last
        total = now.total - before.total
        if total <= 0:
            self._last = last  # too soon: keep measuring from the previous look
            return None
        others = (now.busy - before.busy) - max(0.0, own - own_before) * self._hz
        free = now.cpus * (1.0 - max(0.0, others) / total)
        if now.running is not None:
            free = min(free, now.cpus - (now.running - 1))  # ``- 1``: this thread, running as it reads
        return max(0.0, free)


def next_pause(free_cores: float | None, pause: float, *, min_free: float = MIN_FREE_CORES,
               first: float = FIRST_PAUSE_SECONDS, longest: float = MAX_PAUSE_SECONDS) -> float:
    """Seconds to wait before reading on (0: now), given measured idle cores (``None``: read on) and the previous
    ``pause``."""
    if free_cores is None or free_cores >= min_free:
        return 0.0
    return first if pause <= 0 else min(longest, pause * 2)


def _read_run_delay() -> float | None:
    """Seconds this thread has spent ready to run but waiting for a CPU (``/proc/thread-self/schedstat``)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class Throttle:
    """Paces one verification's reads (called with each read's size, from the reading thread).

    Waits while fewer than ``min_free`` cores (default: :data:`MIN_FREE_ENV`, else :data:`MIN_FREE_CORES`) are idle,
    looking at the first read and every ``window`` seconds.
    Every ``check`` seconds it reads its ``run_delay``: a ``preempted`` share means another task wanted the core, and
    it backs off at once rather than fill each gap between parallel regions. Waits go ``first`` doubling to
    ``longest``; ``throttled_s`` sums them. ``probe`` ``None``: never waits. Once ``lifted()`` says ``True``,
    ``on_lift`` runs once in the reading thread and the throttle stays lifted.
    """

    def __init__(self, probe: IdleProbe | None, *, min_free: float | None = None, window: float = WINDOW_SECONDS,
                 first: float = FIRST_PAUSE_SECONDS, longest: float = MAX_PAUSE_SECONDS,
                 check: float = CHECK_SECONDS, preempted: float = PREEMPTED_SHARE,
                 clock: Callable[[], float] = time.monotonic, lifted: Callable[[], bool] | None = None,
                 run_delay: Callable[[], float | None] = _read_run_delay,
                 on_lift: Callable[[], None] | None = None) -> None:
        self.probe = probe
        self.min_free = env_number(MIN_FREE_ENV, MIN_FREE_CORES) if min_free is None else min_free
        self.window = window
        self.first = first
        self.longest = longest
        self.check = check
        self.preempted = preempted
        self.throttled_s = 0.0
        self._clock = clock
        self._lifted = threading.Event()  # also ends a wait in progress
        self._asked_lift = lifted
        self._on_lift = on_lift
        self._run_delay = run_delay
        self._since = clock() - window  # the first read looks
        self._measured = False
        self._pause = 0.0  # the last wait; back to 0 after a window of reading undisturbed
        self._checked_at = clock()
        self._delay_at = run_delay() if probe is not None else None
        if probe is not None:
            probe.look()  # the first look starts the first window

    def lift(self) -> None:
        """Read at full speed from now on (and end a wait in progress)."""
        self._lifted.set()

    @property
    def lifted(self) -> bool:
        if not self._lifted.is_set() and self._asked_lift is not None and self._asked_lift():
            self._lifted.set()
            if self._on_lift is not None:
                self._on_lift()
        return self._lifted.is_set()

    def __call__(self, nbytes: int) -> None:
        if self.lifted or self.probe is None:  # asked first: a lift is seen (and acted on) even unthrottled
            return
        now = self._clock()
        pushed_aside = self._was_preempted(now)
        if not pushed_aside and now - self._since < self.window:
            return
        if pushed_aside:
            self._pause = next_pause(0.0, self._pause, min_free=1.0, first=self.first, longest=self.longest)
            self._wait(self._pause)
        elif self._measured:
            self._pause = 0.0  # a whole window read undisturbed
        while not self.lifted:
            free = self.probe.look()
            if free is None and not self._measured:
                # Nothing measured yet (the first read): measure over a short wait rather than read blind.
                self._measured = True
                self._wait(self.first)
                continue
            self._measured = True
            if next_pause(free, 0.0, min_free=self.min_free) <= 0:
                break
            self._pause = next_pause(free, self._pause, min_free=self.min_free, first=self.first,
                                     longest=self.longest)
            self._wait(self._pause)
        self._since = self._checked_at = self._clock()
        self._delay_at = self._run_delay()

    def _was_preempted(self, now: float) -> bool:
        """Whether this thread waited for a CPU for a ``preempted`` share of the time since the last check."""
        if self._delay_at is None or now - self._checked_at < self.check:
            return False
        delay = self._run_delay()
        if delay is None:
            self._delay_at = None
            return False
        waited, elapsed = delay - self._delay_at, now - self._checked_at
        self._delay_at, self._checked_at = delay, now
        return waited >= self.preempted * elapsed

    def _wait(self, seconds: float) -> None:
        started = self._clock()
        self._lifted.wait(seconds)
        self.throttled_s += self._clock() - started
