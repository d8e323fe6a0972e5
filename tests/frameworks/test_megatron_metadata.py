"""Megatron-style metadata: DCP's planner dataclasses attached to ``.metadata``.

Megatron Core's ``torch_dist`` backend sets ``metadata.all_local_plans`` (its ``MCoreSavePlan`` subclass of
DCP's ``SavePlan``, holding ``WriteItem``/``TensorWriteData``/``BytesIOWriteData``) and ``mcore_data``. These
tests build such a file with DCP's real classes, pickled by torch itself, since Megatron does not install on
this CI Python; ``MCoreSavePlan`` is declared under Megatron's module name exactly as Megatron declares it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import pickle
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from ckptverify.audit.verify import verify_checkpoint
from ckptverify.dcp import metadata as md
from ckptverify.dcp.storage_reader import SafeFileSystemReader

MCORE_MODULE = "megatron.core.dist_checkpointing.strategies.torch"


def _mcore_save_plan_class() -> type:
    """Megatron's ``MCoreSavePlan`` (``@dataclass(frozen=True)`` subclass of ``SavePlan``), under its own name."""
    module = sys.modules.get(MCORE_MODULE)
    if module is None:
        module = types.ModuleType(MCORE_MODULE)
        sys.modules[MCORE_MODULE] = module
    if not hasattr(module, "MCoreSavePlan"):
        cls = dataclasses.make_dataclass("MCoreSavePlan", [("mcore_data", dict | None, dataclasses.field(
            default=None))], bases=(SavePlan,), frozen=True)
        cls.__module__ = MCORE_MODULE
        module.MCoreSavePlan = cls
    return module.MCoreSavePlan


@pytest.fixture
def megatron_ckpt(tmp_path):
    state = {"decoder.weight": torch.randn(64, 32), "decoder.bias": torch.randn(64),
             "embedding": torch.randn(16, 8, dtype=torch.bfloat16), "common.step": 7}
    path = tmp_path / "iter_0000010"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    metadata = pickle.loads((path / ".metadata").read_bytes())  # written just now by DCP: trusted
    mcore = _mcore_save_plan_class()
    plans = []
    for rank in range(2):
        items: list[Any] = []
        for fqn, value in state.items():
            items += _create_write_items(fqn, value)
        plans.append(mcore(items=items, planner_data={k: (k,) for k in state}, usable=True,
                           mcore_data={"decoder.weight": {"nd_reformulated_orig_global_shape": None,
                                                          "rank": rank}}))
    plans.append(SavePlan(items=_create_write_items("common.step", 7)))
    metadata.all_local_plans = plans
    metadata.mcore_data = {"decoder.weight": {"nd_reformulated_orig_global_shape": (64, 32)}}
    with _importable(MCORE_MODULE):
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
        globals_used = {f"{m}.{n}" for m, n in _globals((path / ".metadata").read_bytes())}
    assert {"torch.distributed.checkpoint.planner.WriteItem", f"{MCORE_MODULE}.MCoreSavePlan",
            "torch.distributed.checkpoint.planner.TensorWriteData"} <= globals_used
    return path, metadata


@contextlib.contextmanager
def _importable(name: str) -> Iterator[None]:
    """Let pickle import ``name`` (it imports a class's module and its parents to check the class is reachable).

    Without Megatron Core installed its parent packages do not exist: stand-ins are registered for the duration
    only, so no later import (a test that skips without Megatron) mistakes them for the real package."""
    added = []
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent in sys.modules:
            continue
        try:
            importlib.import_module(parent)
        except ImportError:
            sys.modules[parent] = types.ModuleType(parent)
            added.append(parent)
    try:
        yield
    finally:
        for parent in added:
            sys.modules.pop(parent, None)


def _globals(data: bytes) -> set[tuple[str, str]]:
    """Every global a (trusted, test-made) pickle names."""
    import io

    names: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            names.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return names


def test_megatron_style_metadata_verifies_clean(megatron_ckpt):
    path, _ = megatron_ckpt
    report = verify_checkpoint(path)
    assert report.exit_code == 0, [(f.check, f.message) for f in report.errors]
    assert [f.check for f in report.findings if f.severity.value != "info"] == []
    layout, findings = md.read_layout(str(path))
    assert findings == [] and set(layout.tensors) == {"decoder.weight", "decoder.bias", "embedding"}


def test_megatron_style_metadata_flipped_payload_byte_is_caught(megatron_ckpt):
    path, _ = megatron_ckpt
    layout, _ = md.read_layout(str(path))
    item = next(i for i in layout.items if i.fqn == "decoder.weight")
    shard = path / item.file
    data = bytearray(shard.read_bytes())
    at = item.offset + item.length // 2  # inside the 8 KiB payload record
    data[at] ^= 0x10
    shard.write_bytes(bytes(data))
    report = verify_checkpoint(path)
    assert report.exit_code == 1
    hits = [f for f in report.errors if f.check == "zip-crc"]
    assert hits and hits[0].location.fqn == "decoder.weight"


def test_safe_reader_rebuilds_megatron_metadata_exactly(megatron_ckpt):
    path, real = megatron_ckpt
    ours = SafeFileSystemReader(str(path)).read_metadata()
    ours.storage_meta.load_id = real.storage_meta.load_id = None
    assert ours == real
    assert ours.all_local_plans == real.all_local_plans and ours.mcore_data == real.mcore_data
    with _importable(MCORE_MODULE):
        assert pickle.dumps(ours) == pickle.dumps(real)


def test_planner_dataclasses_are_validated_not_trusted(megatron_ckpt):
    path, metadata = megatron_ckpt
    bad = dataclasses.replace(metadata.all_local_plans[0], items=["not a write item"])
    metadata.all_local_plans = [bad]
    with _importable(MCORE_MODULE):
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
    layout, findings = md.read_layout(str(path))
    assert layout is None and findings[0].check == "metadata-unreadable"
    assert "write items" in findings[0].message
