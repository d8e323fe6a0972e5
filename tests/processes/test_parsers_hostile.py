"""Parsers of untrusted bytes end in a finding or a clear error, never a traceback, and allocate only what the
bytes can hold: safetensors headers (single files and DCP's safetensors blobs), a ``torch.save`` file's
``data.pkl`` memo, trace stores (metadata, chunk shapes, zstd chunks), and JSON through
:mod:`ckptverify.safeparse.safejson`.

Bombs run in a child process under ``RLIMIT_AS`` (its address space after imports plus 2 GiB), and report
how much their peak resident memory grew: a regression fails the test instead of eating the machine.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import struct
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.preloaded_children import PreloadedServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptverify.dcp import safetensors
from ckptverify.errors import ArchiveError, CkptVerifyError, JSONError
from ckptverify.safeparse import safejson
from ckptverify.safeparse.readers import ReadOnlyFile

TIMEOUT = 300
#: Most a bomb case may grow the child's peak resident memory.
MAX_GROWTH_MB = 300

#: What every command imports, before the baseline; the server imports them once, each child inherits them.
_PRELOAD = ("torch", "numpy", "zarr", "ckptverify.cli", "ckptverify.audit.verify", "ckptverify.trace.compare")

_CHILD = textwrap.dedent("""
    import contextlib, io, json, resource, sys
    import torch, numpy, zarr  # the imports every command makes, before the baseline (preloaded: no-ops here)
    import ckptverify.cli, ckptverify.audit.verify, ckptverify.trace.compare
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            ckptverify.cli.main(sys.argv[1:])
        except SystemExit as exc:
            code = exc.code
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
    print(json.dumps({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "grown_mb": grown}))
