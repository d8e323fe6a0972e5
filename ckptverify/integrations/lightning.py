"""PyTorch Lightning: verify every checkpoint the ``Trainer`` writes; refuse to load one that fails.

::

    from ckptverify.integrations.lightning import VerifyCheckpointsCallback

    trainer = pl.Trainer(callbacks=[ModelCheckpoint(...), VerifyCheckpointsCallback()])
    trainer.fit(model, ckpt_path=...)   # a ckpt_path that fails verification is refused before it is read

No Lightning hook runs after a checkpoint is on disk (``on_save_checkpoint`` runs before writing, and
``ModelCheckpoint`` runs after every other callback). But every save and load goes through the strategy, so
``setup`` wraps the strategy object's ``save_checkpoint``/``load_checkpoint``/``remove_checkpoint`` and
``teardown`` restores them; any strategy works (single device ``.ckpt``, DDP, distributed DCP folders). After a
save the coordinator verifies, stamps (beside a ``.ckpt`` as ``NAME.ckpt.ckptverify.verified.json``) and logs;
before a load the checkpoint is verified and refused on failure; retention also removes our files beside a
``.ckpt``. Background mode as in :mod:`ckptverify.integrations._core`, waited for in ``teardown``. With
``AsyncCheckpointIO`` the check runs in the writer thread after the write; its failure surfaces at the next save
or teardown. Tested with ``pytorch-lightning`` 2.6 (not the ``lightning`` package's ``Trainer``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

from ckptverify.integrations._core import Fingerprint, Verifier, integration_verify, warn_if_accumulating
from ckptverify.options import VerifyOptions
from ckptverify.state.distributed import Group, torch_group
from ckptverify.verifier.verification import Verification

__all__ = ["VerifyCheckpointsCallback"]

_WRAPPED = "_ckptverify_wrapped"
_ABSENT = object()


class VerifyCheckpointsCallback(Callback):
    """Verify each checkpoint the trainer saves, and the ``ckpt_path`` it resumes from.

    Args:
        verify, fingerprint, jobs, events_dir: as for :class:`~ckptverify.integrations.Verifier` (``"background"``:
            ``teardown`` waits; ``on_failure="raise"``: :class:`~ckptverify.errors.CheckpointRefusedError` stops
            training).
        verify_resume: refuse a ``ckpt_path`` that fails verification (default ``True``).

    ``verdicts``: the verdicts of the saves so far, on every rank (pending ones until ``teardown``).
    """

    def __init__(self, *, verify: VerifyOptions | str = "inline", verify_resume: bool = True,
                 fingerprint: Fingerprint = "auto", jobs: int | None = None,
                 events_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        options = integration_verify("VerifyCheckpointsCallback", verify)
        self.verifier = Verifier(verify=options, fingerprint=fingerprint, jobs=jobs, events_dir=events_dir)
        self.verify_resume = verify_resume
        self.verdicts: list[Verification] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self._async = False
        self._async_paths: set[str] = set()
        self._lock = threading.Lock()

    # -- Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if getattr(strategy, _WRAPPED, None) is self:
            return
        self._wrap(strategy, "save_checkpoint", self._saving(trainer, strategy.save_checkpoint))
        self._wrap(strategy, "load_checkpoint", self._loading(trainer, strategy.load_checkpoint))
        self._wrap(strategy, "remove_checkpoint", self._removing(trainer, strategy.remove_checkpoint))
        io = strategy.checkpoint_io
        from pytorch_lightning.plugins.io import AsyncCheckpointIO

        self._async = isinstance(io, AsyncCheckpointIO) and io.checkpoint_io is not None
        if self._async:
            self._wrap(io, "save_checkpoint", self._submitting(io.save_checkpoint))
            self._wrap(io.checkpoint_io, "save_checkpoint", self._writing_async(trainer, io.checkpoint_io))
        self._wrap(strategy, _WRAPPED, self)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        while self._restore:
            obj, name, before = self._restore.pop()
            if before is _ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)  # the class's method shows through again
            else:
                setattr(obj, name, before)
        if self.verifier.background and stage != "exception":
            # Every write is done (the async plugin was torn down first); every rank is here, the group is up.
            self.verdicts = self.verifier.settle(self.verdicts, group=self._group(trainer))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips the teardown hooks when a run stops on an exception (a refused resume, for one).
        self.teardown(trainer, pl_module, "exception")

    # -- wrappers
    def _wrap(self, obj: Any, name: str, replacement: Any) -> None:
        self._restore.append((obj, name, vars(obj).get(name, _ABSENT)))
        setattr(obj, name, replacement)

    def _group(self, trainer: pl.Trainer) -> Group:
        strategy = trainer.strategy
        if trainer.world_size == 1:
            return Group()
        return Group(coordinator=trainer.is_global_zero, broadcast=lambda obj: strategy.broadcast(obj, src=0),
                     rank=trainer.global_rank, gather=torch_group().gather)

    def _saving(self, trainer: pl.Trainer, save: Any) -> Any:
        def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            warn_if_accumulating(trainer.lightning_module, filepath)
            save(checkpoint, filepath, storage_options=storage_options)
            path = os.fspath(filepath)
            group = self._group(trainer)
            if self._async:
                with self._lock:
                    later = path in self._async_paths
                    self._async_paths.discard(path)
                if group.broadcast is not None:  # only rank 0 writes through the plugin; all ranks follow it
                    later = group.broadcast(later)
                if later:  # written in the async plugin's thread, and checked there
                    return
            # A distributed strategy saves to the path rank 0 chose; every rank follows rank 0's verdict.
            self.verdicts.append(self.verifier.after_save(path, step=trainer.global_step, group=group))

        return save_checkpoint

    def _submitting(self, submit: Any) -> Any:
        def save_checkpoint(checkpoint: dict[str, Any], path: Any, *args: Any, **kwargs: Any) -> None:
            with self._lock:
                self._async_paths.add(os.fspath(path))
            submit(checkpoint, path, *args, **kwargs)

        return save_checkpoint

    def _writing_async(self, trainer: pl.Trainer, io: Any) -> Any:
        write = io.save_checkpoint
        step = trainer.global_step

        def save_checkpoint(checkpoint: dict[str, Any], path: Any, *args: Any, **kwargs: Any) -> None:
            write(checkpoint, path, *args, **kwargs)
            saved_step = checkpoint.get("global_step", step) if isinstance(checkpoint, dict) else step
            # Only the coordinator writes through the checkpoint IO plugin; this thread cannot broadcast.
            self.verdicts.append(self.verifier.after_save(os.fspath(path), step=saved_step))

        return save_checkpoint

    def _loading(self, trainer: pl.Trainer, load: Any) -> Any:
        def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            if self.verify_resume:
                self.verifier.before_resume(os.fspath(checkpoint_path), group=self._group(trainer))
            return load(checkpoint_path, *args, **kwargs)

        return load_checkpoint

    def _removing(self, trainer: pl.Trainer, remove: Any) -> Any:
        from ckptverify.verifier.saved import remove_beside

        def remove_checkpoint(filepath: Any) -> None:
            path = os.fspath(filepath)
            single = os.path.isfile(path)
            remove(filepath)
            if single and trainer.is_global_zero:
                remove_beside(path)

        return remove_checkpoint
