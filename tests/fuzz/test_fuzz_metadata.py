"""Fuzzing the metadata reader and the zip walker.

Every case must end in a parse or in one of the documented exceptions (the metadata reader:
``UnsafeGlobal``, ``BadPickle``; the zip walker: ``ArchiveError``; the tensor header reader:
``pickle.UnpicklingError``), never anything else. Where the safe reader *accepts* a metadata file, real
unpickling with torch's classes (restricted to the same allowlist, so nothing else can run) must accept it
too and give the same object, so what verify passes DCP can load without falling back to another file.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import random
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptverify.dcp import metadata as md
from ckptverify.dcp import metadata_pickle as sp
from ckptverify.dcp.storage_reader import build_metadata
from ckptverify.errors import ArchiveError, BadPickle, CheckpointRefusedError, UnsafeGlobal
from ckptverify.safeparse.torchsave import item_header
from ckptverify.safeparse.zipwalk import parse_archive

EXPECTED = (UnsafeGlobal, BadPickle)


class _RealAllowlist(pickle.Unpickler):
    """Real unpickling, but resolving only the allowlisted names (to torch's real objects)."""

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" not in sp.ALLOWED_GLOBALS or module.startswith("megatron"):
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def check_metadata_bytes(data: bytes) -> str:
    """Parse ``data`` safely; if accepted, real unpickling must agree. Returns the outcome's name."""
    try:
        parsed = md.parse_metadata(data)
    except EXPECTED as exc:
        return type(exc).__name__
    if parsed.unsafe_paths:
        return "unsafe path"  # a metadata-unsafe finding; the reader refuses to load it
    try:
        ours = build_metadata(parsed)
    except CheckpointRefusedError:
        return "CheckpointRefusedError"  # e.g. a dtype this torch lacks
    real = _RealAllowlist(io.BytesIO(data)).load()  # must not raise: the safe reader accepted it
    if getattr(real, "storage_meta", None) is not None:
        assert type(real.storage_meta) is StorageMeta
    assert ours == real
    return "accepted"


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> list[bytes]:
    """Real metadata files: several dtypes, byte values, nested dicts, two chunks of one tensor."""
    out = []
    root = tmp_path_factory.mktemp("seeds")
    states = [
        {"w": torch.randn(4, 3), "i": torch.arange(5), "b": torch.ones(2, dtype=torch.bool),
         "h": torch.zeros(3, dtype=torch.bfloat16), "x": {"n": 3, "s": "text"}, "raw": b"\x00\x01"},
        {"u16": torch.zeros(4, dtype=torch.uint16), "c": torch.zeros(2, dtype=torch.complex64), "step": 9},
    ]
    for i, state in enumerate(states):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(root / str(i)))
        out.append((root / str(i) / ".metadata").read_bytes())
    return out


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        op = rng.randrange(6)
        at = rng.randrange(len(buf)) if buf else 0
        if op == 0 and buf:  # flip a bit
            buf[at] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:  # replace a byte
            buf[at] = rng.randrange(256)
        elif op == 2:  # truncate
            del buf[at:]
        elif op == 3 and buf:  # delete a range
            del buf[at:at + rng.randrange(1, 16)]
        elif op == 4:  # insert random bytes
            buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        else:  # duplicate a range elsewhere
            n = rng.randrange(1, 64)
            buf[rng.randrange(len(buf) + 1):0] = buf[at:at + n]
    return bytes(buf)


def test_byte_mutations_of_real_metadata(seeds):
    rng = random.Random(20261130)
    outcomes: dict[str, int] = {}
    for seed in seeds:
        assert check_metadata_bytes(seed) == "accepted"
    for i in range(3000):
        data = _mutate(rng, seeds[i % len(seeds)])
        outcome = check_metadata_bytes(data)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert sum(outcomes.values()) == 3000
    # The corpus must exercise both sides: refusals of several kinds, and some mutants still accepted.
    assert outcomes.get("accepted", 0) > 0 and len(outcomes) >= 3, outcomes


def test_read_layout_never_raises_on_mutants(seeds, tmp_path):
    rng = random.Random(7)
    for _ in range(300):
        (tmp_path / ".metadata").write_bytes(_mutate(rng, seeds[0]))
        layout, findings = md.read_layout(str(tmp_path))
        assert layout is not None or findings


# Structure-aware: DCP's real classes with fields drawn from valid and hostile values.

_dims = st.lists(st.integers(0, 6), min_size=0, max_size=3)
_junk = st.one_of(st.none(), st.integers(-3, 2**64), st.text(max_size=4), st.floats(allow_nan=False),
                  st.binary(max_size=4), st.lists(st.integers(-2, 3), max_size=3).map(tuple))
