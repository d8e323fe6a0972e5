"""The C unpickler reads DCP metadata exactly as the pure-Python reference does, and only where that is safe.

``metadata_pickle.parse`` reads a pickle with the C unpickler when ``pickle_subset.in_fast_subset`` admits it, else
with the pure-Python reference. These tests prove the two agree (same tree, or both refuse) on real metadata
of every layout, on mutated metadata and on generated opcode streams, that the pass refuses what the C
unpickler must not read (huge memo indices and lengths, frames it reads differently, tuples that could nest
or grow), and that the limits the C path relies on hold on both paths (a tuple key nested a million deep no
longer kills the process, exponential hashing is refused).
"""

from __future__ import annotations

import pickle
import pickletools
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptverify.dcp import metadata as md
from ckptverify.dcp import metadata_pickle as sp
from ckptverify.errors import BadPickle, UnsafeGlobal
from ckptverify.safeparse.pickle_subset import MAX_LITERAL, in_fast_subset
from ckptverify.safeparse.unpickler import FastUnpickler

EXPECTED = (UnsafeGlobal, BadPickle)
MD = b"torch.distributed.checkpoint.metadata"


def outcome(fast: bool, data: bytes) -> tuple[str, object]:
    """What one unpickler makes of ``data``: ("ok", tree) or ("refused", exception type)."""
    try:
        return "ok", sp._parse(data, fast=fast)
    except EXPECTED as exc:
        return "refused", type(exc)


def assert_paths_agree(data: bytes) -> str:
    """For a pickle in the fast subset, the C unpickler and the reference agree; returns the outcome."""
    assert in_fast_subset(data)
    fast, ref = outcome(True, data), outcome(False, data)
    if fast[0] == "ok":
        assert ref == fast, data[:200]
    else:
        assert ref[0] == "refused", data[:200]
    return fast[0]


def _save(state: dict, path: Path) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    return (path / ".metadata").read_bytes()


def _s(text: bytes) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text


def _global(module: bytes, name: bytes) -> bytes:
    return _s(module) + _s(name) + b"\x93"


# Real metadata: every layout, nested state dicts, Megatron's planner dataclasses.


@pytest.mark.parametrize("layout", ["single", "threads", "per_item", "safetensors", "fsdp2", "nocoll"])
def test_metadata_of_every_layout_takes_the_fast_path_and_equals_the_reference(fresh_ckpt, layout):
    from helpers.ckpt_factory import safetensors_supported

    if layout == "safetensors" and not safetensors_supported():
        pytest.skip("this torch has no safetensors serialization")
    path = fresh_ckpt(layout)
    for name in md.metadata_files(str(path)):
        data = (path / name).read_bytes()
        assert in_fast_subset(data), name
        assert sp.parse(data) == sp.parse_reference(data)


def test_nested_and_flat_state_dicts_take_the_fast_path(tmp_path):
    nested = {"model": {"layers": [{"w": torch.ones(2)}, {"w": torch.zeros(2)}], "emb": torch.ones(3)},
              "optim": {"state": {0: {"exp_avg": torch.ones(2)}}, "lr": 0.1, "name": "adam"}}
    flat = {f"p.{i}": torch.full((i % 3 + 1,), float(i)) for i in range(700)}  # more than one SETITEMS batch
    for i, state in enumerate((nested, flat)):
        data = _save(state, tmp_path / str(i))
        assert in_fast_subset(data)
        assert sp.parse(data) == sp.parse_reference(data)


