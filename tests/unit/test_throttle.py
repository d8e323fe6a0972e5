"""The background verifier's throttle: it reads the idle cores right from ``/proc/stat`` (its own CPU time not
counted), backs off while none is idle and reads on when one is, lifts when someone waits, records the time it
waited, and never changes a verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import faults as inj

import ckptverify as cv
from ckptverify.ownfiles.events import read_events
from ckptverify.runs.stamp import read_stamp
from ckptverify.safeparse.readers import ReadOnlyFile, pacing
from ckptverify.verifier import background
from ckptverify.verifier.background import BackgroundVerifier
from ckptverify.verifier.stamper import stamp_locked
from ckptverify.verifier.throttle import (
    MIN_FREE_ENV,
    THROTTLE_ENV,
    CpuTimes,
    IdleProbe,
    Throttle,
    next_pause,
    parse_proc_stat,
    throttle_enabled,
)

REPO = Path(__file__).resolve().parents[2]


def _stat(*cpus: tuple[int, int, int, int], running: int = 1) -> str:
    """``/proc/stat`` text for CPUs given as (user, system, idle, iowait) ticks, with the all-CPU line, and
    ``running`` tasks ready to run."""
    rows = [f"cpu{i}  {u} 0 {s} {idle} {io} 0 0 0 0 0" for i, (u, s, idle, io) in enumerate(cpus)]
    total = [sum(c[k] for c in cpus) for k in range(4)]
    head = f"cpu  {total[0]} 0 {total[1]} {total[2]} {total[3]} 0 0 0 0 0"
    return "\n".join([head, *rows, "intr 1 2 3", "ctxt 99", "btime 1700000000", f"procs_running {running}",
                      "procs_blocked 0"]) + "\n"


class FakeMachine:
    """Cumulative ``/proc/stat`` ticks and the verifier's own CPU seconds, advanced by hand."""

    def __init__(self, cpus: int) -> None:
        self.ticks = [[0, 0, 0, 0] for _ in range(cpus)]
        self.own = 0.0
        self.running = 1  # the verifier, reading /proc/stat

    def run(self, cpu: int, busy: int = 0, idle: int = 0, iowait: int = 0) -> None:
        self.ticks[cpu][0] += busy
        self.ticks[cpu][2] += idle
        self.ticks[cpu][3] += iowait

    def text(self) -> str:
        return _stat(*(tuple(c) for c in self.ticks), running=self.running)  # type: ignore[arg-type]

    def probe(self, cpus: set[int] | None = None) -> IdleProbe:
        return IdleProbe(read_stat=self.text, own_seconds=lambda: self.own,
                         cpus=cpus or set(range(len(self.ticks))), hz=100)


# ---------------------------------------------------------------------------------- /proc/stat

def test_proc_stat_counts_idle_and_iowait_as_not_busy_and_guest_time_once() -> None:
    text = "cpu  100 5 20 300 10 1 2 3 40 0\ncpu0 100 5 20 300 10 1 2 3 40 0\n"
    assert parse_proc_stat(text) == CpuTimes(busy=100 + 5 + 20 + 1 + 2 + 3, total=441, cpus=1)


def test_proc_stat_of_a_subset_of_cpus_sums_their_lines() -> None:
    text = _stat((10, 0, 90, 0), (50, 0, 40, 10), (0, 0, 100, 0))
    assert parse_proc_stat(text, {1, 2}) == CpuTimes(busy=50, total=200, cpus=2)  # machine-wide count left out
    assert parse_proc_stat(text) == CpuTimes(busy=60, total=300, cpus=3, running=1)
    assert parse_proc_stat(text, {7}) is None  # none of the CPUs asked for is online


@pytest.mark.parametrize("text", ["", "intr 1 2\n", "cpu  a b c d e\ncpu0 a b c d e\n", "cpu0 1 2\n"])
def test_unreadable_proc_stat_gives_no_reading(text: str) -> None:
    assert parse_proc_stat(text) is None


