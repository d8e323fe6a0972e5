"""``ckptverify.save`` / ``async_save`` and the hashing DCP writer, on real DCP saves.

Every manifest is checked against an independent re-read of the bytes on disk; ``.metadata`` must stay a
plain DCP file (unpickled in a fresh interpreter that never imports ckptverify) that ``dcp.load`` reads
back bitwise. The last group of tests pins the DCP internals the writer relies on, so a torch upgrade that
changes them fails here, loudly.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.multiproc import spawn_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckptverify
from ckptverify.checkpoint.save import async_save, save
from ckptverify.dcp.writer import HashedStorageInfo, HashingFileSystemWriter
from ckptverify.errors import UsageError
from ckptverify.fingerprint import FINGERPRINT_VERSION, block_digests, digest_file_range, tensor_fingerprint
from ckptverify.ownfiles.manifest import MANIFEST_FILE, Manifest, read_manifest

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:Detected an existing checkpoint:UserWarning",
)

IN, HIDDEN, OUT = 64, 96, 16
WORLD = 2


# ------------------------------------------------------------------------------------------ state


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))


def step_once(model: torch.nn.Module) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randn(8, IN, generator=torch.Generator().manual_seed(1))
    model(batch).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return optim


def extras() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(2)
    odd = torch.randn(40, generator=gen)
    odd[[1, 5]] = float("nan")
    odd[[2, 3, 30]] = torch.tensor([float("inf"), -float("inf"), float("inf")])
    return {
        "step": 7,
        "name": "ckptverify",
        "extra": {
            "bf16": torch.randn(16, 16, generator=gen).to(torch.bfloat16),
            "i64": torch.arange(100, dtype=torch.int64),
            "mask": torch.rand(33, generator=gen) > 0.5,
            "odd": odd,
            "big": torch.randn(300, 70, generator=gen),  # 84000 bytes: several 16 KiB blocks
        },
    }


def full_state(seed: int = 0) -> dict[str, Any]:
    """Model + AdamW (one step) + extras, in one process."""
    model = make_model(seed)
    optim = step_once(model)
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, **extras()}


def flat_tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested state dict by DCP's flattened FQN (``a.b.c``)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(flat_tensors(v, f"{prefix}{k}."))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            out.update(flat_tensors(v, f"{prefix}{i}."))
    elif isinstance(state, torch.Tensor):
        out[prefix[:-1]] = state
    return out


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bitwise_equal(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert raw_bytes(actual) == raw_bytes(expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), where
        for k in expected:
            assert_bitwise_equal(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bitwise_equal(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


# ------------------------------------------------------------------------------------------ checks


def _own_range(root: Path, fqn: str, info: Any) -> tuple[str, int, int]:
    """Where an item's bytes are: what ``.metadata`` says, except for a tensor in a safetensors blob, which DCP
    places at the blob's start: its bytes are where the blob's header says (read here with json alone)."""
    import json
    import struct

    with open(root / info.relative_path, "rb") as fh:
        fh.seek(info.offset)
        head = fh.read(9)
        if len(head) == 9 and head[8:9] == b"{":
            (n,) = struct.unpack("<Q", head[:8])
            fh.seek(info.offset + 8)
            entry = json.loads(fh.read(n)).get(fqn)
            if entry is not None:
                begin, end = entry["data_offsets"]
                return info.relative_path, info.offset + 8 + n + begin, end - begin
    return info.relative_path, info.offset, info.length


def check_manifest_against_disk(root: Path, manifest: Manifest) -> None:
    """Every digest in the manifest equals an independent re-read of the bytes it describes."""
    assert manifest.items, "no items"
    algo, bsize = manifest.digest_algorithm, manifest.block_bytes
    for it in manifest.items:
        path = root / it.file
        assert digest_file_range(path, it.offset, it.length, algo) == it.digest, it
        rd = block_digests(path, it.offset, it.length, algo, bsize)
        assert rd.digest == it.digest and rd.blocks == it.blocks, it
        assert len(it.blocks) == -(-it.length // bsize), it
    for name, entry in {**manifest.files, **manifest.metadata_files}.items():
        size = (root / name).stat().st_size
        assert size == entry.size, name
        assert digest_file_range(root / name, 0, size, algo) == entry.digest, name
    # Every item's file is listed, and the items match what .metadata says, one for one.
    assert {it.file for it in manifest.items} <= set(manifest.files)
    md = FileSystemReader(str(root)).read_metadata()
    from_md = {
        (idx.fqn, None if idx.offset is None else tuple(idx.offset)): _own_range(root, idx.fqn, s)
        for idx, s in md.storage_data.items()
    }
    from_manifest = {(it.fqn, it.chunk_offsets): (it.file, it.offset, it.length) for it in manifest.items}
    assert from_manifest == from_md
    tensor_fqns = {k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
    assert set(manifest.tensors) == tensor_fqns
    for fqn, entry in manifest.tensors.items():
        tmd = md.state_dict_metadata[fqn]
        assert entry.shape == tuple(tmd.size)
        assert entry.dtype == str(tmd.properties.dtype).removeprefix("torch.")
    # The manifest file is the same manifest, and its self-digest holds.
    assert read_manifest(str(root)) == manifest


def check_common_fields(manifest: Manifest, *, world_size: int, fingerprint: bool, digest: str = "xxh3-128") -> None:
    assert manifest.world_size == world_size
    assert manifest.digest_algorithm == digest
    assert manifest.source == "save"
    assert manifest.tool_version == ckptverify.__version__
    assert manifest.torch_version == torch.__version__
    assert manifest.created.endswith("+00:00")
    assert set(manifest.metadata_files) == {".metadata"}
    if fingerprint:
        assert manifest.fingerprint_version == FINGERPRINT_VERSION
        assert all(t.fingerprint is not None for t in manifest.tensors.values())
    else:
        assert manifest.fingerprint_version is None
        assert all(t.fingerprint is None and t.nan_count is None for t in manifest.tensors.values())


def check_fingerprints_match(manifest: Manifest, state: dict[str, Any]) -> None:
    """The manifest's tensor fingerprints (and NaN/Inf counts) are those of the full tensors in ``state``."""
    tensors = flat_tensors(state)
    assert set(manifest.tensors) == set(tensors)
    for fqn, t in tensors.items():
        entry = manifest.tensors[fqn]
        assert entry.fingerprint == tensor_fingerprint(t).value, fqn
        if t.dtype.is_floating_point:
            assert entry.nan_count == int(t.isnan().sum()), fqn
            assert entry.inf_count == int(t.isinf().sum()), fqn
        else:
            assert entry.nan_count is None and entry.inf_count is None, fqn


