#!/usr/bin/env python
"""The fingerprint's GPU checks (the Python parts of scripts/gpu_check.sh and scripts/gpu_check_multi.sh).

Each part prints what it checked and exits non-zero on the first disagreement:

* ``parity``: device fingerprints equal the CPU ones for every dtype and layout: 0-dim, empty, short and long,
  transposed, a chunk at global offsets, an unaligned storage offset, global indices past 2**32 (and, on a GPU
  with the memory, a tensor of more than 2**32 elements), conjugated complex, under a non-default stream; on each
  device path (``fused``: what ``tensor_fingerprint`` takes, the Triton kernel on a GPU; ``eager``: eager torch).
* ``many``: the many-tensor fingerprint (what a trace takes every step) equals the eager one, and its peak of
  extra device memory stays near ``MANY_GROUP_BYTES`` for a list far larger than that.
* ``throughput``: GB/s of ``tensor_fingerprint`` against ``clone``, per path.
* ``devices`` (two or more GPUs): a tensor on each GPU but the first, fingerprinted in a fresh thread (whose
  current device is ``cuda:0``), equals its CPU fingerprint, and no CUDA context is opened on GPU 0.
* ``save`` (two or more GPUs): ``ckptverify.save`` of a state dict on ``cuda:1`` (fingerprints taken by the writer's
  own thread) records the CPU fingerprints, and opens no context on GPU 0.
* ``dtensor``: DTensors sharded (``Shard``, ``_StridedShard``) over an NCCL mesh of two GPUs, and one whose local
  shard is offloaded to the CPU, fingerprint as their full tensors, without a gather.

``--dry-run`` runs the same code on the CPU with tiny sizes (device ``cpu``, Gloo for ``dtensor``), so the CPU
test suite proves the script works (tests/processes/test_gpu_scripts.py).

    python scripts/gpu_parity.py --part parity [--dry-run]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from typing import Any

import torch

# The test helpers' rank teardown (tests/helpers/multiproc.py), as the other multi-rank scripts use them.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from helpers.multiproc import exit_without_teardown

from ckptverify import fingerprint as fp
from ckptverify.fingerprint import kernels as kern
from ckptverify.fingerprint import triton_kernel as tri
from ckptverify.fingerprint.eager import SUPPORTED_DTYPES, dtype_name, lanes_many_eager

PARTS = ("parity", "many", "throughput", "devices", "save", "dtensor")


def _say(*args: Any) -> None:
    print(*args, flush=True)


def _values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Pseudo-random values of ``dtype`` (every bit pattern for the integer and packed formats)."""
    gen = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype.is_complex:  # values, not bit patterns: a conjugation of a NaN need not keep its payload
        return torch.randn(shape, dtype=torch.complex128, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    info = torch.iinfo(width)
    bits = torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), (n,), dtype=torch.int64, generator=gen)
    return bits.to(width).view(dtype).reshape(shape)


#: The device paths: what ``tensor_fingerprint`` takes (on a GPU the Triton kernel), and eager torch (what a GPU
#: takes where Triton is missing or failed its check).
PATHS = ("fused", "eager")


def _fingerprint(path: str, t: torch.Tensor, offsets: list[int] | None = None,
                 gshape: list[int] | None = None) -> Any:
    """``t``'s fingerprint (a chunk's at ``offsets`` in ``gshape``) through ``path``, on its device."""
    if path == "fused":
        return fp.tensor_fingerprint(t) if offsets is None else fp.chunk_fingerprint(t, offsets, gshape)
    gshape = list(t.shape) if gshape is None else gshape
    name = dtype_name(t.dtype)
    lanes = kern.eager_fingerprint_lanes(t, offsets or [0] * len(gshape), gshape, name)
    return fp.TensorFingerprint.from_lanes(lanes, name, gshape, t.numel())


def _cpu_fp(t: torch.Tensor, offsets: list[int] | None = None, gshape: list[int] | None = None) -> Any:
    t = t.cpu()
    return fp.tensor_fingerprint(t) if offsets is None else fp.chunk_fingerprint(t, offsets, gshape)


