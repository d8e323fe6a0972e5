"""Properties: a single flipped bit in a checkpoint item never goes unnoticed.

One clean checkpoint per module, privately copied; each example flips one bit, verifies, and flips it
back, so examples are independent and fast.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import faults as inj
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptverify.audit.verify import verify_checkpoint
from ckptverify.findings import Report

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _describe(report: Report) -> str:
    return "\n".join(f"  {f.severity.value:7} {f.check:20} {f.location.describe()} :: {f.message}"
                     for f in report.findings) or "  (no findings)"


class Flipper:
    """A private copy of a clean checkpoint, plus what the properties draw from."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors = [(it, inj.payload_record(inj.zip_records(path, it))) for it in inj.tensor_zip_items(path)]
        self.items = [it for it in inj.items(path) if inj.is_zip_item(path, it)]
        # Per item, the byte ranges (relative to the item) that are zip structure rather than record data:
        # headers, names, padding, descriptors, central directory, end records.
        self.structure: list[list[tuple[int, int]]] = []
        for it in self.items:
            data = sorted((r.data_start - it.offset, r.data_end - it.offset) for r in inj.zip_records(path, it))
            gaps, pos = [], 0
            for start, end in data:
                if start > pos:
                    gaps.append((pos, start))
                pos = max(pos, end)
            if pos < it.length:
                gaps.append((pos, it.length))
            self.structure.append(gaps)
        self.before = verify_checkpoint(path, jobs=1)
        assert self.before.exit_code == 0, _describe(self.before)

    @contextlib.contextmanager
    def flipped(self, file: str, offset: int, bit: int) -> Iterator[inj.Fault]:
        fault = inj.flip_bit(self.path, file, offset, bit)
        try:
            yield fault
        finally:
            inj.flip_bit(self.path, file, offset, bit)


@pytest.fixture(scope="module", params=["single", "fsdp2"])
def flipper(request: pytest.FixtureRequest, ckpt_store: Any, tmp_path_factory: pytest.TempPathFactory) -> Flipper:
    layout = request.param
    return Flipper(ckpt_store.copy(layout, tmp_path_factory.mktemp("prop") / layout))


@SETTINGS
@given(data=st.data())
def test_payload_bit_flip_is_caught_and_located(flipper: Flipper, data: st.DataObject) -> None:
    item, rec = data.draw(st.sampled_from(flipper.tensors), label="item")
    byte = data.draw(st.integers(0, rec.data_len - 1), label="payload byte")
    bit = data.draw(st.integers(0, 7), label="bit")
    element = byte // item.itemsize
    with flipper.flipped(item.file, rec.data_start + byte, bit) as fault:
        report = verify_checkpoint(flipper.path, jobs=1)
        where = f"{item.fqn}@{list(item.chunk_offsets or ())} element {element} ({fault.to_dict()})"
        assert report.exit_code == 1, f"{where}\n{_describe(report)}"
        hits = [
            f for f in report.errors
            if f.check == "zip-crc"
            and f.location.fqn == item.fqn
            and f.location.chunk_offsets == item.chunk_offsets
            and f.location.file == item.file
            and f.location.element_range is not None
            and f.location.element_range[0] <= element < f.location.element_range[1]
            and f.location.byte_range is not None
            and f.location.byte_range[0] <= fault.byte_offset < f.location.byte_range[1]  # type: ignore[operator]
        ]
        assert hits, f"{where}\n{_describe(report)}"


@SETTINGS
@given(data=st.data())
def test_any_bit_flip_in_any_item_is_an_error(flipper: Flipper, data: st.DataObject) -> None:
    """Anywhere in an item: record data, or (half the draws) the zip structure around it."""
    index = data.draw(st.integers(0, len(flipper.items) - 1), label="item")
    item = flipper.items[index]
    if data.draw(st.booleans(), label="zip structure only"):
        start, end = data.draw(st.sampled_from(flipper.structure[index]), label="structure range")
        rel = data.draw(st.integers(start, end - 1), label="byte in item")
    else:
        rel = data.draw(st.integers(0, item.length - 1), label="byte in item")
    bit = data.draw(st.integers(0, 7), label="bit")
    offset = item.offset + rel
    with flipper.flipped(item.file, offset, bit) as fault:
        report = verify_checkpoint(flipper.path, jobs=1)
        if report.exit_code != 1:
            field = inj.zip_field_at(flipper.path, item, offset)
            pytest.fail(f"bit {bit} of {item.fqn} byte {rel} ({field}) flipped, not reported "
                        f"({fault.to_dict()})\n{_describe(report)}")
        assert report.errors


def test_flip_and_restore_leaves_the_checkpoint_clean(flipper: Flipper) -> None:
    """The properties above restore every bit they flip: the copy verifies clean again afterwards."""
    rng = random.Random(0)
    item, rec = rng.choice(flipper.tensors)
    with flipper.flipped(item.file, rec.data_start, 0):
        assert verify_checkpoint(flipper.path, jobs=1).exit_code == 1
    assert verify_checkpoint(flipper.path, jobs=1).exit_code == 0
