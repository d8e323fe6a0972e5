"""The op log on CUDA: fingerprints computed on the device during the step and read back with the row (the CPU
version, with host tensors sent the device way, is in tests/processes/test_trace_ops.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_op_log_on_cuda(tmp_path):
    from test_trace_ops import test_op_log_on_the_device_path

    test_op_log_on_the_device_path(tmp_path, device="cuda")