_PLAIN_CHECK = textwrap.dedent("""
    import json, pickle, sys
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    def problem(path):
        try:
            with open(path, "rb") as f:
                md = pickle.load(f)
        except Exception as exc:
            return f"does not unpickle: {type(exc).__name__}: {exc}"
        if type(md) is not Metadata:
            return f"unpickles as {type(md)}"
        kinds = {type(v) for v in md.storage_data.values()}
        if kinds != {_StorageInfo}:
            return f"storage data of types {kinds}"
        for v in md.storage_data.values():
            if not set(vars(v)) <= {"relative_path", "offset", "length", "transform_descriptors"}:
                return f"storage info with fields {vars(v)}"
        return None

    found = {path: problem(path) for path in sys.argv[1:]}
    assert not any(m == "ckptverify" or m.startswith("ckptverify.") for m in sys.modules), "ckptverify imported"
    print(json.dumps(found))
""")


def plain_metadata_problems(*roots: Path) -> dict[Path, str | None]:
    """Each root's ``.metadata`` unpickled in one fresh interpreter that never imports ckptverify: ``None`` for a
    root whose metadata is plain DCP classes, else what is wrong with it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-I", "-c", _PLAIN_CHECK, *(str(r / ".metadata") for r in roots)],
        capture_output=True, text=True, env=env, cwd="/", timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout)
    assert len(found) == len(roots), found
    return {root: found[str(root / ".metadata")] for root in roots}


def check_plain_metadata(*roots: Path) -> None:
    """``.metadata`` unpickles in a fresh interpreter that never imports ckptverify, as plain DCP classes."""
    assert plain_metadata_problems(*roots) == dict.fromkeys(roots)


def load_back(root: Path, seed: int = 123) -> dict[str, Any]:
    """Load with plain DCP into a state dict shaped like :func:`full_state` but holding other values."""
    template = full_state(seed)
    template["step"], template["name"] = -1, ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=FileSystemReader(str(root)))
    return template


# ---------------------------------------------------------------------------------- one process

WRITER_VARIANTS = {
    "default": {},
    "threads": {"thread_count": 3},
    "per_item": {"single_file_per_rank": False},
    "sha256_small_blocks": {"digest": "sha256", "block_bytes": 16 << 10},
    "no_fingerprint": {"fingerprint": False},
}


@pytest.fixture(scope="module")
def reference_state() -> dict[str, Any]:
    return full_state(0)


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory, reference_state: dict[str, Any]
) -> dict[str, tuple[Path, Manifest]]:
    """One checkpoint per writer variant, saved once for the module."""
    out = {}
    for name, kwargs in WRITER_VARIANTS.items():
        root = tmp_path_factory.mktemp(f"save-{name}")
        manifest = save(reference_state, root, **kwargs)
        assert manifest is not None
        out[name] = (root, manifest)
    return out


@pytest.mark.parametrize("variant", sorted(WRITER_VARIANTS))
def test_manifest_matches_bytes_on_disk(saved: dict[str, tuple[Path, Manifest]], variant: str) -> None:
    root, manifest = saved[variant]
    kwargs = WRITER_VARIANTS[variant]
    assert (root / MANIFEST_FILE).is_file()
    check_manifest_against_disk(root, manifest)
    check_common_fields(
        manifest, world_size=1, fingerprint=kwargs.get("fingerprint", True), digest=kwargs.get("digest", "xxh3-128")
    )
    assert manifest.block_bytes == kwargs.get("block_bytes", 1 << 20)


def test_layouts_have_the_expected_files(saved: dict[str, tuple[Path, Manifest]]) -> None:
    assert set(saved["default"][1].files) == {"__0_0.distcp"}
    assert set(saved["threads"][1].files) == {"__0_0.distcp", "__0_1.distcp", "__0_2.distcp"}
    per_item = saved["per_item"][1]
    assert len(per_item.files) == len(per_item.items) > 10


def test_small_blocks_split_items(saved: dict[str, tuple[Path, Manifest]]) -> None:
    manifest = saved["sha256_small_blocks"][1]
    big = [it for it in manifest.items if it.fqn == "extra.big"]
    assert len(big) == 1 and len(big[0].blocks) == -(-big[0].length // (16 << 10)) >= 5
    assert all(len(b) == 64 for it in manifest.items for b in (it.digest, *it.blocks))  # sha256 hex


@pytest.fixture(scope="module")
def plain_metadata(saved: dict[str, tuple[Path, Manifest]], stream_transformed: tuple[Path, HashingFileSystemWriter],
                   two_rank_saves: tuple[Path, list[dict[str, Any]]]) -> dict[Path, str | None]:
    """:func:`plain_metadata_problems` of the module's checkpoints (every writer variant, the stream-transformed
    save, the two-rank ``sync`` and ``async_thread`` saves), all in one fresh interpreter: starting one that
    imports torch costs seconds, the check of one more ``.metadata`` nothing."""
    roots = [root for root, _ in saved.values()] + [stream_transformed[0]]
    roots += [two_rank_saves[0] / kind for kind in ("sync", "async_thread")]
    return plain_metadata_problems(*roots)


def test_metadata_is_plain_dcp(saved: dict[str, tuple[Path, Manifest]],
                               plain_metadata: dict[Path, str | None]) -> None:
    roots = [root for root, _ in saved.values()]
    assert {root: plain_metadata[root] for root in roots} == dict.fromkeys(roots)


@pytest.mark.parametrize("variant", ["default", "threads", "per_item"])
def test_dcp_load_restores_bitwise(
    saved: dict[str, tuple[Path, Manifest]], reference_state: dict[str, Any], variant: str
) -> None:
    loaded = load_back(saved[variant][0])
    assert_bitwise_equal(loaded, reference_state)


def test_fingerprints_are_those_of_the_saved_tensors(
    saved: dict[str, tuple[Path, Manifest]], reference_state: dict[str, Any]
) -> None:
    manifest = saved["default"][1]
    check_fingerprints_match(manifest, reference_state)
    assert manifest.tensors["extra.odd"].nan_count == 2
    assert manifest.tensors["extra.odd"].inf_count == 3
    # Same values, another layout or digest: same fingerprints.
    for variant in ("threads", "per_item", "sha256_small_blocks"):
        assert saved[variant][1].tensors == manifest.tensors, variant


def test_fingerprint_false_leaves_fingerprints_null(saved: dict[str, tuple[Path, Manifest]]) -> None:
    manifest = saved["no_fingerprint"][1]
    assert manifest.fingerprint_version is None
    for entry in manifest.tensors.values():
        assert entry.fingerprint is None and entry.nan_count is None and entry.inf_count is None
    on_disk = json.loads((saved["no_fingerprint"][0] / MANIFEST_FILE).read_text())
    assert all(t["fingerprint"] is None for t in on_disk["tensors"].values())
    assert on_disk["fingerprint_version"] is None
    # Byte digests do not depend on the fingerprint switch: the files are the same bytes.
    assert manifest.files == saved["default"][1].files


def test_writer_digested_every_item_while_writing(tmp_path: Path, reference_state: dict[str, Any]) -> None:
    """Each item was one segment between two tell() calls: nothing was re-read from disk."""
    writer = HashingFileSystemWriter(str(tmp_path), thread_count=2)
    dcp.save(reference_state, storage_writer=writer)
    n = len(writer.manifest.items)
    assert writer.stats["items"] == n
    assert writer.stats["reread_items"] == 0
    assert writer.stats["tell_calls"] == 2 * n
    assert writer.stats["fingerprinted"] == len(flat_tensors(reference_state))
    check_manifest_against_disk(tmp_path, writer.manifest)


def test_async_save_thread(tmp_path: Path, reference_state: dict[str, Any]) -> None:
    future = async_save(reference_state, tmp_path / "ckpt", thread_count=2)
    future.result(timeout=120)
    manifest = read_manifest(str(tmp_path / "ckpt"))
    assert manifest is not None
    check_manifest_against_disk(tmp_path / "ckpt", manifest)
    check_common_fields(manifest, world_size=1, fingerprint=True)
    check_fingerprints_match(manifest, reference_state)
    assert_bitwise_equal(load_back(tmp_path / "ckpt"), reference_state)


def test_save_replaces_an_older_manifest(tmp_path: Path, reference_state: dict[str, Any]) -> None:
    first = save(reference_state, tmp_path)
    assert first is not None
    changed = full_state(seed=9)
    second = save(changed, tmp_path)
    assert second is not None
    assert read_manifest(str(tmp_path)) == second
    assert second.files["__0_0.distcp"] != first.files["__0_0.distcp"]
    check_manifest_against_disk(tmp_path, second)
    check_fingerprints_match(second, changed)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ckptverify-manifest-")]


def test_failed_save_leaves_no_manifest(tmp_path: Path, reference_state: dict[str, Any]) -> None:
    """The manifest of an earlier save is removed before anything is written, so a save that fails
    midway leaves no manifest claiming the directory is a committed checkpoint."""
    assert save(reference_state, tmp_path) is not None
    broken = {**reference_state, "unpicklable": lambda: None}
    with pytest.raises(ckptverify.errors.SaveFailedError, match="pickle"):
        save(broken, tmp_path)
    assert not (tmp_path / MANIFEST_FILE).exists()


def test_empty_files_of_a_rank_are_listed(tmp_path: Path) -> None:
    """thread_count larger than the number of items: DCP writes empty files; the manifest lists them."""
    manifest = save({"a": torch.arange(10.0), "b": torch.ones(3)}, tmp_path, thread_count=4)
    assert manifest is not None
    assert set(manifest.files) == {f"__0_{i}.distcp" for i in range(4)}
    assert sorted(e.size for e in manifest.files.values())[:2] == [0, 0]
    check_manifest_against_disk(tmp_path, manifest)


def test_safetensors_format_items_are_digested(tmp_path: Path) -> None:
    """Safetensors-format tensor items all point into one blob (not one segment each): their ranges are
    digested from the closed file instead, and still match."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    fmt = getattr(SerializationFormat, "SAFETENSORS", None)
    if fmt is None:
        pytest.skip("this torch has no safetensors serialization format")
    pytest.importorskip("safetensors")
    state = {"w": torch.randn(32, 8), "v": torch.arange(7), "step": 3}
    writer = HashingFileSystemWriter(str(tmp_path), serialization_format=fmt)
    dcp.save(state, storage_writer=writer)
    assert writer.stats["reread_items"] == 2
    check_manifest_against_disk(tmp_path, writer.manifest)
    check_fingerprints_match(writer.manifest, {"w": state["w"], "v": state["v"]})


