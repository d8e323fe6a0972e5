"""Build real DCP checkpoints, in every on-disk layout the verifier must understand.

Every builder writes with :func:`torch.distributed.checkpoint.save` (no hand-made files), so the tests
see exactly what training jobs produce:

``single``
    one process, no process group: an MLP, its AdamW state after one step, a few non-tensor values
    (int, str, bytes, a dict) and tensors of several dtypes (float32, bfloat16, int64, bool).
``threads``
    the same state written with ``FileSystemWriter(thread_count=3)``: several ``.distcp`` files per rank.
``per_item``
    the same state written with ``FileSystemWriter(single_file_per_rank=False)``: one file per item.
``safetensors``
    the same state written with ``serialization_format=SerializationFormat.SAFETENSORS``:
    non-tensor items are still ``torch.save`` archives, the tensors follow as one safetensors blob
    (whose storage entries all start at the blob's offset). ``FileSystemReader`` cannot load it.
``fsdp2``
    two ranks (gloo, CPU) with the model sharded by ``fully_shard`` on a 1-D device mesh, AdamW stepped
    once, saved through ``get_state_dict``.
``nocoll``
    the same two-rank job saved with ``use_collectives=False``: one ``__N.metadata`` per rank, no
    ``.metadata``.

The first weight matrix is 384 x 128 float32 (192 KiB; 96 KiB a shard on two ranks), so its payload
and its AdamW moments span many 4 KiB pages.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from helpers.multiproc import spawn_ranks

#: Every layout this module can build, in the order the tests list them.
LAYOUTS = ("single", "threads", "per_item", "safetensors", "fsdp2", "nocoll")

#: Layouts written by more than one rank.
MULTI_RANK = frozenset({"fsdp2", "nocoll"})

#: Layouts whose tensor items are ``torch.save`` zip archives (the ones whose CRCs can be checked).
ZIP_LAYOUTS = ("single", "threads", "per_item", "fsdp2", "nocoll")

IN_FEATURES = 128
HIDDEN = 384
OUT_FEATURES = 32
WORLD_SIZE = 2


def _safetensors_format() -> Any | None:
    """``SerializationFormat.SAFETENSORS`` when the installed torch has it, else ``None``."""
    try:
        from torch.distributed.checkpoint.filesystem import SerializationFormat
    except ImportError:  # pragma: no cover - older torch
        return None
    return getattr(SerializationFormat, "SAFETENSORS", None)


def safetensors_supported() -> bool:
    return _safetensors_format() is not None


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT_FEATURES),
    )


def _train_one_step(model: torch.nn.Module, seed: int = 1) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    batch = torch.randn(8, IN_FEATURES, generator=gen)
    model(batch).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return optim


def _extras() -> dict[str, Any]:
    """Non-tensor values and tensors of several dtypes, identical on every rank."""
    gen = torch.Generator().manual_seed(2)
    return {
        "step": 7,
        "run_name": "ckptverify-test",
        "blob": b"\x00\x01\x02\xffopaque",
        "config": {"lr": 1e-3, "betas": [0.9, 0.999], "note": "nested dict"},
        "extra": {
            "bf16": torch.randn(16, 16, generator=gen).to(torch.bfloat16),
            "i64": torch.arange(100, dtype=torch.int64),
            "mask": torch.rand(33, generator=gen) > 0.5,
            # Same payload size as "bf16" (512 bytes) with another dtype and shape: in the one-file-per-item
            # layout the two files have the same size, so swapping them is a fault only the dtype/shape
            # check can see.
            "i32": torch.arange(128, dtype=torch.int32) * 3,
            "f16_col": torch.linspace(-1, 1, 256, dtype=torch.float16).reshape(256, 1),
        },
    }


def single_process_state_dict(seed: int = 0) -> dict[str, Any]:
    """The state dict the single-process layouts save (model + AdamW after one step + extras)."""
    model = make_model(seed)
    optim = _train_one_step(model)
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, **_extras()}


def _save_single(path: Path, **writer_kwargs: Any) -> None:
    state = single_process_state_dict()
    with warnings.catch_warnings():
        # "torch.distributed is disabled ... assuming the intent is to save in a single process."
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(str(path), **writer_kwargs))


def build_single(path: Path) -> None:
    _save_single(path)


def build_threads(path: Path) -> None:
    _save_single(path, thread_count=3)


def build_per_item(path: Path) -> None:
    _save_single(path, single_file_per_rank=False)


def build_safetensors(path: Path) -> None:
    fmt = _safetensors_format()
    if fmt is None:
        raise RuntimeError("this torch has no SerializationFormat.SAFETENSORS")
    _save_single(path, serialization_format=fmt)


def _fsdp2_worker(rank: int, world_size: int, jobs: list[tuple[str, bool]]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model(0)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = _train_one_step(model)
    model_sd, optim_sd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, **_extras()}
    # Rank-local state must be keyed by rank: DCP deduplicates equal keys across ranks.
    state[f"rank_state.{rank}"] = {"rank": rank, "rng": torch.get_rng_state()}
    for path, use_collectives in jobs:
        dcp.save(state, checkpoint_id=path, use_collectives=use_collectives)
        torch.distributed.barrier()


def build_two_rank(paths: dict[str, Path]) -> None:
    """Write the two-rank layouts (keys of ``paths``: ``fsdp2``, ``nocoll``) from one pair of processes."""
    jobs = []
    for layout, path in paths.items():
        if layout not in MULTI_RANK:
            raise ValueError(f"{layout} is not a two-rank layout")
        Path(path).mkdir(parents=True, exist_ok=True)
        jobs.append((str(path), layout == "fsdp2"))
    spawn_ranks(_fsdp2_worker, WORLD_SIZE, jobs)


def build_fsdp2(path: Path) -> None:
    build_two_rank({"fsdp2": path})


def build_nocoll(path: Path) -> None:
    build_two_rank({"nocoll": path})


BUILDERS: dict[str, Callable[[Path], None]] = {
    "single": build_single,
    "threads": build_threads,
    "per_item": build_per_item,
    "safetensors": build_safetensors,
    "fsdp2": build_fsdp2,
    "nocoll": build_nocoll,
}


def build_all(root: str | os.PathLike[str], layouts: tuple[str, ...] = LAYOUTS) -> dict[str, Path]:
    """Write each of ``layouts`` into ``root/<layout>``; the two-rank ones share one pair of processes."""
    out = {layout: Path(root) / layout for layout in layouts}
    for layout in layouts:
        if layout not in MULTI_RANK:
            BUILDERS[layout](out[layout])
    multi = {layout: out[layout] for layout in layouts if layout in MULTI_RANK}
    if multi:
        build_two_rank(multi)
    return out


def build(layout: str, path: str | os.PathLike[str]) -> Path:
    """Write checkpoint ``layout`` into directory ``path`` (created) and return the path."""
    out = Path(path)
    BUILDERS[layout](out)
    return out


def copy_checkpoint(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """A fresh, writable copy of a checkpoint directory."""
    shutil.copytree(src, dst)
    return Path(dst)


def load_back(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a single-process checkpoint with plain DCP into a state dict shaped like the one saved.

    Used to show the clean checkpoints are ordinary, loadable DCP checkpoints.
    """
    template = single_process_state_dict(seed=123)  # same structure, different values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=FileSystemReader(str(path)))
    return template
