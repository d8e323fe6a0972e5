"""What the tests of a verification shared out among nodes (``ckptverify.verifier.parts``) have in common: reading a
stamp, a silent bit flip, a plain DCP save, and the manifests of a transformers FSDP ``checkpoint-N`` folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ckptverify.ownfiles.names import STAMP_FILE
from helpers import faults as inj

#: The DCP folders of a transformers FSDP ``checkpoint-N`` (``SHARDED_STATE_DICT``).
SUBS = ("optimizer_0", "pytorch_model_fsdp_0")


def stamp_of(ckpt: str | Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / STAMP_FILE).read_text())


def flip_keeping_mtime(ckpt: str, fqn: str) -> inj.Fault:
    """Silent corruption: one bit of ``fqn``'s payload flipped in place, the file's times kept."""
    item = next(i for i in inj.tensor_zip_items(ckpt) if i.fqn == fqn)
    st = os.stat(os.path.join(ckpt, item.file))
    fault = inj.flip_in_tensor_payload(ckpt, fqn)
    os.utime(os.path.join(ckpt, item.file), ns=(st.st_atime_ns, st.st_mtime_ns))
    return fault


def plain_dcp(path: Path, state: dict[str, torch.Tensor], *, safetensors: bool = False) -> str:
    """A checkpoint written by torch's own ``dcp.save`` (no manifest), in two files of one rank."""
    import torch.distributed.checkpoint as dcp

    kwargs: dict[str, Any] = {"thread_count": 2}
    if safetensors:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        kwargs["serialization_format"] = SerializationFormat.SAFETENSORS
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), **kwargs), no_dist=True)
    return str(path)


def without_times(manifest: Any) -> dict[str, Any]:
    d = manifest.to_dict()
    d.pop("created"), d.pop("self_digest", None)  # the time it was written, and what covers it
    d["items"] = sorted(d["items"], key=lambda e: (e["file"], e["offset"]))
    return d


def manifests(path: str) -> dict[str, Any]:
    """The manifests of a folder and of its DCP folders, by where they lie, their times left out."""
    from ckptverify.ownfiles.manifest import MANIFEST_FILE, read_manifest

    return {sub: without_times(read_manifest(os.path.join(path, sub))) for sub in ("", *SUBS)
            if os.path.exists(os.path.join(path, sub, MANIFEST_FILE))}