@pytest.fixture(scope="module")
def stream_transformed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HashingFileSystemWriter]:
    """A save through a stream transform (DCP's experimental ``_extensions``: each byte XORed) and its writer."""
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class _Xor(io.RawIOBase):
        def __init__(self, out: Any) -> None:
            self.out = out

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            data = bytes(memoryview(b).cast("B"))
            self.out.write(bytes(x ^ 0x5A for x in data))
            return len(data)

        def close(self) -> None:
            self.out.close()
            super().close()

    class XorExtension(StreamTransformExtension):
        @staticmethod
        def registry_name() -> str:
            return "xor"

        @staticmethod
        def from_descriptor(version: str) -> XorExtension:
            return XorExtension()

        def get_descriptor(self) -> str:
            return "xor/1"

        def transform_to(self, output: Any) -> Any:
            return _Xor(output)

        def transform_from(self, input: Any) -> Any:  # pragma: no cover - this test only saves
            raise AssertionError("the test saves with this extension; nothing loads through it")

    root = tmp_path_factory.mktemp("stream-transform")
    state = {"w": torch.randn(64, 64), "k": [1, 2, 3]}
    writer = HashingFileSystemWriter(str(root), _extensions=[XorExtension()], block_bytes=4096)
    dcp.save(state, storage_writer=writer)
    return root, writer


