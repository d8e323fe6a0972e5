"""Byte digests and the logical tensor fingerprint (``ckptverify.fingerprint``)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash
from helpers.multiproc import spawn_ranks
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ckptverify import fingerprint as fp
from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.fingerprint import eager as ref
from ckptverify.fingerprint import kernels as kern
from ckptverify.fingerprint import spec

pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

# ------------------------------------------------------------------------------------------ byte digests

REFERENCE = {"xxh3-128": lambda b: xxhash.xxh3_128(b).hexdigest(), "sha256": lambda b: hashlib.sha256(b).hexdigest()}
algorithms = st.sampled_from(sorted(REFERENCE))


@given(data=st.binary(max_size=5000), algorithm=algorithms, cuts=st.lists(st.integers(0, 5000), max_size=5))
def test_new_digest_matches_reference_in_any_pieces(data: bytes, algorithm: str, cuts: list[int]) -> None:
    digest = fp.new_digest(algorithm)
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    for a, b in itertools.pairwise(bounds):
        digest.update(data[a:b])
    assert digest.hexdigest() == REFERENCE[algorithm](data)
    assert fp.digest_bytes(data, algorithm) == REFERENCE[algorithm](data)


def test_default_algorithm_is_xxh3_128() -> None:
    assert fp.DEFAULT_ALGORITHM == "xxh3-128"
    assert fp.new_digest().hexdigest() == xxhash.xxh3_128(b"").hexdigest()


@pytest.mark.parametrize("algorithm", ["md5", "xxh3", "", "SHA256"])
def test_unknown_algorithm_is_a_usage_error(algorithm: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        fp.new_digest(algorithm)
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    with pytest.raises(UsageError):
        fp.digest_file_range(path, 0, 3, algorithm)
    with pytest.raises(UsageError):
        fp.block_digests(path, 0, 3, algorithm)


@pytest.fixture(scope="module")
def random_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    data = os.urandom(300_000)
    path = tmp_path_factory.mktemp("digest") / "data.bin"
    path.write_bytes(data)
    return path, data


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offset=st.integers(0, 300_000),
    length=st.integers(0, 300_000),
    algorithm=algorithms,
)
def test_digest_file_range_matches_reference(
    random_file: tuple[Path, bytes], offset: int, length: int, algorithm: str
) -> None:
    path, data = random_file
    length = min(length, len(data) - offset)
    assume(length >= 0)
    got = fp.digest_file_range(path, offset, length, algorithm)
    assert got == REFERENCE[algorithm](data[offset : offset + length])


def test_digest_file_range_past_end_raises(random_file: tuple[Path, bytes]) -> None:
    path, data = random_file
    with pytest.raises(CkptVerifyError, match=r"extends past the end of the file \(10 of 11 bytes readable\)"):
        fp.digest_file_range(path, len(data) - 10, 11)
    with pytest.raises(CkptVerifyError, match=r"\(0 of 1 bytes readable\)"):
        fp.block_digests(path, len(data) + 5, 1)


def test_digest_file_range_rejects_negative_range(random_file: tuple[Path, bytes]) -> None:
    path, _ = random_file
    with pytest.raises(UsageError):
        fp.digest_file_range(path, -1, 10)
    with pytest.raises(UsageError):
        fp.digest_file_range(path, 0, -1)


def test_digest_file_range_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fp.digest_file_range(tmp_path / "nope", 0, 10)
    with pytest.raises(FileNotFoundError):
        fp.digest_file_range(tmp_path / "nope", 0, 0)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offset=st.integers(0, 200_000),
    length=st.integers(0, 100_000),
    block_size=st.sampled_from([1000, 4096, 65_536, 1 << 20]),
    algorithm=algorithms,
)
def test_block_digests_match_reference(
    random_file: tuple[Path, bytes], offset: int, length: int, block_size: int, algorithm: str
) -> None:
    path, data = random_file
    got = fp.block_digests(path, offset, length, algorithm, block_size=block_size)
    piece = data[offset : offset + length]
    assert got.digest == REFERENCE[algorithm](piece)
    expected = [REFERENCE[algorithm](piece[i : i + block_size]) for i in range(0, len(piece), block_size)]
    assert list(got.blocks) == expected
    assert got.block_size == block_size
    assert got.algorithm == algorithm


def test_block_digests_default_block_is_one_mib(random_file: tuple[Path, bytes], tmp_path: Path) -> None:
    data = os.urandom((2 << 20) + 5)
    path = tmp_path / "two-mib"
    path.write_bytes(data)
    got = fp.block_digests(path, 0, len(data))
    assert got.block_size == 1 << 20
    assert len(got.blocks) == 3
    assert got.blocks[2] == xxhash.xxh3_128(data[2 << 20 :]).hexdigest()


def test_block_digests_locate_a_flipped_byte(tmp_path: Path) -> None:
    data = bytearray(os.urandom(10_000))
    path = tmp_path / "f"
    path.write_bytes(data)
    before = fp.block_digests(path, 100, 9_000, block_size=1000)
    data[100 + 4_321] ^= 0x10
    path.write_bytes(data)
    after = fp.block_digests(path, 100, 9_000, block_size=1000)
    assert before.digest != after.digest
    assert [i for i, (a, b) in enumerate(zip(before.blocks, after.blocks, strict=True)) if a != b] == [4]


@given(data=st.binary(max_size=3000), block_size=st.integers(1, 700), cuts=st.lists(st.integers(0, 3000)))
def test_block_digest_streaming(data: bytes, block_size: int, cuts: list[int]) -> None:
    digest = fp.BlockDigest("xxh3-128", block_size)
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    for a, b in itertools.pairwise(bounds):
        digest.update(data[a:b])
    assert digest.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    expected = [xxhash.xxh3_128(data[i : i + block_size]).hexdigest() for i in range(0, len(data), block_size)]
    assert digest.block_hexdigests() == expected
    assert digest.length == len(data)


def test_block_digest_rejects_bad_block_size() -> None:
    with pytest.raises(UsageError):
        fp.BlockDigest("xxh3-128", 0)


# ------------------------------------------------------------------------- reference fingerprint (spec)
#
# The algorithm element by element, exactly as docs/fingerprint.md states it, with the one definition of the
# mixing step (spec.mix, on Python ints), which the published finalizers below pin. Every path must agree with it
# bit for bit.

MASK = (1 << 64) - 1
K = 0x9E3779B97F4A7C15


def ref_fmix64(x: int) -> int:
    """MurmurHash3's fmix64, as published (not the library's)."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK
    return x ^ (x >> 33)


