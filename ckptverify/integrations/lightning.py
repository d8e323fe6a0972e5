"""PyTorch Lightning: verify every checkpoint the ``Trainer`` writes; refuse to load one that fails.

::

    from ckptverify.integrations.lightning import VerifyCheckpointsCallback

    trainer = pl.Trainer(callbacks=[ModelCheckpoint(...), VerifyCheckpointsCallback()])
    trainer.fit(model, ckpt_path=...)   # a ckpt_path that fails verification is refused before it is read

**Where it hooks in, and why.** Lightning has no callback hook that runs after a checkpoint is on disk:
``Callback.on_save_checkpoint`` runs while the checkpoint dict is being built, before anything is written, and
``ModelCheckpoint`` is always moved behind every other callback, so another callback's ``on_train_batch_end``
runs *before* that batch's save. Every checkpoint the ``Trainer`` writes (``ModelCheckpoint``, a manual
``trainer.save_checkpoint``, a fault-tolerant save) and every one it reads (``fit/validate/test(ckpt_path=...)``)
goes through the strategy: ``Strategy.save_checkpoint`` returns once the file (or, for a distributed strategy,
the DCP folder and ``meta.pt``) is written, and ``Strategy.load_checkpoint`` is the first thing that reads
``ckpt_path``. So in ``setup`` (which Lightning calls before it restores ``ckpt_path``) the callback wraps these
methods of the trainer's strategy object, and in ``teardown`` puts them back. The strategy's own code is not
changed, so any strategy works: the default single device one (``.ckpt`` files), DDP, and
``ModelParallelStrategy``/``FSDPStrategy`` with distributed checkpoints (a DCP folder with ``meta.pt``).

- After ``save_checkpoint``: the coordinator (global rank 0) verifies (with ``fingerprint=True``, after writing
  the manifest: inside a DCP folder, beside a ``.ckpt`` file), stamps (inside a folder; beside a ``.ckpt`` file as
  ``NAME.ckpt.ckptverify.verified.json``) and logs to
  ``events.jsonl`` in the checkpoint's folder; the verdict is broadcast, so with ``on_failure="raise"`` every
  rank raises :class:`~ckptverify.errors.CheckpointRefusedError`.
- Before ``load_checkpoint``: the checkpoint is verified (read only) and refused on every rank when it fails.
- ``remove_checkpoint`` (``save_top_k`` retention) also removes the stamp and manifest kept beside a ``.ckpt``
  file.
- With ``verify="background"`` the coordinator queues each checkpoint for the background verifier
  (:mod:`ckptverify.integrations._core`) and the save returns at once; the stamp and the event come when its
  verification finishes. ``teardown`` (once ``fit``/``validate``/``test`` is done, after any asynchronous write
  has finished) waits for the pending ones, bounded (``CKPTVERIFY_VERIFY_EXIT_TIMEOUT``, 600 s), and puts their
  final verdicts in ``verdicts``. A failure is a warning and a ``checkpoint-failed`` event when it is found; with
  ``on_failure="raise"`` every rank raises :class:`~ckptverify.errors.CheckpointRefusedError` at the next save,
  or at the end of ``fit``. A checkpoint ``save_top_k`` removed before its turn is a ``checkpoint-deleted``
  event, not a failure.
- With ``AsyncCheckpointIO`` the file is written in a thread after ``save_checkpoint`` returns: the check then
  runs in that thread, right after the write, and a failure raised there surfaces (as Lightning's async plugin
  does for any error) at the next save or at teardown.

Tested with ``pytorch-lightning`` 2.6 (the ``pytorch_lightning`` package; the ``lightning`` package's
``lightning.pytorch.Trainer`` needs its own ``Callback`` class and is not covered).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback

from ckptverify.integrations._core import (
    Fingerprint,
    Group,
    Verifier,
    VerifyOptions,
    integration_verify,
    settle_verdicts,
    torch_gather,
    warn_if_accumulating,
)
from ckptverify.verifier.verification import Verification

__all__ = ["VerifyCheckpointsCallback"]

_WRAPPED = "_ckptverify_wrapped"
_ABSENT = object()


class VerifyCheckpointsCallback(Callback):
    """Verify each checkpoint the trainer saves, and the ``ckpt_path`` it resumes from.

    Args:
        verify: a :class:`~ckptverify.options.VerifyOptions` or its ``when``. ``when``: ``"inline"`` (default)
            or ``"background"``: each save returns at once, its verdict arrives later (see the module docstring);
            ``teardown`` waits for the pending ones. ``on_failure``: ``"warn"`` (default: a
            :class:`~ckptverify.integrations.VerifyFailedWarning` and a ``checkpoint-failed`` event) or
            ``"raise"`` (also stop training with :class:`~ckptverify.errors.CheckpointRefusedError`) when a saved
            checkpoint fails verification. ``deep``: as for :class:`~ckptverify.integrations.Verifier`.
        verify_resume: refuse a ``ckpt_path`` that fails verification (default ``True``).
        fingerprint, jobs, events_dir: as for :class:`~ckptverify.integrations.Verifier` (``fingerprint``
            ``"auto"``: a ``.ckpt`` file or a DCP folder, every byte under a CRC-32, gets no manifest unless
            ``fingerprint=True``).

    ``verdicts`` lists the verdicts of the saves checked so far (on every rank); with ``background``, pending
    ones until ``teardown`` replaces them with the verdicts that arrived.
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
        setattr(strategy, _WRAPPED, self)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        while self._restore:
            obj, name, before = self._restore.pop()
            if before is _ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)  # the class's method shows through again
            else:
                setattr(obj, name, before)
        with contextlib.suppress(AttributeError):
            delattr(trainer.strategy, _WRAPPED)
        if self.verifier.background and stage != "exception":
            # Every write is done (the async plugin was torn down first); every rank is here, the group is up.
            arrived = self.verifier.wait(group=self._group(trainer))
            self.verdicts = settle_verdicts(self.verdicts, arrived)

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
                     rank=trainer.global_rank, gather=torch_gather())

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
        from ckptverify.audit.adopt import file_manifest_path
        from ckptverify.runs.stamp import stamp_path

        def remove_checkpoint(filepath: Any) -> None:
            path = os.fspath(filepath)
            beside = (stamp_path(path), file_manifest_path(path)) if os.path.isfile(path) else ()
            remove(filepath)
            if trainer.is_global_zero and not os.path.lexists(path):
                for name in beside:  # ckptverify's own files, kept beside a single-file checkpoint
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name)

        return remove_checkpoint