def test_stream_transform_extension_items_are_digested(stream_transformed: tuple[Path, HashingFileSystemWriter],
                                                       plain_metadata: dict[Path, str | None]) -> None:
    """With a stream transform (DCP's experimental ``_extensions``), each item's transformed bytes are
    still written between two tell() calls, so they are digested as written, and the digests are those
    of the bytes on disk."""
    root, writer = stream_transformed
    assert writer.stats["reread_items"] == 0
    check_manifest_against_disk(root, writer.manifest)
    md = FileSystemReader(str(root)).read_metadata()
    assert all(s.transform_descriptors == ["xor/1"] for s in md.storage_data.values())
    assert plain_metadata[root] is None


def test_several_ranks_without_collectives_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    writer = HashingFileSystemWriter(str(tmp_path))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    with pytest.raises(UsageError, match="use_collectives=True"):
        writer.set_up_storage_writer(True, rank=0, use_collectives=False)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)  # with collectives: fine


def test_writer_is_picklable(tmp_path: Path) -> None:
    writer = HashingFileSystemWriter(str(tmp_path), digest="sha256", block_bytes=4096, fingerprint=False)
    copy = pickle.loads(pickle.dumps(writer))
    assert (copy.digest, copy.block_bytes, copy.fingerprint) == ("sha256", 4096, False)
    dcp.save({"x": torch.arange(5.0)}, storage_writer=copy)
    manifest = read_manifest(str(tmp_path))
    assert manifest is not None and manifest.digest_algorithm == "sha256"
    check_manifest_against_disk(tmp_path, manifest)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"digest": "md5"}, "unknown digest"),
        ({"digest": "XXH3-128"}, "unknown digest"),
        ({"block_bytes": 0}, "block size"),
        ({"block_bytes": -4096}, "block size"),
        ({"block_bytes": 1.5}, "block size"),
        ({"block_bytes": True}, "block size"),
        ({"block_bytes": 512}, "block size"),
        ({"block_bytes": 1 << 31}, "block size"),
        ({"thread_count": 0}, "thread_count"),
        ({"frobnicate": 1}, "unknown keyword"),
        ({"storage_writer": None}, "storage_writer"),
        ({"checkpoint_id": "x"}, "checkpoint_id"),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    for fn in (save, async_save):
        with pytest.raises(UsageError, match=message):
            fn({"x": torch.zeros(1)}, tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())
    if set(kwargs) <= {"digest", "block_bytes"}:
        with pytest.raises(UsageError, match=message):
            HashingFileSystemWriter(str(tmp_path), **kwargs)


