"""ckptverify: prove PyTorch distributed checkpoints intact, and resumption bitwise exact.

The public surface is small and imported lazily, so ``import ckptverify`` (and the command line's
``--help``) stays fast: torch is imported only by the parts that need it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> module that defines it.
_EXPORTS = {
    "verify_checkpoint": "ckptverify.verify",
    "fingerprint_checkpoint": "ckptverify.adopt",
    "diff_checkpoints": "ckptverify.diff",
    "save": "ckptverify.saving",
    "load": "ckptverify.restore",
    "TrainState": "ckptverify.state.train_state",
    "ResumableSampler": "ckptverify.state.sampler",
    "Counters": "ckptverify.state.train_state",
    "Run": "ckptverify.resume.run",
    "resume_check": "ckptverify.resume.harness",
    "async_save": "ckptverify.saving",
    "tensor_fingerprint": "ckptverify.fingerprint",
    "chunk_fingerprint": "ckptverify.fingerprint",
    "scan_run_dir": "ckptverify.runs.scan",
    "latest_verified": "ckptverify.runs.latest",
    "prune": "ckptverify.runs.prune",
    "BackgroundVerifier": "ckptverify.runs.background",
    "Verification": "ckptverify.runs.verification",
    "last_verification": "ckptverify.runs.background",
    "wait_for_verifications": "ckptverify.runs.background",
}

__all__ = [
    "BackgroundVerifier",
    "Counters",
    "ResumableSampler",
    "Run",
    "TrainState",
    "Verification",
    "__version__",
    "async_save",
    "chunk_fingerprint",
    "diff_checkpoints",
    "fingerprint_checkpoint",
    "last_verification",
    "latest_verified",
    "load",
    "prune",
    "resume_check",
    "save",
    "scan_run_dir",
    "tensor_fingerprint",
    "verify_checkpoint",
    "wait_for_verifications",
]

if TYPE_CHECKING:
    from ckptverify.adopt import fingerprint_checkpoint
    from ckptverify.diff import diff_checkpoints
    from ckptverify.fingerprint import chunk_fingerprint, tensor_fingerprint
    from ckptverify.restore import load
    from ckptverify.resume.harness import resume_check
    from ckptverify.resume.run import Run
    from ckptverify.runs.background import BackgroundVerifier, last_verification, wait_for_verifications
    from ckptverify.runs.latest import latest_verified
    from ckptverify.runs.prune import prune
    from ckptverify.runs.scan import scan_run_dir
    from ckptverify.runs.verification import Verification
    from ckptverify.saving import async_save, save
    from ckptverify.state.sampler import ResumableSampler
    from ckptverify.state.train_state import Counters, TrainState
    from ckptverify.verify import verify_checkpoint


def __dir__() -> list[str]:
    # The lazy exports are not module attributes until first used: list them, so dir() and completion show them.
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptverify' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
