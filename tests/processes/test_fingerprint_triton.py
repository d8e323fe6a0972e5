"""The Triton fingerprint kernel (used for CUDA tensors) computes the eager path's integers.

Triton's interpreter runs the same kernel on CPU tensors when ``TRITON_INTERPRET=1`` is set before Triton is
imported, so these tests run in a fresh interpreter. On a GPU, tests/gpu/test_cuda.py holds the compiled kernel to
the CPU fingerprints.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import torch
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint import eager as ref
    from ckptverify.fingerprint import triton_kernel as tri

    def eager(t, offsets, gshape, name):
        geometry = kern.chunk_geometry(t.shape, offsets, gshape)
        return ref.eager_lanes(ref.flat_bits(t), geometry, (kern.dtype_seed(name, 0), kern.dtype_seed(name, 1)))

    gen = torch.Generator().manual_seed(1)
    cases = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.int64, torch.bool, torch.float64):
        base = torch.randn(40, 300, generator=gen) * 100
        t = base > 0 if dtype == torch.bool else base.to(dtype)
        name = ref.dtype_name(dtype)
        seeds = (kern.dtype_seed(name, 0), kern.dtype_seed(name, 1))
        flat_view = kern._INT_VIEW_BY_SIZE[t.element_size()]
        for part, offsets in ((t, [0, 0]), (t[7:29], [7, 0]), (t[3:30, 100:250], [3, 100]),
                              (t.reshape(-1)[5:9000], [5])):
            gshape = [40, 300] if len(offsets) == 2 else [12000]
            part = part.contiguous()
            geometry = kern.chunk_geometry(part.shape, offsets, gshape)
            flat = part.reshape(-1).view(flat_view)
            got = tri.lanes_of(flat, geometry, seeds)
            want = eager(part, offsets, gshape, name)
            assert got == want, (dtype, offsets, got, want)
            cases += 1
    # The guarded entry: checks itself against eager first, then answers; short runs are left to eager.
    t = torch.randn(5000, generator=gen)
    geometry = kern.chunk_geometry([5000], [0], [5000])
    seeds = (kern.dtype_seed("float32", 0), kern.dtype_seed("float32", 1))
    assert tri.lanes(t.view(torch.int32), geometry, seeds) == eager(t, [0], [5000], "float32")
    assert tri._verified[("cpu", torch.int32)] is True
    short = kern.chunk_geometry([100, 8], [0, 8], [100, 64])
    assert tri.lanes(torch.zeros(800, dtype=torch.int32), short, seeds) is None
    # A flipped bit changes the kernel's answer.
    flipped = t.clone()
    flipped.view(torch.int32)[4321] ^= 1 << 30
    assert tri.lanes(flipped.view(torch.int32), geometry, seeds) != tri.lanes(t.view(torch.int32), geometry, seeds)
    print("cases", cases)
''')


def test_triton_kernel_matches_the_eager_path_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "cases 24" in done.stdout


MANY = textwrap.dedent('''
    import torch
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint import triton_kernel as tri

    assert tri._self_check_many(torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    cases = 0
    for sizes in ((1,), (tri.BLOCK,), (tri.BLOCK + 1, 3, 0, 2 * tri.BLOCK), (70 * 30, 5000, 0, 3, 1)):
        dtypes = (torch.float32, torch.float16, torch.int32, torch.float64, torch.int8)
        tensors = [(torch.randn(n, generator=gen) * 50).to(dtypes[i % len(dtypes)]) for i, n in enumerate(sizes)]
        want = kern.lanes_many_eager(tensors).tolist()
        assert tri.lanes_many(tensors).tolist() == want, sizes
        # A flipped bit changes that tensor's lanes and no other's.
        for i, t in enumerate(tensors):
            if t.numel():
                flipped = [x.clone() for x in tensors]
                flipped[i].view(torch.uint8)[-1] ^= 0x10
                got = tri.lanes_many(flipped).tolist()
                assert [j for j in range(len(got)) if got[j] != want[j]] == [i]
                cases += 1
    assert tri._many_verified["cpu"] is True
    print("cases", cases)
''')


def test_triton_many_tensor_kernel_matches_the_eager_path_under_the_interpreter() -> None:
    """The kernel a trace uses for a whole category on a GPU: every element width, tensors shorter and longer
    than a block, empty ones, one flipped bit at a time."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", MANY], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "cases 9" in done.stdout