@pytest.mark.parametrize("path", ["s3://bucket/ckpt", "file:///tmp/ckpt", b"ckpt", 7])
def test_a_path_that_is_not_a_local_directory_path_is_a_usage_error(path: Any) -> None:
    for fn in (save, async_save):
        with pytest.raises(UsageError, match="path must be a local directory path"):
            fn({"x": torch.zeros(1)}, path)


def test_usage_error_is_exit_code_2() -> None:
    with pytest.raises(UsageError) as info:
        save({}, "/nonexistent", digest="crc32")
    assert info.value.exit_code == 2


@pytest.mark.parametrize("parallel_min", [1 << 62, 64])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(st.integers(0, 5000), st.just("tell")), max_size=30),
       block=st.integers(1, 700), algo=st.sampled_from(["xxh3-128", "sha256"]))
def test_hashing_stream_segments(
    monkeypatch: pytest.MonkeyPatch, parallel_min: int, ops: list[Any], block: int, algo: str
) -> None:
    """Any sequence of writes and tell() calls: the file digest covers every byte, and each stretch between
    two tell() calls is one segment with the digest and block digests of exactly its bytes."""
    from ckptverify.dcp import writer as w
    from ckptverify.fingerprint import BlockDigest, digest_bytes

    monkeypatch.setattr(w, "PARALLEL_HASH_MIN_BYTES", parallel_min)
    raw = io.BytesIO()
    stream = w._HashingStream(raw, algo, block)
    expected: dict[tuple[int, int], tuple[str, tuple[str, ...]]] = {}
    start = pos = 0
    for k, op in enumerate(ops):
        if op == "tell":
            assert stream.tell() == pos
            if pos > start:
                ref = BlockDigest(algo, block)
                ref.update(raw.getvalue()[start:pos])
                expected[(start, pos - start)] = (ref.hexdigest(), tuple(ref.block_hexdigests()))
            start = pos
        else:
            data = bytes((k * 31 + i) % 251 for i in range(op))
            assert stream.write(memoryview(data)) == op
            pos += op
    record = stream.finalize()
    if pos > start:
        ref = BlockDigest(algo, block)
        ref.update(raw.getvalue()[start:pos])
        expected[(start, pos - start)] = (ref.hexdigest(), tuple(ref.block_hexdigests()))
    assert record.size == pos == len(raw.getvalue())
    assert record.digest == digest_bytes(raw.getvalue(), algo)
    assert {k: (v.digest, v.blocks) for k, v in record.segments.items()} == expected
    with pytest.raises(ValueError):
        stream.write(b"x")


