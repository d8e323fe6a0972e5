"""A forged, damaged or reordered ``events.jsonl``: every line that is not an event as ckptverify writes it is
skipped and reported (``read_events(on_bad=)``), whichever schema it claims; nothing crashes, and no consumer of a
run directory acts on what an event says."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptverify as cv
from ckptverify.ownfiles.events import EVENTS_FILE, MAX_LINE_BYTES, EventLog, read_events

_ENVELOPE = {"time": "2025-01-01T00:00:00.000+00:00", "rank": 0, "host": "h"}
#: A verification event as ckptverify writes it.
_FAILED = {"event": "checkpoint-failed", "schema_version": 1, **_ENVELOPE, "path": "step_2", "step": 2,
       "verdict": "failed", "passed": False, "pending": False, "deleted": False, "no_verdict": None,
       "summary": {"error": 1}, "first_error": "zip-crc: corrupt", "errors": [], "coverage": [],
       "bytes_checked": 10, "manifest": False, "unchecked": [], "warnings": [], "deep": False, "seconds": 0.5,
       "throttled_s": 0.0, "stamped": True, "stamp": None, "reason": None, "message": "failed"}
_BEFORE = {"event": "start", "schema_version": 1, **_ENVELOPE, "step": 0, "resumed_from": None, "world_size": 1}
_AFTER = {"event": "end", "schema_version": 1, **_ENVELOPE, "step": 4}


def _wrong(value: Any) -> Any:
    """A value of another JSON type than ``value``'s."""
    if isinstance(value, bool):
        return "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return 7
    if value is None:
        return True
    return "x" if isinstance(value, list | dict) else None


def _lines(line: bytes) -> bytes:
    return (json.dumps(_BEFORE) + "\n").encode() + line + b"\n" + (json.dumps(_AFTER) + "\n").encode()


def _read(run: Path, content: bytes) -> tuple[list[str], list[tuple[int, str]]]:
    run.mkdir(parents=True, exist_ok=True)
    (run / EVENTS_FILE).write_bytes(content)
    bad: list[tuple[int, str]] = []
    return [e["event"] for e in read_events(run, on_bad=lambda n, why: bad.append((n, why)))], bad


_WRONG_TYPES = [pytest.param(json.dumps({**_FAILED, field: _wrong(value)}).encode(), id=field)
                for field, value in _FAILED.items() if field != "first_error"]  # free text
_HOSTILE = [
    pytest.param(json.dumps({**_FAILED, "step": 1 << 64}).encode(), id="huge-step"),
    pytest.param(json.dumps({**_FAILED, "rank": 1 << 40}).encode(), id="huge-rank"),
    pytest.param(json.dumps({**_FAILED, "bytes_checked": 10 ** 30}).encode(), id="huge-bytes"),
    pytest.param(json.dumps({**_FAILED, "step": -1}).encode(), id="negative-step"),
    pytest.param(json.dumps({**_FAILED, "bytes_checked": 1}).encode().replace(b': 1,', b': 1' + b'0' * 5000 + b','),
                 id="5000-digit-number"),
    pytest.param(json.dumps({**_FAILED, "seconds": 0.5}).encode().replace(b"0.5", b"NaN"), id="nan"),
    pytest.param(json.dumps({**_FAILED, "seconds": 0.5}).encode().replace(b"0.5", b"Infinity"), id="infinity"),
    pytest.param(json.dumps({**_FAILED, "step": 2}).encode().replace(b'"step": 2', b'"step": 1e999'), id="1e999"),
    pytest.param(json.dumps({**_FAILED, "summary": {}}).encode().replace(b'"summary": {}', b'"summary": '
                                                                     + b"[" * 100 + b"]" * 100), id="nested"),
    pytest.param(b"[" * 200_000 + b"]" * 200_000, id="nested-past-the-recursion-limit"),
    pytest.param(b"[]", id="array"), pytest.param(b'"start"', id="string"), pytest.param(b"7", id="number"),
    pytest.param(b"null", id="null"),
    pytest.param(json.dumps(_FAILED).encode()[:-1] + b', "event": "checkpoint-verified"}', id="duplicate-key"),
    pytest.param(json.dumps({k: v for k, v in _FAILED.items() if k != "rank"}).encode(), id="no-rank"),
    pytest.param(json.dumps({**_FAILED, "event": "checkpoint-verified"}).encode(), id="verified-with-verdict-failed"),
    pytest.param(json.dumps({**_FAILED, "passed": True}).encode(), id="failed-with-passed-true"),
    pytest.param(json.dumps({**_FAILED, "verdict": "maybe"}).encode(), id="unknown-verdict"),
    pytest.param(json.dumps({k: v for k, v in _FAILED.items() if k != "verdict"}).encode(), id="no-verdict"),
    pytest.param(json.dumps({**_FAILED, "host": "h\u00e9"}).encode().replace(b"\\u00e9", b"\xff\xfe"),
                 id="invalid-utf-8"),
    pytest.param(json.dumps(_FAILED).encode()[:40], id="torn"),
]