def part_parity(dev: torch.device, dry: bool) -> int:
    long = 1 << 10 if dry else (1 << 22) + 7
    cases = 0
    stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    for dtype in SUPPORTED_DTYPES:
        for path in PATHS:
            layouts: list[tuple[str, torch.Tensor, list[int] | None, list[int] | None]] = []
            base = _values(dtype, (48, 80), 7)
            layouts += [
                ("0-dim", _values(dtype, (), 1), None, None),
                ("empty", _values(dtype, (0, 5), 2), None, None),
                ("one", _values(dtype, (1,), 3), None, None),
                ("long", _values(dtype, (long,), 4), None, None),
                ("transposed", base.t(), None, None),
                ("chunk", base[8:40, 16:72], [8, 16], [48, 80]),
                ("column-split", base[:, 3:11], [0, 3], [48, 80]),
                # Global indices past 2**32 (a chunk far into a huge tensor): only the indices are large.
                ("past-2^32", base[:4], [1 << 27, 0], [(1 << 27) + 4, 80]),
            ]
            flat = _values(dtype, (4099,), 5)
            layouts.append(("unaligned-offset", flat[1:], None, None))  # storage offset 1: not 16-byte aligned
            if dtype.is_complex:
                layouts.append(("conjugated", base.conj(), None, None))
            for label, t, offsets, gshape in layouts:
                want = _cpu_fp(t, offsets, gshape)
                # The same view of the same values, made on the device (``.to`` of a view copies it compactly).
                if label == "transposed":
                    on = base.to(dev).t()
                elif label == "unaligned-offset":
                    on = flat.to(dev)[1:]
                elif label == "conjugated":
                    on = base.to(dev).conj()
                else:
                    on = t.to(dev)
                got = _fingerprint(path, on, offsets, gshape)
                if got != want:
                    _say(f"MISMATCH {dtype} {path} {label}: {got} != {want}")
                    return 1
                cases += 1
            if stream is not None:
                # Under a non-default stream: the tensor written on it, fingerprinted on it.
                with torch.cuda.stream(stream):
                    on = base.to(dev)  # the copy runs on the stream
                    got = _fingerprint(path, on)
                if got != _cpu_fp(on):
                    _say(f"MISMATCH {dtype} {path} non-default stream")
                    return 1
                cases += 1
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        n = (1 << 32) + 4097
        if free > 3 * n:
            big = torch.randint(-128, 127, (n,), dtype=torch.int8, device=dev)
            got = fp.tensor_fingerprint(big)
            want = fp.tensor_fingerprint(big.cpu())
            del big
            if got != want:
                _say(f"MISMATCH int8 tensor of {n} elements: {got} != {want}")
                return 1
            cases += 1
            _say(f"tensor of {n} elements (element offsets past 2**32): equal")
        else:
            _say(f"skipped the tensor of {n} elements: {free >> 30} GiB free")
    _say(f"parity: {cases} cases equal on {dev}, failed launches: {tri.failures()}")
    return 0


def part_many(dev: torch.device, dry: bool) -> int:
    count, each = (40, 100) if dry else (512, 1 << 20)  # dry: 160 kB; GPU: 2 GiB of float32 in 512 tensors
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(each + i, generator=gen).to(dev) for i in range(count)]
    tensors += [torch.randn(300, 7, generator=gen).to(dev).t(), torch.randn(11, dtype=torch.complex64).to(dev),
                torch.randn(5000, generator=gen).to(torch.bfloat16).to(dev)]
    want = [list(kern.fingerprint_lanes(t.cpu(), [0] * t.dim(), list(t.shape), dtype_name(t.dtype)))
            for t in tensors[-4:]]
    reference = lanes_many_eager(tensors).tolist()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    got = kern.lanes_many(tensors).tolist()
    if got != reference:
        _say("MISMATCH: lanes_many differs from the eager many-tensor path")
        return 1
    masked = [[v & ((1 << 64) - 1) for v in row] for row in got[-4:]]
    if masked != [[v & ((1 << 64) - 1) for v in row] for row in want]:
        _say("MISMATCH: lanes_many differs from fingerprint_lanes")
        return 1
    total = sum(t.numel() * t.element_size() for t in tensors)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) - base
        limit = 2 * tri.MANY_GROUP_BYTES + (64 << 20)
        _say(f"many: {len(tensors)} tensors, {total >> 20} MiB: peak extra {peak >> 20} MiB (limit {limit >> 20} MiB)")
        if peak > limit:
            _say("FAIL: the many-tensor fingerprint's peak memory is not bounded")
            return 1
    else:
        groups = tri._groups([t.numel() for t in tensors], [t.element_size() for t in tensors], 4096)
        biggest = max(sum(tensors[m].numel() * tensors[m].element_size() for m in g) for g in groups if len(g) > 1)
        if len(groups) < 2:
            _say("FAIL: the list went through one buffer")
            return 1
        _say(f"many: {len(tensors)} tensors, {total} bytes equal; groups of at most {biggest} bytes (bound 4096)")
        if biggest > 4096:
            return 1
    return 0


def part_throughput(dev: torch.device, dry: bool) -> int:
    n = (1 << 10) if dry else (1 << 28)  # 1 GiB of float32
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(n, device=dev).to(dtype)
        for path in PATHS:
            _fingerprint(path, t)  # warm-up (compilation, self-check)
            best = float("inf")
            for _ in range(1 if dry or path == "eager" else 3):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                start = time.perf_counter()
                _fingerprint(path, t)
                best = min(best, time.perf_counter() - start)
            _say(f"throughput {dtype} {path}: {t.numel() * t.element_size() / best / 1e9:.2f} GB/s")
    return 0


def _has_context(index: int) -> bool | None:
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return None if probe is None else bool(probe(index))