def test_large_items_digested_in_parallel(tmp_path: Path) -> None:
    """Tensors of several MiB take the parallel write-and-digest path; digests still match the disk."""
    from ckptverify.dcp import writer as w

    assert w.PARALLEL_HASH_MIN_BYTES <= 1 << 20
    gen = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(3 << 18, generator=gen), "big2": torch.randn(700_001, generator=gen)}
    manifest = save(state, tmp_path, block_bytes=(1 << 20) - 7, thread_count=2)
    assert manifest is not None
    check_manifest_against_disk(tmp_path, manifest)
    check_fingerprints_match(manifest, state)
    assert max(len(it.blocks) for it in manifest.items) == 4


# --------------------------------------------------------------------- DCP internals we rely on


class _TellRecorder(io.RawIOBase):
    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.events: list[tuple[str, int]] = []

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self.buf.write(b)
        self.events.append(("write", n))
        return n

    def tell(self) -> int:
        pos = self.buf.tell()
        self.events.append(("tell", pos))
        return pos


def test_dcp_write_item_calls_tell_before_and_after_each_item() -> None:
    """The writer cuts segments at tell(): ``_write_item`` must call it exactly once before the item's first
    byte and once after its last, and return those positions as the item's offset and length."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat, _StorageWriterTransforms, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType

    stream = _TellRecorder()
    plan = dcp.DefaultSavePlanner()
    state = {"t": torch.randn(50, 3), "b": {"k": [1, 2]}}
    plan.set_up_planner(state, is_coordinator=True)
    local = plan.create_local_plan()
    results = []
    for item in local.items:
        data = plan.resolve_data(item)
        start = len(stream.events)
        wr = _write_item(_StorageWriterTransforms(), stream, data, item, "f", SerializationFormat.TORCH_SAVE)
        events = stream.events[start:]
        tells = [i for i, (kind, _) in enumerate(events) if kind == "tell"]
        assert tells == [0, len(events) - 1], (item.type, events)
        begin, end = events[0][1], events[-1][1]
        assert end - begin == sum(n for kind, n in events if kind == "write") > 0
        assert (wr.storage_data.offset, wr.storage_data.length) == (begin, end - begin)
        assert wr.size_in_bytes == end - begin
        results.append(item.type)
    assert set(results) == {WriteItemType.TENSOR, WriteItemType.BYTE_IO}


def test_dcp_private_shapes_the_writer_relies_on(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    assert [f.name for f in dataclasses.fields(_StorageInfo)] == [
        "relative_path", "offset", "length", "transform_descriptors"
    ]
    assert [f.name for f in dataclasses.fields(WriteResult)] == ["index", "size_in_bytes", "storage_data"]
    assert WriteResult.__dataclass_params__.frozen
    assert list(inspect.signature(FileSystem.create_stream).parameters) == ["self", "path", "mode"]
    plain = FileSystemWriter(str(tmp_path))
    assert isinstance(plain.fs, FileSystem)
    for name in ("set_up_storage_writer", "prepare_local_plan", "write_data", "finish"):
        assert callable(getattr(FileSystemWriter, name)), name
    for name in ("rank", "use_collectives", "path", "sync_files", "thread_count"):
        assert hasattr(plain, name), name
    # _StorageInfo pickles only its own fields, so dropping HashedStorageInfo restores a plain record.
    hashed = HashedStorageInfo("f", 1, 2, None, digest="d", blocks=("b",), file_size=3, file_digest="e")
    assert pickle.loads(pickle.dumps(hashed.plain())) == _StorageInfo("f", 1, 2)
    assert type(hashed.plain()) is _StorageInfo
    # A HashedStorageInfo survives the pickling DCP's gather does.
    again = pickle.loads(pickle.dumps(hashed))
    assert again.digest == "d" and again.blocks == ("b",) and again.fingerprint is None


def test_dcp_finish_writes_the_storage_data_it_is_given(tmp_path: Path) -> None:
    """The writer hands ``FileSystemWriter.finish`` plain records; ``.metadata`` must hold exactly those."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    writer = HashingFileSystemWriter(str(tmp_path))
    dcp.save({"x": torch.arange(4.0), "y": "text"}, storage_writer=writer)
    md = FileSystemReader(str(tmp_path)).read_metadata()
    assert {type(v) for v in md.storage_data.values()} == {_StorageInfo}
    got = {(i.fqn, s.relative_path, s.offset, s.length) for i, s in md.storage_data.items()}
    assert got == {(it.fqn, it.file, it.offset, it.length) for it in writer.manifest.items}


