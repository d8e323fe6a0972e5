"""What a hardware-fault report must name about each rank (host, device, software), so a verdict can say "host
gpu-node-17, device 3 (NVIDIA H200, GPU-6f1e...)"."""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

__all__ = ["host_info"]


def host_info() -> dict[str, Any]:
    """Host name, the device this rank computes on (type, index, name, CUDA UUID), torch/CUDA/Python versions and the
    switches that decide whether a replay can reproduce a step bit for bit."""
    import torch

    device: dict[str, Any] = {"type": "cpu", "index": None, "name": platform.processor() or platform.machine(),
                              "uuid": None}
    determinism: dict[str, Any] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "num_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        device = {"type": "cuda", "index": index, "name": props.name, "uuid": str(uuid) if uuid is not None else None,
                  "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
        determinism["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
        determinism["tf32_cudnn"] = bool(torch.backends.cudnn.allow_tf32)
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "device": device, "torch": str(torch.__version__),
            "cuda": torch.version.cuda, "python": platform.python_version(), "determinism": determinism}
