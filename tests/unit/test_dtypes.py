"""Every dtype torch can save, in every layout the factory builds: clean -> verify passes; save -> load works.

uint16/uint32/uint64, complex32, the float8 kinds and float4 are written by ``torch.save`` as an
``UntypedStorage`` whose size counts bytes, not elements.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.ckpt_factory import safetensors_supported
from helpers.multiproc import spawn_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter

import ckptverify
from ckptverify.audit.verify import verify_checkpoint

#: Every dtype DCP can save with this torch (uint1..7, int1..7, bits* and quantized dtypes it cannot).
DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
          "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "complex128", "complex64", "complex32",
          "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool")
AVAILABLE = tuple(n for n in DTYPES if isinstance(getattr(torch, n, None), torch.dtype))


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bits of dtype ``name`` (bool: 0/1 only, as torch requires)."""
    dtype = getattr(torch, name)
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.Size(shape).numel())
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _writer_kwargs(layout: str) -> dict[str, Any]:
    if layout == "threads":
        return {"thread_count": 3}
    if layout == "per_item":
        return {"single_file_per_rank": False}
    if layout == "safetensors":
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        return {"serialization_format": SerializationFormat.SAFETENSORS}
    return {}


def _safetensors_can_write(name: str) -> bool:
    try:
        from safetensors.torch import save
    except ImportError:  # pragma: no cover
        return False
    try:
        save({"a": random_tensor(name, (3,), 0), "b": random_tensor(name, (1,), 0)})
    except Exception:  # the library raises its own error types
        return False
    return True


def layout_dtypes(layout: str) -> tuple[str, ...]:
    """The dtypes a layout can hold: the safetensors library writes fewer than torch.save."""
    if layout == "safetensors":
        # float4_e2m1fn_x2: the library treats it as sub-byte and refuses DCP's slices of it.
        return tuple(n for n in AVAILABLE if n != "float4_e2m1fn_x2" and _safetensors_can_write(n))
    return AVAILABLE


SINGLE_LAYOUTS = ["single", "threads", "per_item"] + (["safetensors"] if safetensors_supported() else [])


@pytest.mark.parametrize("layout", SINGLE_LAYOUTS)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), seed=st.integers(0, 2**16))
def test_every_dtype_verifies_clean(tmp_path_factory, layout, shape, seed):
    path = tmp_path_factory.mktemp("dtypes")
    names = layout_dtypes(layout)
    state = {name: random_tensor(name, shape, seed + i) for i, name in enumerate(names)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(str(path), **_writer_kwargs(layout)))
    report = verify_checkpoint(path)
    assert report.exit_code == 0, [(f.check, f.message) for f in report.errors]
    assert report.stats["tensors"] == len(names)


def _two_rank_worker(rank: int, world: int, jobs: list[tuple[str, bool]]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    # Each rank holds its rows of the same global tensor (built locally: gloo cannot scatter every dtype).
    state = {name: DTensor.from_local(random_tensor(name, (6, 3), i).chunk(world)[rank].clone(), mesh,
                                      [Shard(0)], run_check=False)
             for i, name in enumerate(AVAILABLE)}
    for path, use_collectives in jobs:
        dcp.save(state, checkpoint_id=path, use_collectives=use_collectives)
        dist.barrier()


def test_every_dtype_verifies_clean_sharded_on_two_ranks(tmp_path):
    jobs = [(str(tmp_path / "fsdp2"), True), (str(tmp_path / "nocoll"), False)]
    spawn_ranks(_two_rank_worker, 2, jobs)
    for path, _ in jobs:
        report = verify_checkpoint(path)
        assert report.exit_code == 0, (path, [(f.check, f.message) for f in report.errors])
        assert report.stats["tensors"] == len(AVAILABLE)
    assert os.path.exists(tmp_path / "nocoll" / "__1.metadata")


class _Holder(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        for i, name in enumerate(AVAILABLE):
            self.register_buffer(f"b_{name}", random_tensor(name, (3, 4), seed + i))


def test_load_restores_what_save_wrote_for_every_dtype(tmp_path):
    saved = _Holder(1)
    ckptverify.save(ckptverify.TrainState(model=saved), tmp_path / "ckpt")
    assert verify_checkpoint(tmp_path / "ckpt").exit_code == 0
    fresh = _Holder(99)
    report = ckptverify.load(ckptverify.TrainState(model=fresh), tmp_path / "ckpt")
    assert report.errors == []
    for name in AVAILABLE:
        assert same_bits(getattr(fresh, f"b_{name}"), getattr(saved, f"b_{name}")), name


def test_untyped_storage_size_is_counted_in_bytes():
    import io
    import zipfile

    from ckptverify.safeparse.torchsave import item_header

    for name in ("uint16", "uint64", "complex32", "float8_e5m2"):
        buf = io.BytesIO()
        torch.save(random_tensor(name, (5,), 0), buf)
        z = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
        header = item_header(z.read(next(n for n in z.namelist() if n.endswith("data.pkl"))))
        assert header.dtype == name and header.storage_numel == 5