def test_use_collectives_false_single_process(tmp_path: Path) -> None:
    manifest = save({"x": torch.arange(6.0)}, tmp_path, use_collectives=False)
    assert manifest is not None
    assert set(manifest.metadata_files) == {"__0.metadata"}
    entry = manifest.metadata_files["__0.metadata"]
    assert digest_file_range(tmp_path / "__0.metadata", 0, entry.size) == entry.digest


# ---------------------------------------------------------------------------------------- 2 ranks


def _two_rank_worker(rank: int, world: int, root: str, process_based: bool) -> None:
    """Both ranks: FSDP2 on a CPU mesh, AdamW stepped once, then saves through ckptverify."""
    warnings.simplefilter("ignore", UserWarning)
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(0)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = step_once(model)
    model_sd, optim_sd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, **extras()}
    # Rank-local state is keyed by rank (DCP deduplicates equal keys across ranks).
    state[f"rank_state.{rank}"] = {"rank": rank, "noise": torch.full((5,), float(rank))}

    report: dict[str, Any] = {}
    if process_based:
        future = async_save(
            state, os.path.join(root, "async_process"), async_checkpointer_type=AsyncCheckpointerType.PROCESS
        )
        future.result(timeout=120)
    else:
        manifest = save(state, os.path.join(root, "sync"), thread_count=2)
        report["sync_returned_manifest"] = manifest is not None
        dist.barrier()
        async_save(state, os.path.join(root, "async_thread")).result(timeout=120)
    dist.barrier()
    with open(os.path.join(root, f"report.{rank}.json"), "w") as f:
        json.dump(report, f)