""")


@pytest.fixture(scope="module")
def children() -> Iterator[PreloadedServer]:
    """The bombs' processes: each a child forked from one server that imported :data:`_PRELOAD` once (a fresh
    interpreter per case would import torch 21 times). A child is still a process of its own, so the limit on its
    address space and its peak resident memory are its own; ``test_the_memory_measure_sees_what_a_child_allocates``
    shows the measure works in such a child."""
    with PreloadedServer(_PRELOAD, env={**os.environ, "OMP_NUM_THREADS": "1"}) as server:
        yield server


#: ``cli(*args)``: see the fixture.
Cli = Callable[..., dict[str, Any]]


@pytest.fixture
def cli(children: PreloadedServer) -> Cli:
    """``cli(*args)``: ``ckptverify args`` in a child under the memory limit: exit code, output, peak memory
    growth."""
    def run(*args: str) -> dict[str, Any]:
        proc = children.run(_CHILD, *args, timeout=TIMEOUT)
        if proc.timed_out:  # pragma: no cover - the failure this file exists to catch
            pytest.fail(f"{args} did not finish within {TIMEOUT} s")
        assert proc.returncode == 0, f"the child died ({proc.returncode}): {proc.stderr[-3000:]}"
        result = json.loads(proc.stdout.splitlines()[-1])
        assert "Traceback" not in result["stderr"] + result["stdout"], result["stderr"][-3000:]
        assert "internal error" not in result["stderr"], result["stderr"][-3000:]
        return result
    return run


def test_the_memory_measure_sees_what_a_child_allocates(children: PreloadedServer) -> None:
    """The bombs' measure, shown to work in a forked child: 400 MiB touched there is seen as about that much growth
    of its peak resident memory, and allocating past its address-space limit fails in the child, not here."""
    code = _CHILD.split("out, err =")[0] + textwrap.dedent("""
        block = numpy.ones(400 << 20, dtype=numpy.uint8)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
        try:
            numpy.ones(3 << 30, dtype=numpy.uint8)
            refused = False
        except MemoryError:
            refused = True
        print(json.dumps({"grown_mb": grown, "refused": refused}))
    """)
    proc = children.run(code, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert 380 <= result["grown_mb"] < 400 + MAX_GROWTH_MB and result["refused"], result


def _report(result: dict[str, Any]) -> dict[str, Any]:
    return json.loads(result["stdout"])


# ------------------------------------------------------------------------------------------- safetensors


def _safetensors_bytes(header: Any, payload: bytes = b"", raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + payload


def _blob(tmp_path: Path, data: bytes) -> safetensors.Blob:
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    with ReadOnlyFile(str(path)) as f:
        return safetensors.read_blob(f, 0)


HOSTILE_HEADERS = {
    "infinite-shape": b'{"w": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 4]}}',
    "huge-float-shape": b'{"w": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}',
    "infinite-offset": b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, Infinity]}}',
    "nan-offset": b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [NaN, 4]}}',
    "float-shape": b'{"w": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}',
    "fractional-offset": b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.5]}}',
    "bool-shape": b'{"w": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}',
    "string-offset": b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", 4]}}',
    "negative-dim": b'{"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}',
    "huge-dim": b'{"w": {"dtype": "F32", "shape": [100000000000000000000], "data_offsets": [0, 4]}}',
    "three-offsets": b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}',
    "dtype-list": b'{"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}',
    "entry-list": b'{"w": [1, 2]}',
    "repeated-key": b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                    b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
    "deep": b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "deep-below-recursion-limit": b'{"__metadata__": ' + b"[" * 500 + b"]" * 500 + b"}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_HEADERS))
def test_hostile_safetensors_header_is_a_blob_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(ArchiveError):
        _blob(tmp_path, _safetensors_bytes(None, b"\0" * 8, raw_header=HOSTILE_HEADERS[name]))


@pytest.mark.parametrize(("data", "match"), [
    (b"\x10\0\0", "header length is cut short"),
    (struct.pack("<Q", 1 << 20) + b"{}", "past the end of the file"),
    (_safetensors_bytes([1]), "not a JSON object"),
    (_safetensors_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4), "invalid range"),
    (_safetensors_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
     "does not start where the previous one ended"),
    (_safetensors_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 8),
     "'b' does not start where the previous one ended"),
])
def test_a_malformed_safetensors_blob_names_what_is_wrong(tmp_path: Path, data: bytes, match: str) -> None:
    with pytest.raises(ArchiveError, match=match):
        _blob(tmp_path, data)


def test_a_well_formed_header_still_reads(tmp_path: Path) -> None:
    blob = _blob(tmp_path, _safetensors_bytes(
        {"a": {"dtype": "F32", "shape": [2, 1], "data_offsets": [0, 8]},
         "b": {"dtype": "XX", "shape": [3], "data_offsets": [8, 11]}, "__metadata__": {"format": "pt"}},
        b"\0" * 11))
    assert blob.tensors["a"].shape == (2, 1) and blob.tensors["b"].dtype is None
    assert safetensors.data_range(blob, "a") == (blob.data_start, 8)


@pytest.mark.parametrize("name", ["infinite-shape", "huge-float-shape", "infinite-offset", "float-shape"])
def test_verify_of_a_safetensors_file_with_a_hostile_header_is_a_finding(tmp_path: Path, name: str, cli: Cli) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(_safetensors_bytes(None, b"\0" * 8, raw_header=HOSTILE_HEADERS[name]))
    result = cli("verify", "--no-progress", "--json", str(path))
    assert result["code"] == 1, result
    assert {f["check"] for f in _report(result)["findings"] if f["severity"] == "error"} == {"blob-structure"}


def test_run_directory_commands_survive_an_infinite_safetensors_shape(tmp_path: Path, cli: Cli) -> None:
    """One hostile file does not stop ``scan`` or ``latest`` over the whole run directory."""
    import torch
    from safetensors.torch import save_file

    run = tmp_path / "run"
    good, bad = run / "checkpoint-1", run / "checkpoint-2"
    good.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(good / "model.safetensors"))
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(_safetensors_bytes(None, b"\0" * 8,
                                                               raw_header=HOSTILE_HEADERS["infinite-shape"]))
    for command in ("scan", "latest"):
        result = cli(command, "--json", str(run))
        assert result["code"] in (0, 1, 2), result
        assert "OverflowError" not in result["stdout"] + result["stderr"], result


def test_verify_of_a_dcp_safetensors_blob_with_an_infinite_offset_is_a_finding(tmp_path: Path, cli: Cli) -> None:
    from helpers.ckpt_factory import safetensors_supported
    from helpers.dcp_encodings import safetensors_ckpt

    if not safetensors_supported():
        pytest.skip("this torch's DCP has no safetensors serialization")
    ckpt = safetensors_ckpt(tmp_path / "ckpt")
    shard = next(p for p in sorted(ckpt.iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    mark = data.find(b'"data_offsets"')
    assert mark > 0
    start = next(i for i in range(mark, 8, -1) if data[i:i + 1] == b"{"
                 and i + struct.unpack("<Q", data[i - 8:i])[0] <= len(data) and _is_json(data[i:i + struct.unpack(
                     "<Q", data[i - 8:i])[0]]))
    (n,) = struct.unpack("<Q", data[start - 8:start])
    header = json.loads(data[start:start + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] = 123456789
    text = json.dumps(header, separators=(",", ":")).replace("123456789", "Infinity").encode()
    assert len(text) <= n
    data[start:start + n] = text + b" " * (n - len(text))
    shard.write_bytes(bytes(data))
    result = cli("verify", "--no-progress", "--json", str(ckpt))
    assert result["code"] == 1, result
    checks = {f["check"] for f in _report(result)["findings"] if f["severity"] == "error"}
    assert checks, result


def _is_json(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------- pickle memo


def _torch_archive(path: Path, pkl: bytes) -> Path:
    import torch

    writer = torch._C.PyTorchFileWriter(str(path))  # torch's own zip writer: a well-formed archive
    for name, data in (("data.pkl", pkl), ("byteorder", b"little"), ("version", b"3\n")):
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return path


def test_a_huge_memo_index_in_a_torch_save_file_allocates_nothing(tmp_path: Path, cli: Cli) -> None:
    # LONG_BINPUT 2**26: the C unpickler would zero-fill 1 GiB of memo slots for this record of a few bytes.
    pkl = b"\x80\x02}r" + (1 << 26).to_bytes(4, "little") + b"."
    path = _torch_archive(tmp_path / "bomb.pt", pkl)
    assert path.stat().st_size < 2000
    result = cli("verify", "--no-progress", "--json", str(path))
    assert result["grown_mb"] < MAX_GROWTH_MB, result
    assert result["code"] == 1, result
    assert "memo" in result["stdout"], result


def test_sequential_memo_indices_still_read(tmp_path: Path) -> None:
    from ckptverify.safeparse.torchsave import scan_pickle

    value = {"a": [1.5, "x"], "b": ("y", [2])}
    value["c"] = value["a"]
    for protocol in (0, 1, 2, 4):
        assert scan_pickle(pickle.dumps(value, protocol=protocol)).root["c"] == [1.5, "x"]


@pytest.mark.parametrize("pkl", [
    b"\x80\x02}r\xff\xff\xff\x7f.",  # LONG_BINPUT 2**31 - 1
    b"(dp99999999999\n.",  # text PUT
    b"(dp-1\n.",  # a negative index
])
def test_memo_indices_past_what_was_memoized_are_refused(pkl: bytes) -> None:
    from ckptverify.errors import BadPickle
    from ckptverify.safeparse.torchsave import scan_pickle

    with pytest.raises(BadPickle, match="memo"):
        scan_pickle(pkl)


def _tensor_pkl(size: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    """``torch._utils._rebuild_tensor_v2(<storage '0' of 6 floats>, 0, size, stride)`` as protocol-2 opcodes."""
    def ints(values: tuple[int, ...]) -> bytes:
        return b"(" + b"".join(pickle.dumps(v, protocol=2)[2:-1] for v in values) + b"t"

    storage = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x06tQ"
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + storage + b"K\x00" + ints(size) + ints(stride)
            + b"tR.")


def test_tensor_sizes_must_be_64_bit_integers() -> None:
    from ckptverify.errors import BadPickle
    from ckptverify.safeparse.torchsave import scan_pickle

    assert scan_pickle(_tensor_pkl((2, 3), (3, 1))).tensors["<root>"].size == (2, 3)
    for size, stride in (((1 << 64,), (1,)), ((2, 2), (1,)), ((2,), (1 << 70,))):
        with pytest.raises(BadPickle, match="offset, shape or stride"):
            scan_pickle(_tensor_pkl(size, stride))


# ------------------------------------------------------------------------------------------- safejson


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", "-Infinity", "[1e999]", '{"a": 1, "a": 2}',
                                  "[" * 65 + "]" * 65, "[" * 100_000, "{", b"\xff\xfe\x00".decode("latin1")])
def test_safejson_refuses(text: str) -> None:
    with pytest.raises(JSONError):
        safejson.loads(text)


def test_safejson_exact_int() -> None:
    assert safejson.loads('{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    assert safejson.exact_int(3, "n") == 3
    for bad in (True, 3.0, "3", None, -1, 1 << 63):
        with pytest.raises(JSONError):
            safejson.exact_int(bad, "n")


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.dictionaries(st.text(max_size=6), st.one_of(
    _json_values,
    st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "I64", "BOOL", "X"]) | _json_values,
                           "shape": st.lists(st.integers(-3, 5) | _json_values, max_size=4) | _json_values,
                           "data_offsets": st.lists(st.integers(-2, 80) | _json_values, max_size=3)
                           | _json_values})), max_size=4),
       raw=st.sampled_from([None, b"Infinity", b"-1e999", b"NaN", b"[[[[", b"1.0"]),
       payload=st.integers(0, 96))
def test_fuzz_safetensors_headers_raise_only_blob_errors(tmp_path: Path, entries: dict[str, Any],
                                                         raw: bytes | None, payload: int) -> None:
    text = json.dumps(entries).encode()
    if raw is not None and b"0" in text:
        text = text.replace(b"0", raw, 1)
    try:
        blob = _blob(tmp_path, _safetensors_bytes(None, b"\0" * payload, raw_header=text))
    except ArchiveError:
        return
    for t in blob.tensors.values():
        assert all(type(d) is int and d >= 0 for d in t.shape)
        assert type(t.begin) is int and type(t.end) is int and 0 <= t.begin <= t.end <= payload
        if t.dtype is not None:
            assert t.end - t.begin == math.prod(t.shape) * np.dtype(t.dtype.replace("bfloat16", "uint16")
                                                                    .replace("float8_e4m3fn", "uint8")
                                                                    .replace("float8_e5m2", "uint8")).itemsize


# ------------------------------------------------------------------------------------------- trace stores


def _store(path: Path, rows: int = 10) -> Path:
    from ckptverify.trace.store import Cell, TraceHeader, TraceWriter

    with TraceWriter(path, header=TraceHeader(run=path.name, rank=0, world_size=1), flush_every=4, site_chunk=3,
                     background=False) as w:
        for s in range(1, rows + 1):
            w.append(s, [Cell.from_float("metric.loss", "metric", s * 1.5), Cell.from_int("c", "counter", s),
                         Cell("param.w", "param", (s, s + 1)), Cell("param.v", "param", (1, 2))])
    return path


def _edit(path: Path, change: Any) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def _rle_bomb(decoded: int, declare: bool) -> bytes:
    """A zstd frame of RLE blocks (128 KiB of zeros from each 4 bytes) decoding to ``decoded`` bytes; its header
    declares that size when ``declare``, else gives only a window."""
    block = 128 << 10
    if declare:
        head = b"\x28\xb5\x2f\xfd" + bytes([0xC0 | 0x00]) + b"\x58" + decoded.to_bytes(8, "little")
    else:
        head = b"\x28\xb5\x2f\xfd" + b"\x00" + b"\x58"  # window 2**(10 + 11)
    n = decoded // block
    body = bytearray()
    for i in range(n):
        h = (block << 3) | (1 << 1) | (1 if i == n - 1 else 0)
        body += h.to_bytes(3, "little") + b"\x00"
    return head + bytes(body)


def _set(keys: tuple[Any, ...], value: Any) -> Any:
    def change(meta: Any) -> None:
        node = meta
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return change


def _raw(text: bytes) -> Any:
    return text


HOSTILE_STORES: dict[str, tuple[str, Any]] = {
    "rows-missing": ("zarr.json", lambda m: m["attributes"].pop("rows")),
    "rows-string": ("zarr.json", _set(("attributes", "rows"), "10")),
    "rows-float": ("zarr.json", _set(("attributes", "rows"), 10.0)),
    "rows-bool": ("zarr.json", _set(("attributes", "rows"), True)),
    "rows-negative": ("zarr.json", _set(("attributes", "rows"), -1)),
    "rows-infinite": ("zarr.json", b'{"zarr_format": 3, "node_type": "group", "attributes": {"rows": Infinity}}'),
    "header-missing": ("zarr.json", lambda m: m["attributes"].pop("header")),
    "header-list": ("zarr.json", _set(("attributes", "header"), [1, 2])),
    "level-list": ("zarr.json", _set(("attributes", "header", "level"), ["state"])),
    "schema-version-string": ("zarr.json", _set(("attributes", "header", "schema_version"), "2")),
    "rank-bool": ("zarr.json", _set(("attributes", "header", "rank"), True)),
    "schema-other": ("zarr.json", _set(("attributes", "header", "schema"), "other")),
    "level-unknown": ("zarr.json", _set(("attributes", "header", "level"), "everything")),
    "attributes-list": ("zarr.json", _set(("attributes",), [])),
    "deep": ("zarr.json", b'{"attributes": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    "not-json": ("zarr.json", b"\xff\xfe{"),
    "sites-dict": ("sites/zarr.json", _set(("attributes", "sites"), {"a": 1})),
    "site-no-name": ("sites/zarr.json", lambda m: m["attributes"]["sites"][0].pop("name")),
    "site-first-row-float": ("sites/zarr.json", _set(("attributes", "sites", 1, "first_row"), 0.5)),
    "site-order-string": ("sites/zarr.json", _set(("attributes", "sites", 1, "order"), "1")),
    "site-encoding-unknown": ("sites/zarr.json", _set(("attributes", "sites", 1, "encoding"), "f128")),
    "site-repeated": ("sites/zarr.json", _set(("attributes", "sites", 1, "name"), "metric.loss")),
    "site-info-number": ("sites/zarr.json", _set(("attributes", "sites", 1, "info"), 3)),
    "present-fill-int": ("present/zarr.json", _set(("fill_value",), 0)),
    "values-narrower-than-sites": ("values/zarr.json", _set(("shape",), [12, 1, 2])),
    "values-huge-chunks": ("values/zarr.json", _set(("chunk_grid", "configuration", "chunk_shape"),
                                                    [1 << 20, 1 << 20, 2])),
    "values-chunk-zero": ("values/zarr.json", _set(("chunk_grid", "configuration", "chunk_shape"), [0, 3, 2])),
    "values-shape-float": ("values/zarr.json", _set(("shape",), [12.0, 4, 2])),
    "values-wrong-dtype": ("values/zarr.json", _set(("data_type",), "float64")),
    "values-blosc": ("values/zarr.json", _set(("codecs",), [{"name": "bytes"}, {"name": "blosc"}])),
    "values-sharded": ("values/zarr.json", _set(("codecs",), [{"name": "sharding_indexed"}])),
    "values-2d": ("values/zarr.json", _set(("shape",), [12, 4])),
    "steps-missing-meta": ("steps/zarr.json", None),
    "steps-shape-short": ("steps/zarr.json", _set(("shape",), [3])),
    "values-7-byte-chunk": ("values/c/0/0/0", b"1234567"),
    "values-chunk-long": ("values/c/0/0/0", b"\0" * 10_000),
    "steps-chunk-not-zstd": ("steps/c/0", b"\0" * 32),
    "steps-chunk-truncated-zstd": ("steps/c/0", None),
    "steps-chunk-missing": ("steps/c/1", None),
    "steps-decreasing": ("steps/c/1", None),
}


def _hostile_store(tmp_path: Path, name: str) -> Path:
    import zstandard

    store = _store(tmp_path / "b")
    target, change = HOSTILE_STORES[name]
    path = store / target
    if name == "steps-chunk-truncated-zstd":
        path.write_bytes(path.read_bytes()[:-3])
    elif name == "steps-decreasing":
        path.write_bytes(zstandard.ZstdCompressor().compress(np.arange(4, 0, -1, dtype="<i8").tobytes()))
    elif change is None:
        path.unlink()
    elif isinstance(change, bytes):
        path.write_bytes(change)
    else:
        _edit(path, change)
    return store


@pytest.mark.parametrize("name", sorted(HOSTILE_STORES))
def test_a_hostile_trace_store_is_a_trace_format_error(tmp_path: Path, name: str) -> None:
    from ckptverify.trace.store import open_trace

    store = _hostile_store(tmp_path, name)
    with pytest.raises(CkptVerifyError):
        trace = open_trace(store)
        for _ in trace:
            pass


@pytest.mark.parametrize("name", ["rows-infinite", "deep", "values-7-byte-chunk", "site-no-name",
                                  "values-huge-chunks", "steps-chunk-truncated-zstd"])
def test_trace_diff_of_a_hostile_store_exits_2_with_a_message(tmp_path: Path, name: str, cli: Cli) -> None:
    a = _store(tmp_path / "a")
    b = _hostile_store(tmp_path, name)
    result = cli("trace", "diff", str(a), str(b))
    assert result["code"] == 2, result
    assert "trace diff: error:" in result["stderr"] and str(b) in result["stderr"], result


def test_trace_diff_compares_one_ranks_stores(tmp_path: Path, cli: Cli) -> None:
    a, b = _store(tmp_path / "a"), _store(tmp_path / "b")
    same = cli("trace", "diff", "--json", str(a), str(b))
    assert same["code"] == 0, same
    _edit(b / "sites" / "zarr.json", lambda m: None)  # unchanged metadata, changed value below
    from ckptverify.trace.store import Cell, TraceHeader, TraceWriter

    with TraceWriter(tmp_path / "c", header=TraceHeader(run="c", rank=0, world_size=1), flush_every=4, site_chunk=3,
                     background=False) as w:
        for s in range(1, 11):
            w.append(s, [Cell.from_float("metric.loss", "metric", s * 1.5 + (s == 7)),
                         Cell.from_int("c", "counter", s), Cell("param.w", "param", (s, s + 1)),
                         Cell("param.v", "param", (1, 2))])
    differ = cli("trace", "diff", "--json", str(a), str(tmp_path / "c"))
    assert differ["code"] == 1, differ
    first = next(f for f in _report(differ)["findings"] if f["check"] == "trace-divergence")
    assert "step 7" in first["message"] and "metric.loss" in first["message"], first


@pytest.mark.parametrize("declare", [False, True])
def test_a_zstd_chunk_inflating_to_1_gib_is_refused_without_inflating(tmp_path: Path, declare: bool, cli: Cli) -> None:
    # 1 GiB fits under the child's limit: a reader that inflates it shows in its peak memory, not as a failed
    # allocation it might happen to survive.
    a = _store(tmp_path / "a")
    b = _store(tmp_path / "b")
    bomb = _rle_bomb(1 << 30, declare)
    assert len(bomb) < 40_000
    (b / "steps" / "c" / "0").write_bytes(bomb)
    result = cli("trace", "diff", str(a), str(b))
    assert result["grown_mb"] < MAX_GROWTH_MB, result
    assert result["code"] == 2 and str(b / "steps") in result["stderr"], result


def test_zstd_chunks_are_decoded_into_a_buffer_of_their_declared_size(tmp_path: Path) -> None:
    """A trace chunk is decoded into a buffer of the chunk's size, whatever its frames declare."""
    from ckptverify.trace import store as store_module

    good = _store(tmp_path / "a")
    assert [r.step for r in store_module.open_trace(good)] == list(range(1, 11))
    for declare in (False, True):
        (good / "steps" / "c" / "0").write_bytes(_rle_bomb(4 << 20, declare))
        with pytest.raises(CkptVerifyError):
            store_module.open_trace(good)


