"""ckptverify: prove PyTorch distributed checkpoints intact, and resumption bitwise exact.

The public surface is small and imported lazily, so ``import ckptverify`` (and the command line's
``--help``) stays fast: torch is imported only by the parts that need it.
"""

from importlib import import_module as _import_module
from typing import TYPE_CHECKING as _TYPE_CHECKING

from ckptverify._version import __version__

#: Public name -> module that defines it.
_EXPORTS = {
    "verify_checkpoint": "ckptverify.audit.verify",
    "fingerprint_checkpoint": "ckptverify.audit.adopt",
    "diff_checkpoints": "ckptverify.audit.diff",
    "save": "ckptverify.checkpoint.save",
    "load": "ckptverify.checkpoint.load",
    "TrainState": "ckptverify.state.train_state",
    "ResumableSampler": "ckptverify.state.sampler",
    "Counters": "ckptverify.state.train_state",
    "Run": "ckptverify.resume.run",
    "resume_check": "ckptverify.render.resume",
    "async_save": "ckptverify.checkpoint.save",
    "tensor_fingerprint": "ckptverify.fingerprint",
    "chunk_fingerprint": "ckptverify.fingerprint",
    "scan_run_dir": "ckptverify.runs.scan",
    "latest_verified": "ckptverify.runs.latest",
    "prune": "ckptverify.runs.prune",
    "BackgroundVerifier": "ckptverify.verifier.background",
    "Verification": "ckptverify.verifier.verification",
    "last_verification": "ckptverify.verifier.background",
    "wait_for_verifications": "ckptverify.verifier.background",
    "VerifyOptions": "ckptverify.options",
}

__all__ = ["BackgroundVerifier", "Counters", "ResumableSampler", "Run", "TrainState", "Verification", "VerifyOptions",
           "__version__", "async_save", "chunk_fingerprint", "diff_checkpoints", "fingerprint_checkpoint",
           "last_verification", "latest_verified", "load", "prune", "resume_check", "save", "scan_run_dir",
           "tensor_fingerprint", "verify_checkpoint", "wait_for_verifications"]

if _TYPE_CHECKING:
    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.audit.diff import diff_checkpoints
    from ckptverify.audit.verify import verify_checkpoint
    from ckptverify.checkpoint.load import load
    from ckptverify.checkpoint.save import async_save, save
    from ckptverify.fingerprint import chunk_fingerprint, tensor_fingerprint
    from ckptverify.options import VerifyOptions
    from ckptverify.render.resume import resume_check
    from ckptverify.resume.run import Run
    from ckptverify.runs.latest import latest_verified
    from ckptverify.runs.prune import prune
    from ckptverify.runs.scan import scan_run_dir
    from ckptverify.state.sampler import ResumableSampler
    from ckptverify.state.train_state import Counters, TrainState
    from ckptverify.verifier.background import BackgroundVerifier, last_verification, wait_for_verifications
    from ckptverify.verifier.verification import Verification


def __dir__() -> list[str]:
    # The public names only: the lazy exports are not module attributes until first used, and the module's own
    # helpers (and the subpackages imported so far) are no part of the interface.
    return sorted(__all__)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptverify' has no attribute {name!r}")
    return getattr(_import_module(module), name)
