"""What a hardware-fault report must name about each rank (host, device, software), so a verdict can say "host
gpu-node-17, device 3 (NVIDIA H200, GPU-6f1e...)"."""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

__all__ = ["determinism_settings", "device_info", "host_info"]


def device_info(device: Any = None) -> dict[str, Any]:
    """The device this rank computes on: type, index, name and (CUDA) UUID; ``{"type": "cpu", ...}`` on CPU."""
    import torch

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        return {"type": "cuda", "index": index, "name": props.name, "uuid": str(uuid) if uuid is not None else None,
                "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    return {"type": device.type, "index": device.index, "name": platform.processor() or platform.machine(),
            "uuid": None}


def determinism_settings() -> dict[str, Any]:
    """The switches that decide whether a replay can reproduce a step bit for bit."""
    import torch

    out: dict[str, Any] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "num_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        out["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
        out["tf32_cudnn"] = bool(torch.backends.cudnn.allow_tf32)
    return out


def host_info(device: Any = None) -> dict[str, Any]:
    """Host name, device, torch/CUDA versions and determinism settings of this process."""
    import torch

    return {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "device": device_info(device),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "determinism": determinism_settings(),
    }