@pytest.mark.parametrize(("rows", "why"), [(1 << 26, "outside"), (1 << 23, "missing")])
def test_zarr_json_declaring_millions_of_rows_is_refused_at_once(tmp_path: Path, rows: int, why: str, cli: Cli) -> None:
    a = _store(tmp_path / "a")
    b = _store(tmp_path / "b")
    _edit(b / "zarr.json", _set(("attributes", "rows"), rows))
    _edit(b / "steps" / "zarr.json", _set(("shape",), [rows]))
    _edit(b / "values" / "zarr.json", _set(("shape",), [rows, 4, 2]))
    _edit(b / "present" / "zarr.json", _set(("shape",), [rows, 4]))
    result = cli("trace", "diff", str(a), str(b))
    assert result["grown_mb"] < MAX_GROWTH_MB, result
    assert result["code"] == 2 and why in result["stderr"], result


_FUZZ_TARGETS = ("zarr.json", "sites/zarr.json", "steps/zarr.json", "values/zarr.json", "present/zarr.json")


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_trace_store_metadata_raises_only_trace_errors(tmp_path_factory: pytest.TempPathFactory,
                                                            data: st.DataObject) -> None:
    from ckptverify.trace.store import open_trace

    base = tmp_path_factory.getbasetemp() / "fuzz-store"
    if not base.exists():
        _store(base)
    store = tmp_path_factory.mktemp("fuzz")
    shutil.rmtree(store)
    shutil.copytree(base, store)
    for _ in range(data.draw(st.integers(1, 3))):
        target = store / data.draw(st.sampled_from(_FUZZ_TARGETS))
        meta = json.loads(target.read_text())
        where = data.draw(st.sampled_from(_paths(meta)[1:]))
        replacement = data.draw(_json_values | st.sampled_from([1 << 40, -1, 2.0, True, [1 << 30], "Infinity"]))
        _set(where, replacement)(meta)
        text = json.dumps(meta).replace('"Infinity"', "Infinity")
        target.write_text(text)
    try:
        trace = open_trace(store)
        for row in trace:
            assert isinstance(row.step, int)
    except CkptVerifyError:
        pass