def part_devices(dev: torch.device, dry: bool) -> int:
    devices = [torch.device("cpu")] if dry else [torch.device("cuda", i) for i in range(1, torch.cuda.device_count())]
    if not devices:
        _say("devices: needs two GPUs")
        return 1
    base = _values(torch.float32, (256, 512), 11)
    want = fp.tensor_fingerprint(base)
    for path in PATHS if not dry else ("fused",):
        for d in devices:
            on = base.to(d)
            out: list[Any] = []
            # A fresh thread: its current device is cuda:0, whatever the tensor's.
            worker = threading.Thread(target=lambda o=on, found=out, p=path: found.append(_fingerprint(p, o)))
            worker.start()
            worker.join()
            many = (kern.lanes_many if path == "fused" else lanes_many_eager)([on]).tolist()[0]
            if out != [want] or [v & ((1 << 64) - 1) for v in many] != list(want.lanes):
                _say(f"MISMATCH on {d} ({path}): {out} != {want}")
                return 1
    if not dry and _has_context(0):
        _say("FAIL: a CUDA context was opened on GPU 0")
        return 1
    _say(f"devices: {len(devices)} device(s) fingerprinted in fresh threads; GPU 0 context: {_has_context(0)}")
    return 0


def part_save(dev: torch.device, dry: bool) -> int:
    import ckptverify as cv

    target = torch.device("cpu") if dry else torch.device("cuda", 1)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    n = 1 << 10 if dry else 1 << 24
    state = {"w": _values(torch.float32, (n,), 21).to(target), "b": _values(torch.bfloat16, (64, 33), 22).to(target),
             "t": _values(torch.float16, (40, 70), 23).to(target).t(), "i": torch.arange(5000, device=target)}
    want = {k: fp.tensor_fingerprint(v.cpu()).value for k, v in state.items()}
    with tempfile.TemporaryDirectory() as root:
        manifest = cv.save(state, os.path.join(root, "ckpt"), no_dist=True)
    got = {k: manifest.tensors[k].fingerprint for k in state}
    if got != want:
        _say(f"MISMATCH: the save on {target} recorded {got}, the CPU fingerprints are {want}")
        return 1
    if not dry and _has_context(0):
        _say("FAIL: the save on cuda:1 opened a CUDA context on GPU 0")
        return 1
    _say(f"save: {len(state)} tensors on {target} saved with their CPU fingerprints")
    return 0


def _dtensor_rank(rank: int, world: int, init: str, dry: bool, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    backend = "gloo" if dry else "nccl"
    kind = "cpu" if dry else "cuda"
    if not dry:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        def no_gather(self: Any, *a: Any, **k: Any) -> Any:
            raise AssertionError("a fingerprint gathered a DTensor")

        DTensor.full_tensor = no_gather
        full = _values(torch.float32, (16, 12), 31)
        want = fp.tensor_fingerprint(full)
        mesh = init_device_mesh(kind, (world,))
        results = []
        for placements in ([Shard(0)], [Shard(1)], [_StridedShard(0, split_factor=2)]):
            results.append(fp.tensor_fingerprint(distribute_tensor(full.to(kind), mesh, placements)) == want)
        # A shard offloaded to the CPU on a mesh of the GPUs (FSDP2's CPU offload): its sums travel on the GPU.
        on_mesh = distribute_tensor(full.to(kind), mesh, [Shard(0)])
        offloaded = DTensor.from_local(on_mesh.to_local().cpu(), mesh, [Shard(0)], run_check=False)
        results.append(fp.tensor_fingerprint(offloaded) == want)
        with open(os.path.join(out, f"rank{rank}"), "w") as f:
            f.write(" ".join(str(r) for r in results))
        dist.barrier()  # no rank tears down while another is still in a collective
    finally:
        dist.destroy_process_group()
    exit_without_teardown()  # DTensor's gloo threads outlive the group; the result is written


def part_dtensor(dev: torch.device, dry: bool) -> int:
    import torch.multiprocessing as mp

    world = 2
    if not dry and torch.cuda.device_count() < world:
        _say("dtensor: needs two GPUs")
        return 1
    with tempfile.TemporaryDirectory() as out:
        init = f"file://{os.path.join(out, 'store')}"
        mp.spawn(_dtensor_rank, args=(world, init, dry, out), nprocs=world, join=True)
        got = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}")) as f:
                got.append(f.read().split())
    _say(f"dtensor: {got}")
    return 0 if all(v == "True" for row in got for v in row) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, required=True)
    parser.add_argument("--dry-run", action="store_true",
                        help="run on the CPU with tiny sizes (also: CKPTVERIFY_GPU_DRY_RUN=1)")
    args = parser.parse_args(argv)
    dry = args.dry_run or os.environ.get("CKPTVERIFY_GPU_DRY_RUN") == "1"
    if not dry and not torch.cuda.is_available():
        _say("no CUDA device: run with --dry-run on the CPU")
        return 2
    # Every value comes from a seeded generator of its own: nothing here seeds (or touches) a GPU it does not use.
    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    part = {"parity": part_parity, "many": part_many, "throughput": part_throughput, "devices": part_devices,
            "save": part_save, "dtensor": part_dtensor}[args.part]
    return part(dev, dry)


if __name__ == "__main__":
    sys.exit(main())
