"""DCP checkpoints in the encodings other than plain ``torch.save`` items: the ZStandard stream transform and
the safetensors serialization (both written by ``dcp.save`` itself, one process)."""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["dcp_checkpoint", "safetensors_ckpt", "zstd_ckpt"]


def dcp_checkpoint(path: Path, seed: int = 0, **writer_kwargs) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from helpers.ckpt_factory import single_process_state_dict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(single_process_state_dict(seed), storage_writer=FileSystemWriter(str(path), **writer_kwargs))
    return path


def zstd_ckpt(path: Path, seed: int = 0) -> Path:
    pytest.importorskip("zstandard", reason="DCP's ZStandard transform needs zstandard (the test extra has it)")
    from torch.distributed.checkpoint._extension import ZStandard

    return dcp_checkpoint(path, seed, _extensions=[ZStandard()])


def safetensors_ckpt(path: Path, seed: int = 0) -> Path:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    return dcp_checkpoint(path, seed, serialization_format=SerializationFormat.SAFETENSORS)