# ------------------------------------------------------------------------------------------- verify --deep


def test_deep_verify_rebuilds_an_expanded_dcp_tensor_in_bounded_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        cli: Cli) -> None:
    """A stride-0 (expanded) tensor of 2**27 elements over one stored element is a valid tensor (``torch.load``
    reads it): ``--deep`` rebuilds it block by block, within its memory bound, and calls nothing damaged."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as fs

    def values(self: Any) -> Any:  # DCP clones such views before saving; a writer that does not is legal
        for _, obj in self.items:
            yield self.resolve_fun(obj).detach(), obj

    monkeypatch.setattr(fs._SerialCpuLoader, "values", values)
    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.full((1,), 0.5).expand(1 << 27), "b": torch.ones(3)},
                 storage_writer=fs.FileSystemWriter(str(ckpt), thread_count=1))
    assert sum(p.stat().st_size for p in ckpt.iterdir()) < 100_000
    result = cli("verify", "--deep", "--no-progress", "--json", str(ckpt))
    assert result["grown_mb"] < MAX_GROWTH_MB, result
    report = _report(result)
    assert result["code"] == 0, report
    assert not [f for f in report["findings"] if f["severity"] == "error"], report
    assert not [f for f in report["findings"] if f["check"] in ("deep-limit", "deep-incomplete")], report
    assert {"check": "fingerprint", "count": 2, "unit": "tensors"} in report["coverage"], report
    assert "corrupt" not in json.dumps(report["findings"])


def test_a_store_whose_only_row_is_step_0_opens(tmp_path: Path) -> None:
    """zarr leaves a chunk that equals the fill value unwritten: the steps chunk of a store whose one row is
    step 0 is absent, and so is a values chunk of zeros. Neither is missing data."""
    from ckptverify.trace.store import Cell, TraceHeader, TraceWriter, open_trace

    store = tmp_path / "s"
    with TraceWriter(store, header=TraceHeader(run="s", rank=0, world_size=1), background=False) as w:
        w.append(0, [Cell.from_int("c", "counter", 0), Cell("param.w", "param", (0, 0))])
    assert not (store / "steps" / "c").exists()
    assert [(r.step, r.values) for r in open_trace(store)] == [(0, {"c": 0, "param.w": "0" * 32})]