def _run_two_ranks(root: Path, process_based: bool) -> list[dict[str, Any]]:
    spawn_ranks(_two_rank_worker, WORLD, str(root), process_based)
    return [json.loads((root / f"report.{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def two_rank_saves(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """``sync`` (thread_count=2) and ``async_thread`` saves of one 2-rank FSDP2 job."""
    root = tmp_path_factory.mktemp("two-rank")
    return root, _run_two_ranks(root, process_based=False)


def _two_rank_expected() -> dict[str, Any]:
    """What the 2-rank job saved, built whole in one process from the same seeds."""
    state = full_state(0)
    for rank in range(WORLD):
        state[f"rank_state.{rank}"] = {"rank": rank, "noise": torch.full((5,), float(rank))}
    return state


def _check_two_rank_checkpoint(path: Path) -> Manifest:
    manifest = read_manifest(str(path))
    assert manifest is not None
    check_common_fields(manifest, world_size=WORLD, fingerprint=True)
    check_manifest_against_disk(path, manifest)
    files = set(manifest.files)
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)
    # The FSDP2 shards of the first weight (dim-0 chunks at rows 0 and HIDDEN/2) came from both ranks.
    chunks = {it.chunk_offsets: it.file for it in manifest.items if it.fqn == "model.0.weight"}
    assert set(chunks) == {(0, 0), (HIDDEN // 2, 0)}
    assert {f[:4] for f in chunks.values()} == {"__0_", "__1_"}
    assert {it.fqn for it in manifest.items} >= {"rank_state.0.noise", "rank_state.1.noise"}
    # The logical fingerprints of the sharded save are those of the same tensors built whole in 1 process.
    expected = _two_rank_expected()
    check_fingerprints_match(manifest, expected)
    # Plain DCP loads it back, resharded into whole tensors in this one process, bitwise.
    template = full_state(123)
    template["step"], template["name"] = -1, ""
    for rank in range(WORLD):
        template[f"rank_state.{rank}"] = {"rank": -1, "noise": torch.zeros(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=FileSystemReader(str(path)))
    assert_bitwise_equal(template, expected, path.name)
    return manifest


def test_two_rank_save_returns_manifest_on_coordinator_only(two_rank_saves: tuple[Path, list[dict]]) -> None:
    _, reports = two_rank_saves
    assert [r["sync_returned_manifest"] for r in reports] == [True, False]


@pytest.mark.parametrize("kind", ["sync", "async_thread"])
def test_two_rank_fsdp2_manifest(two_rank_saves: tuple[Path, list[dict]], kind: str) -> None:
    root, _ = two_rank_saves
    manifest = _check_two_rank_checkpoint(root / kind)
    if kind == "sync":
        assert len([f for f in manifest.files if f.startswith("__0_")]) == 2  # thread_count=2


def test_two_rank_metadata_is_plain_dcp(two_rank_saves: tuple[Path, list[dict]],
                                       plain_metadata: dict[Path, str | None]) -> None:
    root, _ = two_rank_saves
    assert {kind: plain_metadata[root / kind] for kind in ("sync", "async_thread")} == dict.fromkeys(
        ("sync", "async_thread"))


def test_two_rank_manifest_matches_single_process_manifest(
    two_rank_saves: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    """Saved whole from one process, the same tensors get the same manifest tensor entries."""
    root, _ = two_rank_saves
    single = save(_two_rank_expected(), tmp_path)
    sharded = read_manifest(str(root / "sync"))
    assert single is not None and sharded is not None
    assert sharded.tensors == single.tensors


@pytest.mark.slow
def test_two_rank_async_save_process_based(tmp_path: Path) -> None:
    """``async_checkpointer_type=PROCESS``: the writer is pickled to a checkpoint process per rank, which
    gathers the results and writes the manifest there."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if not hasattr(AsyncCheckpointerType, "PROCESS"):
        pytest.skip("this torch has no process-based async checkpointer")
    _run_two_ranks(tmp_path, process_based=True)
    _check_two_rank_checkpoint(tmp_path / "async_process")
    check_plain_metadata(tmp_path / "async_process")
