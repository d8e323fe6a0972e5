"""Re-running one op alone on CUDA (ckptverify.trace.kernel): a kernel with atomic accumulation named by its
mechanism, a matrix product that is deterministic alone, a custom kernel with no documented mechanism, and NVTX
site ranges. Skipped without CUDA; the CPU logic is in test_kernel.py."""

from __future__ import annotations

import os
import struct

import pytest
import torch

from ckptverify.trace import kernel
from ckptverify.trace.kernel import Capture, nvtx_site, rerun, site_name

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@torch.library.custom_op("ckptv_kernel_cuda_test::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    (u,) = struct.unpack("<I", os.urandom(4))
    return x + (u % 1000 + 1) * 1e-3


@pytest.fixture(autouse=True)
def _nondeterministic_defaults():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(before)


def test_index_add_with_colliding_indices_is_nondeterministic_by_atomics(tmp_path):
    g = torch.Generator().manual_seed(0)
    n = 1 << 22
    src = torch.randn(n, generator=g) * 1e3
    index = torch.randint(0, 4, (n,), generator=g)
    path = tmp_path / "cap.pt"
    torch.save({"op": "aten.index_add.default", "args": (torch.zeros(4), 0, index, src), "kwargs": {}}, path)
    v = rerun(path, runs=8, device="cuda")
    assert v.device.startswith("cuda")
    assert v.nondeterministic and v.mechanism == "atomics", v.sentence()
    assert "atomic accumulation" in v.sentence()


def test_mm_is_deterministic_alone_on_cuda_and_settings_are_recorded(tmp_path):
    g = torch.Generator().manual_seed(1)
    cap = Capture(op="aten.mm.default", args=(torch.randn(512, 256, generator=g), torch.randn(256, 128, generator=g)),
                  kwargs={})
    v = rerun(cap, runs=5, device="cuda")
    assert not v.nondeterministic and v.mechanism is None, v.sentence()
    assert set(v.settings) >= {"deterministic_algorithms", "cudnn_benchmark", "matmul_allow_tf32",
                               "cublas_workspace_config"}
    assert "order or topology" in v.sentence()


def test_custom_kernel_on_cuda_has_no_documented_mechanism():
    v = rerun(Capture(op="ckptv_kernel_cuda_test.noisy.default", args=(torch.ones(8),), kwargs={}), runs=4,
              device="cuda")
    assert v.nondeterministic and v.mechanism == "none"


def test_nvtx_site_pushes_and_pops_on_cuda():
    kernel.nvtx_enabled.cache_clear()
    assert kernel.nvtx_enabled()
    x = torch.ones(4, device="cuda")
    with nvtx_site(site_name((1, "forward", "fc", "aten.mm.default", 0))):
        y = x * 2
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), torch.full((4,), 2.0))
    with pytest.raises(ValueError), nvtx_site("raises"):
        raise ValueError("the range is popped all the same")