def ref_mix13(x: int) -> int:
    """SplitMix64's finalizer (Stafford's Mix13), as published."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def ref_seed(name: str, lane: int) -> int:
    text = f"ckptverify/fingerprint/v1/lane{lane}/{name}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ref_fingerprint(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if t.is_complex():
        t = torch.view_as_real(t)
    words = t.contiguous().view(INT_VIEW[t.element_size()]).reshape(-1).tolist()
    s0, s1 = ref_seed(name, 0), ref_seed(name, 1)
    lane0 = lane1 = 0
    for g, bits in enumerate(words):  # row-major order: g is the global linear index
        w = bits & MASK  # sign-extended to 64 bits
        p = (g * K) & MASK
        lane0 += spec.mix(w ^ ((p + s0) & MASK), spec.LANES[0])
        lane1 += spec.mix(w ^ ((p + s1) & MASK), spec.LANES[1])
    return f"{lane0 & MASK:016x}{lane1 & MASK:016x}"


def eager_fingerprint(t: torch.Tensor, offsets: tuple[int, ...] | None = None,
                      shape: tuple[int, ...] | None = None) -> fp.TensorFingerprint:
    """The fingerprint of chunk ``t`` (at ``offsets`` in ``shape``; default: the whole tensor) through the eager
    torch path, on ``t``'s device: what a device that no fused kernel serves takes."""
    shape = tuple(t.shape) if shape is None else tuple(shape)
    offsets = (0,) * len(shape) if offsets is None else tuple(offsets)
    name = ref.dtype_name(t.dtype)
    lanes = kern.eager_fingerprint_lanes(t, offsets, shape, name)
    return fp.TensorFingerprint.from_lanes(lanes, name, shape, t.numel())


# ------------------------------------------------------------------------------------- tensor helpers