def test_this_machine_has_a_readable_proc_stat_on_linux() -> None:
    if not sys.platform.startswith("linux"):
        assert IdleProbe.open() is None or os.path.exists("/proc/stat")
        return
    probe = IdleProbe.open()
    assert probe is not None
    assert probe.look() is None  # the first look only starts a window
    time.sleep(0.05)
    free = probe.look()
    assert free is None or 0.0 <= free <= len(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------------- the idle-core probe

def test_probe_sees_no_idle_core_while_training_keeps_every_cpu_busy() -> None:
    m = FakeMachine(4)
    probe = m.probe()
    assert probe.look() is None
    for cpu in range(4):
        m.run(cpu, busy=10)
    assert probe.look() == pytest.approx(0.0)


def test_probe_counts_idle_and_io_waiting_cpus_as_free() -> None:
    m = FakeMachine(4)
    probe = m.probe()
    probe.look()
    m.run(0, busy=10)  # the GPU-feeding Python thread
    m.run(1, idle=10)
    m.run(2, idle=5, iowait=5)
    m.run(3, busy=5, idle=5)
    assert probe.look() == pytest.approx(2.5)


def test_probe_does_not_count_the_verifiers_own_cpu_time_as_busy() -> None:
    m = FakeMachine(2)
    probe = m.probe()
    probe.look()
    m.run(0, busy=10)  # training, one thread
    m.run(1, busy=10)  # the verifier, reading at full speed on the free core
    m.own += 0.10  # 10 ticks at 100 Hz
    assert probe.look() == pytest.approx(1.0)


def test_probe_sees_no_idle_core_when_every_core_has_a_task_ready_right_now() -> None:
    m = FakeMachine(4)
    probe = m.probe()
    probe.look()
    for cpu in range(4):  # parallel regions with idle gaps between them: a third idle on average
        m.run(cpu, busy=20, idle=10)
    m.running = 5  # looked during a region: four training threads and the verifier
    assert probe.look() == pytest.approx(0.0)
    for cpu in range(4):
        m.run(cpu, busy=20, idle=10)
    m.running = 2  # looked in a gap: the main thread and the verifier
    assert probe.look() == pytest.approx(4 / 3)


def test_probe_counts_only_the_cpus_it_may_run_on() -> None:
    m = FakeMachine(4)
    probe = m.probe(cpus={2, 3})
    probe.look()
    m.run(0, idle=10)
    m.run(1, idle=10)
    m.run(2, busy=10)
    m.run(3, busy=10)
    assert probe.look() == pytest.approx(0.0)


def test_probe_keeps_measuring_from_the_last_look_when_no_tick_passed() -> None:
    m = FakeMachine(2)
    probe = m.probe()
    probe.look()
    m.run(0, busy=10)
    m.run(1, busy=10)
    assert probe.look() == pytest.approx(0.0)
    assert probe.look() is None  # too soon: nothing to measure
    m.run(0, idle=10)
    m.run(1, idle=10)
    assert probe.look() == pytest.approx(2.0)


# ---------------------------------------------------------------------------------- back-off

def test_back_off_waits_longer_each_time_no_core_is_idle_up_to_the_longest_wait() -> None:
    pauses, pause = [], 0.0
    for _ in range(5):
        pause = next_pause(0.1, pause, min_free=0.5, first=0.025, longest=0.1)
        pauses.append(pause)
    assert pauses == [0.025, 0.05, 0.1, 0.1, 0.1]


@pytest.mark.parametrize("free", [0.5, 1.0, 3.7, None])
def test_back_off_reads_on_when_a_core_is_idle_or_nothing_is_known(free: float | None) -> None:
    assert next_pause(free, 0.1, min_free=0.5) == 0.0


def test_the_throttle_switches_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert throttle_enabled({}) and throttle_enabled({THROTTLE_ENV: "1"})
    assert not any(throttle_enabled({THROTTLE_ENV: v}) for v in ("0", "off", "False", " no "))
    monkeypatch.delenv(MIN_FREE_ENV, raising=False)
    assert Throttle(None).min_free == 0.5
    for raw, want in (("1.5", 1.5), ("many", 0.5), ("-1", 0.5)):
        monkeypatch.setenv(MIN_FREE_ENV, raw)
        assert Throttle(None).min_free == want
    monkeypatch.setenv(THROTTLE_ENV, "0")
    assert BackgroundVerifier().throttle is False
    assert BackgroundVerifier(throttle=True).throttle is True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedProbe:
    """Answers each look with the next reading (idle cores), counting the looks."""

    def __init__(self, *readings: float | None) -> None:
        self.readings = list(readings)
        self.looks = 0

    def look(self) -> float | None:
        self.looks += 1
        return self.readings.pop(0) if self.readings else 8.0


def _no_delay() -> float | None:
    return None  # no run-delay counter: only the looks decide


class ClockedWake:
    """Stands in for a throttle's lift event: never set, each wait moves ``clock`` on by its length."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.waits: list[float] = []

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.clock.now += seconds
        return False

    def is_set(self) -> bool:
        return False


def test_throttle_waits_while_no_core_is_idle_and_records_the_time() -> None:
    clock = Clock()
    probe = ScriptedProbe(None, 0.0, 0.1, 0.2, 3.0)  # construction; then busy, busy, busy, free
    throttle = Throttle(probe, min_free=0.5, window=0.05, first=0.01, longest=0.02,  # type: ignore[arg-type]
                        clock=clock, run_delay=_no_delay)
    wake = ClockedWake(clock)
    throttle._lifted = wake  # type: ignore[assignment]
    throttle(1 << 20)
    assert probe.looks == 5
    assert wake.waits == [0.01, 0.02, 0.02]  # doubling up to the longest, one wait per busy look
    assert throttle.throttled_s == pytest.approx(0.01 + 0.02 + 0.02)  # every second waited, recorded


def test_throttle_looks_at_the_first_read_then_once_per_window() -> None:
    clock = Clock()
    probe = ScriptedProbe(None, 2.0)
    throttle = Throttle(probe, min_free=0.5, window=0.05, clock=clock, run_delay=_no_delay)  # type: ignore[arg-type]
    throttle(1 << 20)  # the first read looks
    assert probe.looks == 2
    clock.now += 0.01
    throttle(1 << 20)  # inside the window: no look
    assert probe.looks == 2
    clock.now += 0.05
    throttle(1 << 20)
    assert probe.looks == 3 and throttle.throttled_s == 0.0


def test_throttle_measures_before_the_first_read_when_it_knows_nothing_yet() -> None:
    probe = ScriptedProbe(None, None, 0.0, 2.0)  # construction; first read: unknown, measured: busy, free
    throttle = Throttle(probe, min_free=0.5, window=0.05, first=0.01, longest=0.01,  # type: ignore[arg-type]
                        run_delay=_no_delay)
    throttle(1 << 20)
    assert probe.looks == 4 and throttle.throttled_s >= 0.015


class Delay:
    """A thread's cumulative wait for a CPU, set by hand."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


def test_a_thread_pushed_aside_waits_at_once_and_longer_each_time_then_reads_on_when_a_core_is_idle() -> None:
    clock, delay = Clock(), Delay()
    probe = ScriptedProbe(None, 2.0, 2.0, 2.0, 2.0)  # every look finds idle cores
    waits: list[float] = []
    throttle = Throttle(probe, window=10.0, first=0.01, longest=0.04, check=0.002, preempted=0.25,  # type: ignore[arg-type]
                        clock=clock, run_delay=delay)
    throttle._wait = waits.append  # type: ignore[method-assign]
    throttle(1 << 20)  # the first read looks: idle cores, no wait
    assert probe.looks == 2 and waits == []
    clock.now += 0.004
    delay.seconds += 0.0005  # waited 0.5 ms of 4: an ordinary wake-up of someone else
    throttle(1 << 20)
    assert waits == [] and probe.looks == 2  # inside the window, not pushed aside: nothing
    for expected in ([0.01], [0.01, 0.02], [0.01, 0.02, 0.04], [0.01, 0.02, 0.04, 0.04]):
        clock.now += 0.004
        delay.seconds += 0.003  # waited 3 ms of 4 for the CPU: the training needed it
        throttle(1 << 20)
        assert waits == expected  # waited at once, long before the window ended, then looked
    assert probe.looks == 6
    clock.now += 10.0  # a whole window read undisturbed: the next push starts from the first wait
    throttle(1 << 20)
    clock.now += 0.004
    delay.seconds += 0.004
    throttle(1 << 20)
    assert waits[-1] == 0.01


def test_a_lifted_throttle_stops_waiting_at_once() -> None:
    import threading

    class LiftedWhileWaiting(ScriptedProbe):
        """Busy at every look; the look before the first wait has another thread lift the throttle."""

        def look(self) -> float | None:
            if self.looks == 1:
                threading.Thread(target=throttle.lift).start()
            return super().look()

    # Each wait an hour: only the lift can end the call within the join's deadline.
    throttle = Throttle(LiftedWhileWaiting(*[0.0] * 1000), min_free=0.5, first=3600.0, longest=3600.0,
                        run_delay=_no_delay)  # type: ignore[arg-type]
    reader = threading.Thread(target=throttle, args=(1 << 20,), daemon=True)
    reader.start()
    reader.join(timeout=120)
    assert not reader.is_alive() and throttle.lifted
    assert throttle.throttled_s < 3600.0
    answers = iter([False] * 5 + [True] * 100)  # the parent asks for full speed after a while
    asked = Throttle(ScriptedProbe(*[0.0] * 1000), first=0.01, longest=0.01,  # type: ignore[arg-type]
                     lifted=lambda: next(answers), run_delay=_no_delay)
    asked(1 << 20)
    assert asked.lifted and asked.throttled_s > 0


def test_this_thread_s_wait_for_a_cpu_is_readable_on_linux() -> None:
    from ckptverify.verifier.throttle import _read_run_delay

    first = _read_run_delay()
    if not os.path.exists("/proc/thread-self/schedstat"):
        assert first is None
        return
    assert first is not None and first >= 0 and (_read_run_delay() or 0) >= first


def test_without_a_probe_the_throttle_never_waits() -> None:
    throttle = Throttle(None)
    throttle(1 << 30)
    assert throttle.throttled_s == 0.0


def test_a_hurry_names_its_request_so_a_late_one_never_lifts_the_next() -> None:
    from ckptverify.verifier.worker import _hurry_reader

    r, w = os.pipe()
    try:
        hurried = _hurry_reader(str(r))
        assert hurried is not None and not hurried(1)
        os.write(w, b"1\n")  # asked while request 1 was in flight
        assert hurried(1) and not hurried(2)
        os.write(w, b"2")  # a line cut in two by the pipe
        assert not hurried(2)
        os.write(w, b"\n")
        assert hurried(2) and not hurried(3)
    finally:
        os.close(r)
        os.close(w)
    assert _hurry_reader(None) is None and _hurry_reader("not a number") is None


# ---------------------------------------------------------------------------------- reads and verdicts

def test_a_paced_read_sees_every_byte_and_the_same_crc(tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 12345)
    (tmp_path / "f").write_bytes(data)
    seen: list[int] = []
    with ReadOnlyFile(str(tmp_path / "f")) as f:
        plain = f.crc32(0, f.size)
        with pacing(seen.append):
            paced = f.crc32(0, f.size)
        f.crc32(0, f.size)  # outside the block: not paced
    assert paced == plain and sum(seen) == len(data) and len(seen) == 4


@pytest.mark.parametrize("layout", ["dcp", "safetensors"])
def test_a_deep_verification_paces_its_tensor_rebuild_too(layout: str, tmp_path: Path) -> None:
    """The deep check reads every tensor again to rebuild it: those reads are paced like the hashing's."""
    from ckptverify.audit.verify import verify_checkpoint

    w = torch.arange(300_000.0)
    if layout == "dcp":
        cv.save({"w": w}, tmp_path / "ckpt")
        path = tmp_path / "ckpt"
    else:
        from safetensors.torch import save_file

        path = tmp_path / "model.safetensors"
        save_file({"w": w}, str(path))
    seen: dict[bool, list[int]] = {False: [], True: []}
    for deep in (False, True):
        with pacing(seen[deep].append):
            assert verify_checkpoint(path, deep=deep, jobs=1).passed  # one thread: all its reads paced
    assert sum(seen[True]) - sum(seen[False]) >= w.numel() * w.element_size(), {k: sum(v) for k, v in seen.items()}


def test_a_throttled_verification_finds_the_same_as_an_unthrottled_one(tmp_path: Path) -> None:
    for name in ("a", "b"):
        cv.save({"w": torch.arange(300_000.0), "v": torch.ones(1000)}, tmp_path / name)
        inj.flip_in_tensor_payload(tmp_path / name, "w")
    plain = stamp_locked(str(tmp_path / "a"), step=1, settle=0.0)
    probe = ScriptedProbe(*([None] + [0.0, 2.0] * 50))  # alternately busy and idle
    throttle = Throttle(probe, min_free=0.5, window=0.0, first=0.001, longest=0.001,  # type: ignore[arg-type]
                        run_delay=_no_delay)
    paced = stamp_locked(str(tmp_path / "b"), step=1, settle=0.0, throttle=throttle)
    assert plain.report is not None and paced.report is not None
    assert not paced.report.passed and probe.looks > 2 and paced.throttled_s > 0
    same = [json.dumps(f.to_dict(), sort_keys=True).replace(str(tmp_path / "a"), str(tmp_path / "b"))
            for f in plain.report.findings]
    assert [json.dumps(f.to_dict(), sort_keys=True) for f in paced.report.findings] == same
    assert paced.report.stats["bytes"] == plain.report.stats["bytes"]
    assert read_stamp(tmp_path / "b").data["throttled_s"] == paced.throttled_s  # type: ignore[union-attr]
    assert "throttled_s" not in read_stamp(tmp_path / "a").data  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------- the background verifier

@pytest.fixture
def never_idle(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A machine that never has enough idle cores (the throttle waits until lifted)."""
    monkeypatch.setenv(MIN_FREE_ENV, "100000")
    monkeypatch.delenv(THROTTLE_ENV, raising=False)
    yield


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((256, 256), value), "b": torch.arange(64.0) + value}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the throttle reads /proc/stat")
@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_throttled_verification_waits_then_completes_and_stamps_once_waited_for(
        tmp_path: Path, never_idle: None, isolation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Normal priority: on a loaded machine an idle-priority verifier may not even start within the test's wait.
    verifier = BackgroundVerifier(isolation=isolation, settle=0.05, priority="normal")
    monkeypatch.setattr(background, "_default", verifier)
    try:
        cv.save(_state(0.0), tmp_path / "step_0", verify="background")
        assert cv.wait_for_verifications(timeout=60)  # the verifier process is up
        cv.save(_state(1.0), tmp_path / "step_1", verify="background", events=tmp_path)
        time.sleep(2.0)
        assert verifier.pending() == [str(tmp_path / "step_1")]  # held back: no core is idle
        assert read_stamp(tmp_path / "step_1") is None
        assert cv.wait_for_verifications(timeout=60)  # someone waits: it reads on at full speed
    finally:
        verifier.close(timeout=60)
    result = verifier.last()
    assert result is not None and result.passed and result.throttled_s >= 0.5
    stamp = read_stamp(tmp_path / "step_1")
    assert stamp is not None and stamp.current and stamp.data["throttled_s"] == result.throttled_s
    [event] = read_events(tmp_path, "checkpoint-verified")
    assert event["throttled_s"] == result.throttled_s


def _can_raise_priority() -> bool:
    """Whether a process here may go back from idle priority to normal (``CAP_SYS_NICE`` or ``RLIMIT_NICE``)."""
    code = ("from ckptverify.verifier.worker import lower_priority, restore_priority\n"
            "lower_priority('idle', whole_process=True)\nprint(restore_priority(0))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


def _eventually(condition: Any, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduling classes and /proc/stat are Linux's")
@pytest.mark.parametrize("waiter", ["wait", "wait_for"])
def test_a_verification_waited_for_runs_at_the_waiter_s_priority_and_the_next_one_at_idle_again(
        tmp_path: Path, never_idle: None, waiter: str) -> None:
    """On a machine kept busy by other processes an idle-priority verifier would never finish what a job
    ending waits for: once waited for, it runs at the waiter's priority, where the system allows it."""
    can_raise = _can_raise_priority()
    verifier = BackgroundVerifier(settle=0.0)  # a verifier process, idle priority, throttled
    try:
        cv.save(_state(1.0), tmp_path / "a")
        verifier.submit(tmp_path / "a", step=1)
        assert _eventually(lambda: verifier._child._proc is not None)
        pid = verifier._child._proc.pid  # type: ignore[union-attr]
        assert _eventually(lambda: os.sched_getscheduler(pid) == os.SCHED_IDLE)
        assert verifier.pending() == [str(tmp_path / "a")]  # held back by the throttle: no core is idle
        if waiter == "wait":  # every verification (the end of a job)
            assert verifier.wait(timeout=60)
        else:  # these ones (an integration's end of training, a resume)
            assert verifier.wait_for([tmp_path / "a"], timeout=60)
        assert read_stamp(tmp_path / "a").passed  # type: ignore[union-attr]
        if can_raise:
            assert os.sched_getscheduler(pid) == os.SCHED_OTHER
            assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, os.getpid())
        else:  # the system does not let it: it stays at idle priority (docs/verify-after-save.md, Limits)
            assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        cv.save(_state(2.0), tmp_path / "b")
        verifier.submit(tmp_path / "b", step=2)  # nobody waits for this one: idle priority again
        assert _eventually(lambda: os.sched_getscheduler(pid) == os.SCHED_IDLE)
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19
        assert verifier.wait(timeout=60) and read_stamp(tmp_path / "b").passed  # type: ignore[union-attr]
    finally:
        verifier.close(timeout=60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the throttle reads /proc/stat")
def test_turned_off_by_environment_the_verifier_reads_at_full_speed(tmp_path: Path, never_idle: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THROTTLE_ENV, "0")
    # Normal priority: nobody waits for this one, and at idle priority a loaded machine would starve it.
    verifier = BackgroundVerifier(settle=0.05, priority="normal")
    try:
        cv.save(_state(1.0), tmp_path / "step_1")
        verifier.submit(tmp_path / "step_1", step=1)
        deadline = time.monotonic() + 60
        while verifier.pending() and time.monotonic() < deadline:  # not waited for: nothing lifts a throttle
            time.sleep(0.05)
        result = verifier.last()
        assert result is not None and result.passed and result.throttled_s == 0.0
        assert "throttled_s" not in read_stamp(tmp_path / "step_1").data  # type: ignore[union-attr]
    finally:
        verifier.close(timeout=60)


_JOB = """
import os, sys, time
import torch
import ckptverify as cv
from ckptverify.verifier.background import default_verifier

from ckptverify.verifier import background
from ckptverify.verifier.background import BackgroundVerifier

run = sys.argv[1]
default_verifier()  # the process's verifier, waited for at exit; at normal priority so that it starts on a busy machine
background._default = BackgroundVerifier(priority="normal")
cv.save({"w": torch.zeros(256, 256)}, os.path.join(run, "step_0"), verify="background")
cv.wait_for_verifications(timeout=60)  # the verifier process is up
for step in (1, 2):
    cv.save({"w": torch.full((256, 256), float(step))}, os.path.join(run, f"step_{step}"), verify="background",
            events=run)
time.sleep(2.0)  # training on: the verifier is held back
print("pending at exit:", len(default_verifier().pending()), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the throttle reads /proc/stat")
def test_a_job_that_ends_lifts_the_throttle_and_every_checkpoint_carries_a_stamp(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _JOB, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), MIN_FREE_ENV: "100000"}, cwd=str(REPO))
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split("pending at exit:")[1]) >= 1
    events = list(read_events(tmp_path, "checkpoint-verified"))
    assert [e["step"] for e in events] == [1, 2] and "Warning" not in done.stderr
    assert events[0]["throttled_s"] >= 0.5  # it was held back until the job ended
    for step in (1, 2):
        stamp = read_stamp(tmp_path / f"step_{step}")
        assert stamp is not None and stamp.current and stamp.passed