@pytest.mark.parametrize("line", _WRONG_TYPES + _HOSTILE)
def test_a_line_that_is_not_an_event_is_skipped_and_reported(line: bytes, tmp_path: Path) -> None:
    names, bad = _read(tmp_path, _lines(line))
    assert names == ["start", "end"]
    assert len(bad) == 1 and bad[0][0] == 2 and bad[0][1], bad
    assert len(bad[0][1]) < 300  # one short line, whatever the line held


def test_a_good_line_is_read(tmp_path: Path) -> None:
    names, bad = _read(tmp_path, _lines(json.dumps(_FAILED).encode()))
    assert names == ["start", "checkpoint-failed", "end"] and bad == []


def test_an_enormous_line_is_skipped_in_bounded_memory(tmp_path: Path) -> None:
    huge = b'{"event": "start", "host": "' + b"x" * (8 * MAX_LINE_BYTES) + b'"}'
    (tmp_path / EVENTS_FILE).write_bytes(_lines(huge))
    del huge
    bad: list[int] = []
    tracemalloc.start()
    try:
        names = [e["event"] for e in read_events(tmp_path, on_bad=lambda n, why: bad.append(n))]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert names == ["start", "end"] and bad == [2]
    assert peak < 3 * MAX_LINE_BYTES, peak  # a block at a time, never the line


def test_an_enormous_unterminated_last_line_is_skipped(tmp_path: Path) -> None:
    content = (json.dumps(_BEFORE) + "\n").encode() + b"{" * (MAX_LINE_BYTES + 10)
    names, bad = _read(tmp_path, content)
    assert names == ["start"] and [n for n, _ in bad] == [2]


def test_out_of_order_times_and_steps_are_read_in_file_order(tmp_path: Path) -> None:
    lines = [{**_FAILED, "step": step, "path": f"step_{step}", "time": f"2025-01-0{day}T00:00:00.000+00:00"}
             for step, day in ((6, 3), (2, 1), (6, 3), (4, 2))]
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert [e["step"] for e in read_events(tmp_path)] == [6, 2, 6, 4]


def _state(seed: int) -> cv.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 32)
    return cv.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _flip(folder: Path) -> None:
    shard = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))


def test_no_consumer_acts_on_a_forged_event(tmp_path: Path) -> None:
    """scan, latest, prune and a production restart judge the checkpoints they find, never the log: a forged
    ``checkpoint-verified`` of a corrupt checkpoint, or of one outside the run, changes nothing."""
    from ckptverify.production.mode import ProductionOptions, _decide
    from ckptverify.runs.latest import latest_verified
    from ckptverify.runs.prune import prune
    from ckptverify.runs.scan import scan_run_dir

    run, outside = tmp_path / "run", tmp_path / "outside"
    cv.save(_state(1), run / "step_1")
    cv.save(_state(2), run / "step_2")
    _flip(run / "step_2")
    cv.save(_state(9), outside / "step_9")
    forged = [{**_FAILED, "event": "checkpoint-verified", "verdict": "passed", "passed": True, "path": str(where),
               "step": step} for where, step in ((run / "step_2", 2), (outside / "step_9", 9),
                                                 ("../outside/step_9", 9))]
    log = "".join(json.dumps(e) + "\n" for e in forged) + "".join(
        p.values[0].decode(errors="replace") + "\n" for p in _HOSTILE[:12])
    (run / EVENTS_FILE).write_text(log)
    before = sorted(os.listdir(outside / "step_9"))

    assert Path(latest_verified(run).path or "").name == "step_1"
    rows = {Path(r["path"]).name: r["state"] for r in scan_run_dir(run).stats["checkpoints"]}
    assert rows == {"step_1": "verified", "step_2": "corrupt"}
    assert prune(run, keep=1).deleted == []  # step_2 failed: evidence; step_1 the newest that verifies
    assert Path(_decide(ProductionOptions(run_dir=str(run), steps=10))["picked"]["path"]).name == "step_1"
    assert sorted(os.listdir(outside / "step_9")) == before and not (outside / "quarantine").exists()
    # The log still reads: the forged lines as written (a record, not an instruction), the hostile ones skipped.
    assert [e["path"] for e in read_events(run, "checkpoint-verified")] == [str(w) for w in
                                                                             (run / "step_2", outside / "step_9")] + [
        "../outside/step_9"]
    EventLog(run).emit("end", step=3)
    assert [e["event"] for e in read_events(run)][-1] == "end"