ALL_DTYPES = sorted(ref.SUPPORTED_DTYPES, key=str)
FLOAT8 = [d for d in ALL_DTYPES if "float8" in str(d) or "float4" in str(d)]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` with pseudo-random bits (any bit pattern, NaNs included)."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    size = dtype.itemsize
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(INT_VIEW[t.element_size()])


dtypes = st.sampled_from(ALL_DTYPES)
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


@contextlib.contextmanager
def small_blocks(eager: int = 32, row: int = 8, compiled: int = 64) -> Iterator[None]:
    """Shrink the block geometry so small tensors cross every block and row boundary (and take the paths of
    large chunks: no chunk is small enough for the one-shot numpy formula)."""
    saved = (ref.EAGER_BLOCK, ref.ROW_WIDTH, kern.COMPILED_BLOCK, kern.SMALL_NUMPY)
    ref.EAGER_BLOCK, ref.ROW_WIDTH, kern.COMPILED_BLOCK, kern.SMALL_NUMPY = eager, row, compiled, 0
    try:
        yield
    finally:
        ref.EAGER_BLOCK, ref.ROW_WIDTH, kern.COMPILED_BLOCK, kern.SMALL_NUMPY = saved


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    saved = fp.get_fingerprint_backend()
    fp.set_fingerprint_backend(name)
    try:
        yield
    finally:
        fp.set_fingerprint_backend(saved)


@st.composite
def chunkings(draw: st.DrawFn, shape: tuple[int, ...]) -> list[tuple[tuple[slice, ...], tuple[int, ...]]]:
    """A random grid of boxes covering ``shape``: (slices, offsets) per box."""
    cuts_per_dim = []
    for size in shape:
        cuts = draw(st.lists(st.integers(0, size), max_size=3))
        cuts_per_dim.append(sorted({0, size, *cuts}))
    boxes = []
    for ranges in itertools.product(*[list(itertools.pairwise(c)) or [(0, 0)] for c in cuts_per_dim]):
        boxes.append((tuple(slice(a, b) for a, b in ranges), tuple(a for a, _ in ranges)))
    return boxes


# ----------------------------------------------------------------------------------- the definition


@settings(max_examples=60, deadline=None)
@given(dtype=dtypes, shape=shapes, seed=st.integers(0, 2**32))
def test_matches_reference_definition(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> None:
    t = make_tensor(dtype, shape, seed)
    got = fp.tensor_fingerprint(t)
    assert got.value == ref_fingerprint(t)
    assert got.dtype == str(dtype).removeprefix("torch.")
    assert got.shape == shape
    assert got.version == fp.FINGERPRINT_VERSION == 1
    assert got.elements == t.numel()
    assert got.complete
    with small_blocks():
        assert fp.tensor_fingerprint(t) == got


def test_known_answer() -> None:
    """Pinned values: a change here changes every stored fingerprint (manifests written before would no longer
    verify), and needs a new version. The large tensor takes the host path; the rest the small-chunk path."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert fp.tensor_fingerprint(t).value == ref_fingerprint(t)
    assert fp.tensor_fingerprint(t).value == KNOWN_ANSWER_FLOAT32
    b = torch.tensor([True, False, True])
    assert fp.tensor_fingerprint(b).value == KNOWN_ANSWER_BOOL
    got = {
        "bfloat16": fp.tensor_fingerprint(make_tensor(torch.bfloat16, (5, 7), 1)),
        "int8": fp.tensor_fingerprint(make_tensor(torch.int8, (300,), 2)),
        "float64 chunk": fp.chunk_fingerprint(make_tensor(torch.float64, (3, 4), 3), (2, 5), (9, 9)),
        "complex64": fp.tensor_fingerprint(make_tensor(torch.complex64, (4, 3), 4)),
        "float8_e4m3fn transposed": fp.tensor_fingerprint(make_tensor(torch.float8_e4m3fn, (6, 6), 5).t()),
        "float32 large": fp.tensor_fingerprint(make_tensor(torch.float32, (3, 1 << 20), 6)),
        "empty": fp.tensor_fingerprint(torch.zeros(0, 4, dtype=torch.int64)),
    }
    assert {k: v.value for k, v in got.items()} == KNOWN_ANSWERS


KNOWN_ANSWER_FLOAT32 = "e379311fe8f5b228ef444722dab8845f"
KNOWN_ANSWER_BOOL = "203a194ad7c0b847503c24d59cf7533d"
KNOWN_ANSWERS = {
    "bfloat16": "199d79eb4022b1288ef3a17687805757",
    "int8": "83984a9935fddd16caa68982bc8a0f47",
    "float64 chunk": "853ac001dd060b0e32307643e4ba5275",
    "complex64": "a0fb8c2f9ca4281651d357c4100d1068",
    "float8_e4m3fn transposed": "dfcedb9761ee94f56b6547edf5fc7736",
    "float32 large": "5e93a3b401b0cb4e16c2314490bb4141",
    "empty": "0" * 32,
}


def test_mixers_are_the_published_finalizers() -> None:
    """spec.mix, the one definition of the mixing step, is MurmurHash3's fmix64 in lane 0 and SplitMix64's
    finalizer in lane 1, on Python ints and on numpy words alike."""
    import numpy as np

    xs = [0, 1, 2**63, MASK, 0x0123456789ABCDEF]
    for x in xs:
        assert spec.mix(x, spec.LANES[0]) == ref_fmix64(x)
        assert spec.mix(x, spec.LANES[1]) == ref_mix13(x)
    words = np.array(xs, dtype=np.uint64)
    assert [int(v) for v in spec.mix(words, spec.LANES[0])] == [ref_fmix64(x) for x in xs]
    assert [int(v) for v in spec.mix(words, spec.LANES[1])] == [ref_mix13(x) for x in xs]
    # SplitMix64 from state 0: the first output is the mixer applied to the golden-ratio increment.
    assert ref_mix13(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def test_large_tensor_crosses_blocks_and_matches_chunks() -> None:
    t = make_tensor(torch.float32, (300, 1000), 7)  # several eager blocks, rows of ROW_WIDTH and tails
    whole = fp.tensor_fingerprint(t)
    parts = [
        fp.chunk_fingerprint(t[:100], (0, 0), t.shape),
        fp.chunk_fingerprint(t[100:, :300], (100, 0), t.shape),
        fp.chunk_fingerprint(t[100:, 300:], (100, 300), t.shape),
    ]
    assert fp.combine(parts) == whole
    with small_blocks(eager=4096, row=512, compiled=8192):
        assert fp.tensor_fingerprint(t) == whole


def test_runs_between_row_width_and_block_size() -> None:
    """Column shards whose rows are wider than a block row but shorter than a block."""
    t = make_tensor(torch.float16, (12, 20_000), 3)
    whole = fp.tensor_fingerprint(t)
    assert whole.value == ref_fingerprint(t)
    parts = [fp.chunk_fingerprint(t[:, a:b], (0, a), t.shape) for a, b in [(0, 9_000), (9_000, 20_000)]]
    assert fp.combine(parts) == whole
    rows = [fp.chunk_fingerprint(t[a:b], (a, 0), t.shape) for a, b in [(0, 5), (5, 12)]]
    assert fp.combine(rows) == whole


def test_zero_element_and_scalar_tensors() -> None:
    empty = torch.empty(0, 5)
    f = fp.tensor_fingerprint(empty)
    assert f.value == "0" * 32 and f.shape == (0, 5) and f.elements == 0 and f.complete
    scalar = torch.tensor(3.5)
    f = fp.tensor_fingerprint(scalar)
    assert f.shape == () and f.elements == 1 and f.value == ref_fingerprint(scalar)
    assert f.value != fp.tensor_fingerprint(torch.tensor(3.25)).value
    assert f.value == fp.tensor_fingerprint(torch.tensor([3.5])).value  # same element, same index
    assert fp.chunk_fingerprint(scalar, (), ()) == f


def test_value_is_32_hex_digits() -> None:
    f = fp.tensor_fingerprint(torch.randn(10))
    assert len(f.value) == 32 and int(f.value, 16) >= 0
    assert f.lanes == (int(f.value[:16], 16), int(f.value[16:], 16))
    assert fp.TensorFingerprint.from_dict(json.loads(json.dumps(f.to_dict()))) == f


def test_every_dtype_torch_saves_is_supported() -> None:
    names = {str(d).removeprefix("torch.") for d in ref.SUPPORTED_DTYPES}
    expected = {
        "float64", "float32", "float16", "bfloat16", "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
    }  # fmt: skip
    assert expected <= names
    for name in ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]:
        if hasattr(torch, name):
            assert name in names
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert "float4_e2m1fn_x2" in names


@pytest.mark.filterwarnings("ignore:.*quantiz.*:UserWarning")
def test_unsupported_dtype_is_a_usage_error() -> None:
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(UsageError):
        fp.tensor_fingerprint(q)
    with pytest.raises(UsageError):
        fp.chunk_fingerprint(q, (0,), (4,))


def test_requires_grad_and_non_contiguous_inputs() -> None:
    base = torch.randn(6, 8)
    t = base.clone().requires_grad_(True)
    assert fp.tensor_fingerprint(t) == fp.tensor_fingerprint(base)
    nc = base.t()
    assert not nc.is_contiguous()
    assert fp.tensor_fingerprint(nc) == fp.tensor_fingerprint(nc.contiguous())


# --------------------------------------------------------------------------------- sharding invariance


@settings(max_examples=80, deadline=None)
@given(dtype=dtypes, shape=shapes.filter(lambda s: len(s) >= 1), seed=st.integers(0, 2**32), data=st.data())
def test_any_chunking_combines_to_the_whole(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int, data: st.DataObject
) -> None:
    t = make_tensor(dtype, shape, seed)
    boxes = data.draw(chunkings(shape))
    whole = fp.tensor_fingerprint(t)
    with small_blocks():
        parts = [fp.chunk_fingerprint(t[sl], off, shape) for sl, off in boxes]
    order = data.draw(st.permutations(range(len(parts))))
    assert fp.combine([parts[i] for i in order]) == whole


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), split=st.data(), seed=st.integers(0, 2**32))
def test_chunkings_of_long_rows_and_short_runs(rows: int, cols: int, split: st.DataObject, seed: int) -> None:
    """Row shards (one long run) and column shards (many short runs) at realistic block sizes."""
    t = make_tensor(torch.bfloat16, (rows * 50, cols * 50), seed)
    whole = fp.tensor_fingerprint(t)
    r = split.draw(st.integers(0, t.shape[0]))
    c = split.draw(st.integers(0, t.shape[1]))
    by_rows = [fp.chunk_fingerprint(t[:r], (0, 0), t.shape), fp.chunk_fingerprint(t[r:], (r, 0), t.shape)]
    by_cols = [fp.chunk_fingerprint(t[:, :c], (0, 0), t.shape), fp.chunk_fingerprint(t[:, c:], (0, c), t.shape)]
    assert fp.combine(by_rows) == whole
    assert fp.combine(by_cols) == whole


def test_chunk_geometry_validation() -> None:
    t = torch.zeros(2, 3)
    with pytest.raises(UsageError):
        fp.chunk_fingerprint(t, (0,), (4, 3))
    with pytest.raises(UsageError):
        fp.chunk_fingerprint(t, (3, 0), (4, 3))  # sticks out of the global shape
    with pytest.raises(UsageError):
        fp.chunk_fingerprint(t, (0, -1), (4, 3))


def test_combine_refuses_different_tensors() -> None:
    a = fp.chunk_fingerprint(torch.zeros(2, 3), (0, 0), (4, 3))
    b = fp.chunk_fingerprint(torch.zeros(2, 3, dtype=torch.float64), (2, 0), (4, 3))
    c = fp.chunk_fingerprint(torch.zeros(2, 3), (2, 0), (5, 3))
    with pytest.raises(UsageError):
        fp.combine([a, b])
    with pytest.raises(UsageError):
        fp.combine([a, c])
    with pytest.raises(UsageError):
        fp.combine([])
    partial = fp.combine([a])
    assert not partial.complete and partial.elements == 6


def test_chunk_fingerprint_depends_on_offsets() -> None:
    t = torch.randn(2, 3)
    assert fp.chunk_fingerprint(t, (0, 0), (4, 3)) != fp.chunk_fingerprint(t, (2, 0), (4, 3))


# ------------------------------------------------------------------------------ sensitivity to changes


@settings(max_examples=100, deadline=None)
@given(dtype=dtypes, shape=shapes, seed=st.integers(0, 2**32), data=st.data())
def test_single_bit_flip_changes_fingerprint(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int, data: st.DataObject
) -> None:
    t = make_tensor(dtype, shape, seed)
    assume(t.numel() > 0)
    flipped = t.clone()
    bits = bits_of(flipped).reshape(-1)
    i = data.draw(st.integers(0, bits.numel() - 1))
    width = 1 if dtype == torch.bool else bits.element_size() * 8
    bit = data.draw(st.integers(0, width - 1))
    full = bits.element_size() * 8
    new = (int(bits[i]) & ((1 << full) - 1)) ^ (1 << bit)
    if new >= 1 << (full - 1):  # back to the signed range of the integer view
        new -= 1 << full
    bits[i] = new
    if t.is_complex():
        flipped = torch.view_as_complex(bits.view(torch.view_as_real(t).dtype).reshape(*shape, 2))
    else:
        flipped = bits.view(dtype).reshape(shape)
    assert fp.tensor_fingerprint(flipped).value != fp.tensor_fingerprint(t).value


@settings(max_examples=100, deadline=None)
@given(dtype=dtypes, shape=shapes, seed=st.integers(0, 2**32), data=st.data())
def test_swapping_unequal_elements_changes_fingerprint(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int, data: st.DataObject
) -> None:
    t = make_tensor(dtype, shape, seed)
    words = bits_of(t).reshape(-1)
    assume(words.numel() >= 2)
    i = data.draw(st.integers(0, words.numel() - 1))
    j = data.draw(st.integers(0, words.numel() - 1))
    assume(int(words[i]) != int(words[j]))
    swapped = words.clone()
    swapped[i], swapped[j] = words[j], words[i]
    other = _from_words(swapped, t)
    assert fp.tensor_fingerprint(other).value != fp.tensor_fingerprint(t).value


def _from_words(words: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.is_complex():
        real = torch.view_as_real(like)
        return torch.view_as_complex(words.view(real.dtype).reshape(real.shape))
    return words.view(like.dtype).reshape(like.shape)


@settings(max_examples=100, deadline=None)
@given(dtype=dtypes, shape=shapes, seed=st.integers(0, 2**32), data=st.data())
def test_duplicating_a_value_changes_fingerprint(
    dtype: torch.dtype, shape: tuple[int, ...], seed: int, data: st.DataObject
) -> None:
    t = make_tensor(dtype, shape, seed)
    words = bits_of(t).reshape(-1)
    assume(words.numel() >= 2)
    i = data.draw(st.integers(0, words.numel() - 1))
    j = data.draw(st.integers(0, words.numel() - 1))
    assume(int(words[i]) != int(words[j]))
    dup = words.clone()
    dup[j] = words[i]
    assert fp.tensor_fingerprint(_from_words(dup, t)).value != fp.tensor_fingerprint(t).value


@given(a=st.integers(-(2**31), 2**31 - 1), b=st.integers(-(2**31), 2**31 - 1), n=st.integers(1, 5))
def test_duplicates_do_not_cancel(a: int, b: int, n: int) -> None:
    """XOR-style hashes give [a, a] == [b, b]; a sum over index-mixed elements does not."""
    assume(a != b)
    ta = torch.full((2 * n,), a, dtype=torch.int32)
    tb = torch.full((2 * n,), b, dtype=torch.int32)
    assert fp.tensor_fingerprint(ta).value != fp.tensor_fingerprint(tb).value
    assert fp.tensor_fingerprint(ta).value != fp.tensor_fingerprint(torch.zeros(2 * n, dtype=torch.int32)).value


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**32))
def test_permutations_change_fingerprint(shape: tuple[int, ...], seed: int) -> None:
    t = make_tensor(torch.float32, shape, seed).reshape(-1)
    assume(t.numel() >= 2 and len(set(bits_of(t).tolist())) > 1)
    perm = torch.randperm(t.numel(), generator=torch.Generator().manual_seed(seed))
    assume(not torch.equal(bits_of(t[perm]), bits_of(t)))
    assert fp.tensor_fingerprint(t[perm]).value != fp.tensor_fingerprint(t).value


EQUAL_VALUE_PAIRS = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float32, torch.float64),
    (torch.int32, torch.int64),
    (torch.int8, torch.int16),
    (torch.int8, torch.uint8),
    (torch.float32, torch.int32),
    (torch.bool, torch.uint8),
    (torch.bool, torch.int8),
    (torch.complex64, torch.complex128),
    (torch.float16, torch.bfloat16),
]


@pytest.mark.parametrize(("a", "b"), EQUAL_VALUE_PAIRS)
@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 50), seed=st.integers(0, 2**32))
def test_dtype_change_with_equal_values_changes_fingerprint(a: torch.dtype, b: torch.dtype, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    small = torch.randint(0, 2, (n,), generator=gen)  # 0/1: exactly representable in every dtype
    ta, tb = small.to(a), small.to(b)
    assert torch.equal(ta.to(torch.complex128), tb.to(torch.complex128))
    fa, fb = fp.tensor_fingerprint(ta), fp.tensor_fingerprint(tb)
    assert fa.dtype != fb.dtype
    assert fa.value != fb.value


@pytest.mark.parametrize("dtype", FLOAT8)
def test_same_bits_other_float8_dtype_changes_value(dtype: torch.dtype) -> None:
    raw = torch.arange(64, dtype=torch.uint8)
    others = [d for d in FLOAT8 if d != dtype]
    values = {fp.tensor_fingerprint(raw.view(d)).value for d in [dtype, *others]}
    assert len(values) == 1 + len(others)


# ---------------------------------------------------------------------------- every path, one definition


def ref_chunk(whole: torch.Tensor, box: tuple[slice, ...]) -> tuple[int, int]:
    """Reference lanes of the chunk ``whole[box]`` at its place in ``whole``, element by element."""
    name = str(whole.dtype).removeprefix("torch.")
    if whole.is_complex():
        whole, box = torch.view_as_real(whole), (*box, slice(None))
    index = torch.arange(whole.numel()).reshape(whole.shape)[box].reshape(-1).tolist()
    words = whole.contiguous().view(INT_VIEW[whole.element_size()])[box].reshape(-1).tolist()
    lanes = [0, 0]
    for g, bits in zip(index, words, strict=True):
        for lane in (0, 1):
            lanes[lane] += spec.mix((bits & MASK) ^ ((g * K + ref_seed(name, lane)) & MASK), spec.LANES[lane])
    return lanes[0] & MASK, lanes[1] & MASK


def box_all(t: torch.Tensor) -> tuple[slice, ...]:
    return tuple(slice(None) for _ in t.shape)


@contextlib.contextmanager
def small_host_blocks(block: int = 8) -> Iterator[None]:
    saved = kern.HOST_BLOCK
    kern.HOST_BLOCK = block
    try:
        yield
    finally:
        kern.HOST_BLOCK = saved


@settings(max_examples=80, deadline=None)
@given(dtype=dtypes, shape=shapes, seed=st.integers(0, 2**32),
       layout=st.sampled_from(["as is", "transposed", "every other"]), data=st.data())
def test_every_path_computes_the_reference(dtype: torch.dtype, shape: tuple[int, ...], seed: int, layout: str,
                                           data: st.DataObject) -> None:
    """Each implementation of the fingerprint gives the reference's integers (:func:`ref_chunk`, the one
    definition of the mix element by element), over every dtype, shapes of odd lengths and no elements, chunks at
    offsets and non-contiguous views: numpy's one-shot formula and host path, eager torch, the many-tensor path,
    the adoption's batched numpy path, and the public entry under each CPU backend. (The compiled kernel: below;
    the Triton kernel: tests/processes/test_fingerprint_triton.py and, on a GPU, tests/gpu/test_cuda.py.)"""
    from ckptverify.checks.adoption import _BATCHED_DTYPES, _whole_lanes

    whole = make_tensor(dtype, shape, seed)
    if layout == "transposed" and whole.dim() >= 2:
        whole = whole.transpose(0, -1)
    elif layout == "every other" and whole.dim() >= 1:
        whole = make_tensor(dtype, (*shape[:-1], 2 * shape[-1]), seed)[..., ::2]
    gshape = tuple(whole.shape)
    box, offsets = data.draw(st.sampled_from(data.draw(chunkings(gshape)))) if gshape else ((), ())
    part = whole[box]
    want = ref_chunk(whole, box)
    name = ref.dtype_name(dtype)
    seeds = (spec.dtype_seed(name, 0), spec.dtype_seed(name, 1))
    for name_of_backend in ("auto", "numpy", "compiled"):  # (no chunk here is large enough to compile for)
        with backend(name_of_backend):
            assert fp.chunk_fingerprint(part, offsets, gshape).lanes == want, name_of_backend
    real, real_offsets, real_shape = ref.as_real(part, offsets, gshape)
    flat = ref.flat_bits(real)
    geometry = ref.chunk_geometry(real.shape, real_offsets, real_shape)
    if flat.numel():
        assert kern._small_lanes(flat, geometry, seeds) == want
        with small_host_blocks():
            assert kern.host_lanes(flat, geometry, seeds, threads=2) == want
        with small_blocks():
            assert ref.eager_lanes(flat, geometry, seeds) == want
    whole_lanes = ref_chunk(whole, box_all(whole))
    with small_blocks():  # several tensors to a block, and a tensor over several
        many = kern.lanes_many([whole, part, whole]).tolist()
    assert [(a & MASK, b & MASK) for a, b in many] == [whole_lanes, ref_chunk(part, box_all(part)), whole_lanes]
    if name in _BATCHED_DTYPES and whole.numel():
        bits = ref.flat_bits(whole).numpy().tobytes()
        lanes = _whole_lanes(bits * 2, whole.element_size(), [whole.numel()] * 2, name)
        assert [(int(a), int(b)) for a, b in zip(*lanes, strict=True)] == [whole_lanes] * 2


# ------------------------------------------------------------------------------ the compiled kernel

COMPILE_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.int16, torch.bool]


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(COMPILE_DTYPES),
    rows=st.integers(1, 9),
    cols=st.integers(70, 200),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
def test_compiled_path_computes_the_reference(
    dtype: torch.dtype, rows: int, cols: int, seed: int, data: st.DataObject
) -> None:
    """Full blocks go through ``torch.compile``; everything else through the host path: the reference's values."""
    t = make_tensor(dtype, (rows, cols), seed)
    c = data.draw(st.integers(0, cols))
    with small_blocks(eager=32, row=16, compiled=64):
        with backend("numpy"):
            numpy_whole = fp.tensor_fingerprint(t)
        with backend("compiled"):
            compiled_whole = fp.tensor_fingerprint(t)
            parts = [fp.chunk_fingerprint(t[:, :c], (0, 0), t.shape), fp.chunk_fingerprint(t[:, c:], (0, c), t.shape)]
            flat = fp.chunk_fingerprint(t.reshape(-1)[17:], (17,), (t.numel(),))
    assert compiled_whole == numpy_whole
    assert compiled_whole.value == ref_fingerprint(t)
    assert fp.combine(parts) == numpy_whole
    assert flat.value == _ref_suffix(t.reshape(-1), 17)
    # 8- and 16-bit bits are widened to int32 as they are staged: the int32 kernel serves them.
    assert kern._verified.get(kern.cpu_kernel_dtype(t.dtype)) is True, "the compiled kernel was not used"


def _ref_suffix(flat: torch.Tensor, start: int) -> str:
    """Reference lanes of ``flat[start:]`` at its global indices."""
    whole = fp.TensorFingerprint(ref_fingerprint(flat), "x", ()).lanes
    head = fp.TensorFingerprint(ref_fingerprint(flat[:start]), "x", ()).lanes if start else (0, 0)
    return f"{(whole[0] - head[0]) & MASK:016x}{(whole[1] - head[1]) & MASK:016x}"


def test_backend_selection() -> None:
    for unknown in ("fast", "eager", "triton"):  # eager torch and Triton serve other devices: no CPU backend
        with pytest.raises(UsageError):
            fp.set_fingerprint_backend(unknown)
    with backend("compiled"):
        assert fp.get_fingerprint_backend() == "compiled"
        assert kern._wants_compiled(torch.device("cpu"), 1 << 40) != kern._compile_failed
        assert not kern._wants_compiled(torch.device("meta"), 1 << 40)
    with backend("numpy"):
        assert fp.get_fingerprint_backend() == "numpy"
        assert not kern._wants_compiled(torch.device("cpu"), 1 << 40)
    with backend("auto"):
        saved = kern._host_bytes
        try:
            kern._host_bytes = 0
            assert not kern._wants_compiled(torch.device("cpu"), 1 << 30)
            kern._host_bytes = kern.AUTO_COMPILE_AFTER_BYTES
            assert kern._wants_compiled(torch.device("cpu"), 1 << 30) != kern._compile_failed
            assert not kern._wants_compiled(torch.device("meta"), 1 << 30)
        finally:
            kern._host_bytes = saved


def test_under_a_dispatch_mode_the_compiled_kernel_is_not_tried_and_stays_on() -> None:
    """torch.compile does not run under a Python dispatch mode (a profiler, a memory counter): the host path
    takes the chunk, and the kernel is not turned off for the rest of the process."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    # One compiled block's worth (the least the kernel takes): every op of the host path runs through the mode.
    t = make_tensor(torch.float32, (1, kern.COMPILED_BLOCK), 7)
    failed = kern._compile_failed
    with backend("compiled"):
        assert kern._wants_compiled(t.device, t.numel(), torch.int32) != kern._compile_failed
        with Passthrough():
            assert not kern._wants_compiled(t.device, t.numel(), torch.int32)
            assert kern.cpu_block_lanes(t, (0, 0), t.shape, "float32", None) is None
            inside = fp.tensor_fingerprint(t)
    assert kern._compile_failed == failed
    with backend("numpy"):
        assert inside == fp.tensor_fingerprint(t)


# ------------------------------------------------------------------------------------------- DTensor


def _dtensor_worker(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = make_tensor(torch.float32, (7, 5), 1234)  # 7 rows over 2 ranks: uneven shards
    results = {}
    for label, placement in [("shard0", Shard(0)), ("shard1", Shard(1)), ("replicate", Replicate())]:
        d = distribute_tensor(full, mesh, [placement])
        results[label] = fp.tensor_fingerprint(d).to_dict()
    # Partial: each rank holds an addend; the tensor's value is their sum.
    ints = torch.arange(35, dtype=torch.float32).reshape(7, 5)
    local = ints if rank == 0 else torch.zeros_like(ints)
    partial = DTensor.from_local(local, mesh, [Partial()])
    results["partial"] = fp.tensor_fingerprint(partial).to_dict()
    bf = make_tensor(torch.bfloat16, (3, 4, 9), 99)
    results["bf16_shard2"] = fp.tensor_fingerprint(distribute_tensor(bf, mesh, [Shard(2)])).to_dict()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
def test_dtensor_fingerprint_two_ranks(tmp_path: Path) -> None:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    spawn_ranks(_dtensor_worker, 2, str(tmp_path))
    full = fp.tensor_fingerprint(make_tensor(torch.float32, (7, 5), 1234))
    expected = {
        "shard0": full,
        "shard1": full,
        "replicate": full,
        "partial": fp.tensor_fingerprint(torch.arange(35, dtype=torch.float32).reshape(7, 5)),
        "bf16_shard2": fp.tensor_fingerprint(make_tensor(torch.bfloat16, (3, 4, 9), 99)),
    }
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for label, want in expected.items():
            assert fp.TensorFingerprint.from_dict(got[label]) == want, (rank, label)


def test_importing_the_package_imports_no_torch() -> None:
    """Byte digests stay cheap to import: the package and its spec load without torch (a fresh interpreter)."""
    code = ("import sys\nimport ckptverify.fingerprint\nfrom ckptverify.fingerprint import spec, digest_bytes\n"
            "assert digest_bytes(b'x')\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_fingerprint_modules_depend_one_way() -> None:
    """spec <- eager <- triton_kernel <- kernels <- logical <- the package: no module imports one after it."""
    import ast
    import pathlib

    order = ["spec", "digest", "eager", "triton_kernel", "kernels", "logical", "__init__"]
    folder = pathlib.Path(fp.__file__).parent
    for position, name in enumerate(order):
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "ckptverify.fingerprint":
                # A name that is not a module of the package comes from the package itself.
                imported.update(a.name if a.name in order else "__init__" for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptverify.fingerprint."):
                imported.add(node.module.rsplit(".", 1)[1])
        later = imported & set(order[position:])
        assert not later, f"fingerprint/{name}.py imports {sorted(later)}, which depend on it"