_size = st.one_of(_dims.map(torch.Size), _dims.map(tuple), _dims.map(list), _junk)
_dtype = st.sampled_from([torch.float32, torch.uint16, torch.bool, torch.float8_e5m2, torch.complex32, torch.int64])


@st.composite
def _metadata(draw) -> Metadata:
    sd: dict[Any, Any] = {}
    storage: dict[Any, Any] = {}
    for n in range(draw(st.integers(0, 3))):
        fqn = draw(st.one_of(st.just(f"t{n}"), _junk)) if draw(st.booleans()) else f"t{n}"
        if draw(st.integers(0, 4)) == 0:
            sd[fqn] = BytesStorageMetadata()
            key = MetadataIndex.__new__(MetadataIndex)
            object.__setattr__(key, "fqn", fqn)
            object.__setattr__(key, "offset", draw(st.one_of(st.none(), _size)))
            object.__setattr__(key, "index", None)
            info = _StorageInfo(draw(st.one_of(st.just("__0_0.distcp"), _junk, st.just("../x"))),
                                draw(st.one_of(st.integers(0, 99), _junk)), draw(st.one_of(st.integers(0, 99), _junk)))
            with contextlib.suppress(TypeError):  # an unhashable offset: torch could not build this dict either
                storage[key] = info
            continue
        chunks = [ChunkStorageMetadata(draw(_size), draw(_size)) for _ in range(draw(st.integers(0, 3)))]
        sd[fqn] = TensorStorageMetadata(TensorProperties(dtype=draw(_dtype)), draw(_size),
                                        draw(st.one_of(st.just(chunks), _junk)))
        for i, c in enumerate(chunks):
            try:
                key = MetadataIndex(fqn, c.offsets, i)
                hash(key)
            except (TypeError, ValueError, RuntimeError):
                key = (fqn, i)
            storage[key] = _StorageInfo("__0_0.distcp", draw(st.one_of(st.integers(0, 99), _junk)),
                                        draw(st.one_of(st.integers(0, 99), _junk)),
                                        draw(st.one_of(st.none(), st.just(["zstd"]), _junk)))
    planner = draw(st.one_of(st.none(), st.dictionaries(st.text(max_size=3), _junk, max_size=3), _junk))
    meta = draw(st.one_of(st.none(), st.builds(StorageMeta, save_id=st.one_of(st.none(), st.text(max_size=4))),
                          _junk))
    return Metadata(sd, planner_data=planner, storage_data=draw(st.one_of(st.just(storage), _junk)),
                    storage_meta=meta, version=draw(st.one_of(st.just("1.0.0"), _junk)))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_metadata())
def test_structure_aware_metadata(meta):
    try:
        data = pickle.dumps(meta)
    except (TypeError, RuntimeError, pickle.PicklingError, AttributeError):
        return  # torch itself cannot write it
    check_metadata_bytes(data)


# The zip walker and the tensor header reader.


def _archive(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def _walk(data: bytes) -> str:
    try:
        archive = parse_archive(lambda off, n: data[off:off + n] if off >= 0 else b"", len(data))
    except ArchiveError:
        return "ArchiveError"
    pkl = archive.record("data.pkl")
    if pkl is None:
        return "no data.pkl"
    try:
        item_header(data[pkl.data_offset:pkl.data_end])
    except pickle.UnpicklingError:
        return "UnpicklingError"
    return "accepted"


def test_byte_mutations_of_real_archives():
    rng = random.Random(99)
    seeds = [_archive(torch.randn(5, 3)), _archive(torch.zeros(4, dtype=torch.uint16)),
             _archive(torch.ones(2, 2, dtype=torch.bool)), _archive(torch.zeros(3, dtype=torch.float8_e4m3fn))]
    outcomes: dict[str, int] = {}
    for seed in seeds:
        assert _walk(seed) == "accepted"
    for i in range(3000):
        data = _mutate(rng, seeds[i % len(seeds)])
        outcome = _walk(data)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("ArchiveError", 0) > 1000 and outcomes.get("accepted", 0) > 0, outcomes


@settings(max_examples=1000, deadline=None)
@given(shape=_dims, dtype=_dtype, flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)),
                                                 min_size=1, max_size=4), tail=st.booleans())
def test_structure_aware_archive_mutations(shape, dtype, flips, tail):
    data = bytearray(_archive(torch.zeros(shape, dtype=dtype)))
    for at, xor in flips:
        # Aim at the structure: the headers at the start, the data.pkl, or the directories at the end.
        region = len(data) - 1 - at % min(len(data), 400) if tail else at % min(len(data), 400)
        data[region] ^= xor
    _walk(bytes(data))