def test_megatron_style_metadata_takes_the_fast_path(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    data = _save({"decoder.weight": torch.ones(4, 2), "step": 3}, tmp_path)
    meta = pickle.loads(data)  # written just now by DCP: trusted
    meta.all_local_plans = [SavePlan([WriteItem(MetadataIndex("step"), WriteItemType.BYTE_IO)])]
    meta.mcore_data = {"decoder.weight": {"nd_reformulated_orig_global_shape": (64, 32)}}
    data = pickle.dumps(meta)
    assert in_fast_subset(data)
    assert sp.parse(data) == sp.parse_reference(data)


# Differential: mutated real metadata, generated opcode streams.


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> list[bytes]:
    root = tmp_path_factory.mktemp("fast-seeds")
    return [
        _save({"w": torch.randn(4, 3), "i": torch.arange(5), "x": {"n": 3, "s": "text"}, "raw": b"\x00\x01"},
              root / "a"),
        _save({"model": {"a": {"w": torch.ones(2)}, "b": torch.ones(1, 2, 3, 4)}, "step": 9}, root / "b"),
    ]


def test_mutated_metadata_in_the_fast_subset_reads_the_same_on_both_paths(seeds):
    from test_fuzz_metadata import _mutate

    rng = random.Random(20261201)
    seen: dict[str, int] = {}
    for i in range(3000):
        data = _mutate(rng, seeds[i % len(seeds)])
        if not in_fast_subset(data):
            seen["elsewhere"] = seen.get("elsewhere", 0) + 1
            continue
        result = assert_paths_agree(data)
        seen[result] = seen.get(result, 0) + 1
    assert seen.get("ok", 0) > 20 and seen.get("refused", 0) > 20, seen


_GLOBALS = [(b"torch", b"Size"), (b"torch", b"float32"), (b"torch.serialization", b"_get_layout"),
            (MD, b"_MEM_FORMAT_ENCODING"), (MD, b"Metadata"), (MD, b"MetadataIndex"), (MD, b"TensorProperties"),
            (MD, b"ChunkStorageMetadata"), (MD, b"BytesStorageMetadata"), (b"pathlib", b"PosixPath"),
            (b"os", b"system")]
_TOKENS = st.one_of(
    st.integers(0, 3).map(lambda n: b"K" + bytes([n])),
    st.sampled_from([b"a", b"fqn", b"offset", b"index", b"torch.strided", b"sizes", b"offsets"]).map(_s),
    st.sampled_from([b"N", b"\x88", b"\x89", b"(", b")", b"]", b"}", b"\x85", b"\x86", b"\x87", b"t", b"\x94",
                     b"R", b"\x81", b"b", b"s", b"u", b"a", b"e", b"l", b"d"]),
    st.integers(0, 8).map(lambda n: b"h" + bytes([n])),
    st.sampled_from(_GLOBALS).map(lambda g: _global(*g)),
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_TOKENS, min_size=1, max_size=40))
def test_generated_opcode_streams_read_the_same_on_both_paths(tokens):
    data = b"\x80\x04" + b"".join(tokens) + b"."
    if in_fast_subset(data):
        assert_paths_agree(data)
    else:  # the reference alone decides: parse() must say what it says
        assert outcome(False, data)[0] == ("ok" if _accepts(data) else "refused")


@st.composite
def _tuple_heavy(draw) -> bytes:
    """Opcode streams that keep trying to nest tuples through the memo: pushes, gets of existing memo entries,
    tuples of them (memoized or not), torch.Size calls, dict entries keyed by them."""
    out, memos = bytearray(b"\x80\x04"), 0
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.integers(0, 6))
        if kind == 0:
            out += draw(st.sampled_from([b"K\x01", b"N", _s(b"s")]))
        elif kind == 1 and memos:
            out += b"h" + bytes([draw(st.integers(0, min(memos, 256) - 1))])
        elif kind == 2:
            out += draw(st.sampled_from([b"\x85", b"\x86", b"\x87", b"(", b"t"]))
        elif kind == 3:
            out += _global(b"torch", b"Size") + b"(K\x01K\x02t\x94\x85\x94R"
            memos += 2
        elif kind == 4:
            out += b"}"
        elif kind == 5:
            out += draw(st.sampled_from([b"s", b"u", b"R", b"b"]))
        if draw(st.booleans()):
            out += b"\x94"
            memos += 1
    return bytes(out + b".")


