"""ckptverify: prove PyTorch distributed checkpoints intact, and resumption bitwise exact.

The public surface is small and imported lazily, so ``import ckptverify`` (and the command line's
``--help``) stays fast: torch is imported only by the parts that need it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

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

__all__ = [
    "BackgroundVerifier",
    "Counters",
    "ResumableSampler",
    "Run",
    "TrainState",
    "Verification",
    "VerifyOptions",
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
    # The lazy exports are not module attributes until first used: list them, so dir() and completion show them.
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptverify' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


#: Modules of the previous release's layout -> where they live now. Importing an old name still works for one
#: release (the new module itself, with a deprecation warning), so code that imported a module by its old path,
#: as earlier docs showed, keeps running while it moves.
_MOVED_MODULES = {
    "ckptverify.adopt": "ckptverify.audit.adopt",
    "ckptverify.diff": "ckptverify.audit.diff",
    "ckptverify.verify": "ckptverify.audit.verify",
    "ckptverify.saving": "ckptverify.checkpoint.save",
    "ckptverify.restore": "ckptverify.checkpoint.load",
    "ckptverify.crcflip": "ckptverify.checks.crcflip",
    "ckptverify.demo": "ckptverify.examples.demo",
    "ckptverify.events": "ckptverify.ownfiles.events",
    "ckptverify.manifest": "ckptverify.ownfiles.manifest",
    "ckptverify.own_files": "ckptverify.ownfiles.names",
    "ckptverify.metrics": "ckptverify.render.metrics",
    "ckptverify.report": "ckptverify.render.report",
    "ckptverify.readers": "ckptverify.safeparse.readers",
    "ckptverify.safejson": "ckptverify.safeparse.safejson",
    "ckptverify.dcp.safepickle": "ckptverify.dcp.metadata_pickle",
    "ckptverify.dcp.pickle_subset": "ckptverify.safeparse.pickle_subset",
    "ckptverify.dcp.torchsave": "ckptverify.safeparse.torchsave",
    "ckptverify.formats.pickle_scan": "ckptverify.safeparse.pickle_scan",
    "ckptverify.formats.folder": "ckptverify.checks.folder",
    "ckptverify.formats.sidefiles": "ckptverify.checks.sidefiles",
    "ckptverify.formats.torchsave_file": "ckptverify.checks.torchsave_file",
    "ckptverify.resume.figures": "ckptverify.render.figures",
    "ckptverify.resume.render": "ckptverify.render.resume",
    "ckptverify.resume.replay": "ckptverify.replay.replay",
    "ckptverify.resume.replay_causes": "ckptverify.replay.causes",
    "ckptverify.resume.production": "ckptverify.production.mode",
    "ckptverify.runs.background": "ckptverify.verifier.background",
    "ckptverify.runs.notify": "ckptverify.verifier.notify",
    "ckptverify.runs.stamper": "ckptverify.verifier.stamper",
    "ckptverify.runs.throttle": "ckptverify.verifier.throttle",
    "ckptverify.runs.verification": "ckptverify.verifier.verification",
    "ckptverify.runs.verify_worker": "ckptverify.verifier.worker",
    "ckptverify.runs.watch": "ckptverify.verifier.watch",
}


class _MovedModules:
    """Resolves an old module name of :data:`_MOVED_MODULES` to its new module, warning once per import.

    A meta path finder and loader by protocol (``find_spec``, ``create_module``, ``exec_module``), not by the
    ``importlib.abc`` base classes: importing those costs every command start about 10 ms."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        import warnings

        from ckptverify.errors import CkptVerifyDeprecationWarning

        new = _MOVED_MODULES[spec.name]
        warnings.warn(f"the module {spec.name} is now {new}; its old name will be removed in the next release",
                      CkptVerifyDeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:
        pass  # the new module is already executed


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
