"""Fuzzing ckptverify's own files as an attacker who can write the run directory writes them: stamps and
manifests mutated field by field (any JSON value in any place) and byte by byte. Every reader ends in a value, a
``None`` ("no stamp") or its own error type; nothing escapes, whatever the mutation."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.errors import ManifestError
from ckptverify.ownfiles.manifest import MANIFEST_FILE, read_manifest
from ckptverify.ownfiles.names import STAMP_FILE
from ckptverify.runs.latest import latest_verified
from ckptverify.runs.stamp import read_stamp, read_suspect, write_stamp

JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("own") / "step_1"
    dcp.save({"w": torch.arange(64.0).reshape(8, 8), "step": 1}, checkpoint_id=str(root))
    fingerprint_checkpoint(root)
    write_stamp(root, verify_checkpoint(root), step=1)
    return root


def _paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*at, i))
    return out


def _replace(value: Any, at: tuple[Any, ...], new: Any) -> Any:
    if not at:
        return new
    head, rest = at[0], at[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    copy = list(value)
    copy[head] = _replace(copy[head], rest, new)
    return copy


def _mutate(original: bytes, data: st.DataObject) -> bytes:
    if data.draw(st.booleans(), label="bytewise"):
        raw = bytearray(original)
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            at = data.draw(st.integers(0, len(raw) - 1))
            raw[at] = data.draw(st.integers(0, 255))
        return bytes(raw[: data.draw(st.integers(0, len(raw)), label="truncate at")])
    doc = json.loads(original)
    paths = _paths(doc)
    where = paths[data.draw(st.integers(0, len(paths) - 1), label="field")]
    return json.dumps(_replace(doc, where, data.draw(JSON, label="value"))).encode()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_stamp_is_a_stamp_or_none_for_every_reader(pristine: Path, tmp_path_factory: pytest.TempPathFactory,
                                                            data: st.DataObject) -> None:
    run = tmp_path_factory.mktemp("run")
    ckpt = run / "step_1"
    shutil.copytree(pristine, ckpt)
    (ckpt / STAMP_FILE).write_bytes(_mutate((pristine / STAMP_FILE).read_bytes(), data))
    stamp = read_stamp(ckpt)
    if stamp is not None:
        assert isinstance(stamp.passed, bool)
        _ = (stamp.state, stamp.step, stamp.suspect, stamp.current)
    read_suspect(ckpt)
    found = latest_verified(run)
    assert found.report is not None and found.step in (None, 1)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_manifest_is_a_manifest_or_a_manifest_error_and_verify_judges_it(
        pristine: Path, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    ckpt = tmp_path_factory.mktemp("m") / "step_1"
    shutil.copytree(pristine, ckpt)
    (ckpt / MANIFEST_FILE).write_bytes(_mutate((pristine / MANIFEST_FILE).read_bytes(), data))
    with contextlib.suppress(ManifestError):  # read_manifest's one error: a finding for verify
        read_manifest(str(ckpt))
    report = verify_checkpoint(ckpt)
    assert report.exit_code in (0, 1, 2)