def _tuple_shape(value: object, seen: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(nesting depth, values it expands to) of a tuple, following shared parts once."""
    if not isinstance(value, tuple):
        return 0, 1
    known = seen.get(id(value))
    if known is None:
        depth, nodes = 1, 1
        for x in value:
            d, k = _tuple_shape(x, seen)
            depth, nodes = max(depth, d + 1), nodes + k
        known = seen[id(value)] = (depth, nodes)
    return known


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_tuple_heavy())
def test_no_tuple_the_c_unpickler_builds_nests_deep_or_grows(data):
    # The pass's promise, checked on what the C unpickler actually built: every memo entry and the result.
    if not in_fast_subset(data):
        return
    unpickler = FastUnpickler(data, sp._allowlist(sp._budget(10**9)))
    try:
        result = unpickler.load()
    except Exception:  # refused: nothing was built to bound
        return
    seen: dict[int, tuple[int, int]] = {}
    for value in [result, *unpickler.memo.copy().values()]:
        depth, nodes = _tuple_shape(value, seen)
        assert depth <= 4 and nodes <= MAX_LITERAL + 200, (depth, nodes, data)


def _accepts(data: bytes) -> bool:
    try:
        sp.parse(data)
    except EXPECTED:
        return False
    return True


# What the pass must keep from the C unpickler.


def _metadata_around(value: bytes) -> bytes:
    """A Metadata whose planner_data is ``value`` (the opcodes that push it)."""
    return (b"\x80\x04" + _global(MD, b"Metadata") + b")\x81}(" + _s(b"state_dict_metadata") + b"}"
            + _s(b"storage_data") + b"}" + _s(b"planner_data") + value + b"ub.")


def _nested_literals(depth: int) -> bytes:
    # ((((x,),),),...) built through the memo: each 1-tuple holds the one memoized before it.
    out = _s(b"x") + b"\x85\x94"  # memo 0
    for level in range(1, depth):
        out += b"h" + bytes([level - 1]) + b"\x85\x94"
    return out


HOSTILE = {
    "a memo index the C unpickler would zero-fill": b"\x80\x04N" + b"r" + (2**31 - 1).to_bytes(4, "little") + b".",
    "BINPUT": b"\x80\x04Nq\x00.",
    "BINBYTES8 longer than the data": b"\x80\x04\x8e" + (2**40).to_bytes(8, "little") + b"x.",
    "BINUNICODE longer than the data": b"\x80\x04X" + (2**31).to_bytes(4, "little") + b"x.",
    "a frame longer than the data": b"\x80\x04\x95" + (2**20).to_bytes(8, "little") + b"N.",
    "a frame inside a frame": b"\x80\x04\x95" + (11).to_bytes(8, "little") + b"\x95" + (1).to_bytes(8, "little")
                              + b"N.",
    "an opcode across a frame boundary": b"\x80\x04\x95" + (1).to_bytes(8, "little") + b"K\x01.",
    "a text GLOBAL": b"\x80\x02ctorch\nSize\n.",
    "POP": b"\x80\x04NN0.",
    "DUP": b"\x80\x04N2.",
    "a persistent id": b"\x80\x04NQ.",
    "an extension": b"\x80\x04\x82\x01.",
    "a set": b"\x80\x04\x8f(K\x01\x90.",
    "LONG4": b"\x80\x04\x8b\x01\x00\x00\x00\x01.",
    "no STOP": b"\x80\x04N",
    "STOP after an unconsumed tuple opcode split off": b"\x80\x04N\x85\x94\x94.",
    "a tuple nested a thousand deep": b"\x80\x04}N" + b"\x85" * 1000 + b"Ns.",
    "a literal holding a literal": _metadata_around(_nested_literals(50)),
    "a literal memoized twice": _metadata_around(_s(b"x") + b"\x85\x94h\x00\x94h\x01\x85\x94"),
    "a MEMOIZE after BUILD": b"\x80\x04" + _global(MD, b"BytesStorageMetadata") + b")\x81Nb\x94.",
    "a MEMOIZE after APPENDS": b"\x80\x04](e\x94.",
    "a literal of more than 64 values": _metadata_around(b"(" + b"K\x01" * (MAX_LITERAL + 1) + b"t"),
    "a literal of two unknown memo entries": _metadata_around(
        _s(b"k") + b"\x94" + _global(b"torch", b"Size") + b"\x94(K\x01t\x94\x85\x94R\x94h\x04h\x04\x86"),
    "a protocol-0 pickle": b"N.",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_pass_leaves_to_the_reference_what_the_c_unpickler_must_not_read(name):
    data = HOSTILE[name]
    assert not in_fast_subset(data)
    # parse() gives the reference's answer (it refuses all of these but the harmless literals).
    assert _accepts(data) == (outcome(False, data)[0] == "ok")


def test_real_pickles_of_the_refused_shapes_are_still_read_by_the_reference():
    # A protocol-2 pickle (BINPUT, text GLOBAL) of real DCP metadata: outside the subset, read in full.
    meta = pickle.loads(pickle.dumps(_real_metadata()))
    data = pickle.dumps(meta, protocol=2)
    assert not in_fast_subset(data)
    assert sp.parse(data) == sp.parse(pickle.dumps(meta, protocol=4))


def _real_metadata():
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))
    return Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk])})


# Limits both paths keep (the C path by the shape of what it reads, the reference by checking).


def test_a_tuple_key_nested_a_million_deep_is_refused_not_a_crash():
    # hash() of it recursed in C until the process died (SIGSEGV); now refused before hashing.
    code = ("from ckptverify.dcp import metadata_pickle as sp\n"
            "from ckptverify.errors import BadPickle\n"
            "data = b'\\x80\\x02}N' + b'\\x85' * 1_000_000 + b'Ns.'\n"
            "try:\n    sp.parse(data)\nexcept BadPickle as exc:\n    print('refused:', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused: a hashed tuple nests deeper than 64 levels" in proc.stdout


def test_exponential_hashing_is_refused():
    # t0 = (None,), t[i+1] = (t[i], t[i]): 60 levels in 300 bytes, 2**60 values to hash as a dict key.
    body = b"N\x85\x94" + b"".join(b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94" for i in range(60))
    with pytest.raises(BadPickle, match="more than 1024 values"):
        sp.parse(b"\x80\x04}" + body + b"Ns.")
    # MetadataIndex records whose hashed fields are the record before, twice: 2**60 hashes.
    data = bytearray(b"\x80\x04" + _global(MD, b"MetadataIndex") + b"\x94N\x94")  # memo 0: class, 1: None
    for i in range(60):
        data += (b"h\x00)\x81\x94}(" + _s(b"fqn") + b"h" + bytes([i + 1]) + _s(b"offset") + b"h"
                 + bytes([i + 1]) + b"ub")
    data += b"}h" + bytes([61]) + b"Ns."
    assert in_fast_subset(bytes(data))
    with pytest.raises(BadPickle, match="asks for more"):
        sp.parse(bytes(data))


def test_the_c_path_keeps_the_budget():
    # A "billion laughs" of lists the fast subset admits: 10 ** 9 references in a few hundred bytes.
    body = _s(b"x") + b"\x94"
    for level in range(9):
        body += b"(" + (b"h" + bytes([level])) * 10 + b"l\x94"
    data = body + _global(MD, b"Metadata")
    data = (b"\x80\x04" + data + b")\x81}(" + _s(b"state_dict_metadata") + b"}" + _s(b"storage_data") + b"}"
            + _s(b"planner_data") + b"h\x09ub.")
    assert in_fast_subset(data)
    with pytest.raises(BadPickle, match="asks for more"):
        sp._parse(data, fast=True)
    with pytest.raises(BadPickle, match="asks for more"):
        sp.parse(data)


@pytest.mark.parametrize("target", [(b"torch", b"Size"), (b"torch", b"float32"), (MD, b"Metadata"),
                                    (MD, b"_MEM_FORMAT_ENCODING")])
def test_a_hostile_pickle_read_by_the_c_unpickler_cannot_change_later_parses(tmp_path, target):
    clean = _save({"w": torch.ones(2, 2)}, tmp_path)
    for state in (b"}" + _s(b"kind") + _s(b"bad") + b"s", b"N}" + _s(b"_label") + b"K\x01s\x86"):
        data = b"\x80\x04" + _global(*target) + state + b"b."
        assert in_fast_subset(data)
        with pytest.raises(BadPickle):
            sp._parse(data, fast=True)
    assert sp.parse(clean) == sp.parse_reference(clean)


def test_metadata_split_into_two_frames_anywhere_reads_the_same_on_both_paths():
    # A frame boundary between a tuple and its consumer (or inside a literal) moves the pass off its regular
    # expressions onto its opcode-by-opcode states: each cut is refused by the pass or read alike by both paths.
    data = pickle.dumps(_real_metadata(), protocol=4)
    ops = [(pos, op.name) for op, _, pos in pickletools.genops(data)]
    body = [data[pos:end] for (pos, name), (end, _) in zip(ops, [*ops[1:], (len(data), "")], strict=True)
            if name not in ("PROTO", "FRAME")]
    admitted = 0
    for cut in range(1, len(body)):
        head, tail = b"".join(body[:cut]), b"".join(body[cut:])
        split = b"\x80\x04" + b"".join(b"\x95" + len(f).to_bytes(8, "little") + f for f in (head, tail))
        if in_fast_subset(split):
            admitted += 1
            assert assert_paths_agree(split) == "ok"
        assert sp.parse(split) == sp.parse(data)
    assert admitted > len(body) // 2


def test_where_the_c_unpickler_is_stricter_its_refusal_stands(monkeypatch):
    # If the reference accepted what the C unpickler refused, parse() reports the C unpickler's refusal:
    # it is what DCP would meet. Simulated: no such pickle is known.
    data = b"\x80\x04K\x01."
    real = sp._parse

    def c_refuses(data: bytes, *, fast: bool):
        if fast:
            raise BadPickle("refused by the C unpickler")
        return real(data, fast=fast)

    monkeypatch.setattr(sp, "_parse", c_refuses)
    with pytest.raises(BadPickle, match="refused by the C unpickler"):
        sp.parse(data)
