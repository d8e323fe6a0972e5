"""torchtitan: a ``CheckpointManager`` that saves through ckptverify's hashing writer, verifies each ``step-N``, and
loads only a checkpoint that verifies.

::

    from ckptverify.integrations.torchtitan import VerifiedCheckpointManager

    config.checkpoint = VerifiedCheckpointManager.Config(enable=True, folder="checkpoint", interval=500)

A subclass because torchtitan 0.3 takes no storage writer, but builds the class that declares its ``Config`` and
documents ``dcp_save``, ``dcp_load``, ``_find_load_step``, ``_wait_for_saving`` and ``_close`` as overridable.
``dcp_save`` saves with :func:`ckptverify.save`/:func:`ckptverify.async_save` (manifest from memory, commit
protocol), then verifies, stamps and logs (an async save when torchtitan waits for it); HF exports are written by
torchtitan and verified. Background mode as in :mod:`ckptverify.integrations._core` (``close`` waits).
``_find_load_step`` picks the newest ``step-N`` that verifies (refusing if none does); ``dcp_load`` refuses any
other failing checkpoint on every rank before DCP reads it. Local folders only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.tools import filesystem

from ckptverify.errors import UsageError
from ckptverify.integrations._core import WHEN, Verifier, numbered_folders
from ckptverify.options import VerifyOptions, failure_policy
from ckptverify.state.distributed import torch_group
from ckptverify.verifier.verification import Verification

__all__ = ["VerifiedCheckpointManager"]

_STEP = re.compile(r"step-(\d+)")


class VerifiedCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with every save verified and every load checked (see the module docstring).
    ``verdicts``: the saves' verdicts so far, on every rank."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's config plus ``verify_when``, ``verify_deep`` and ``verify_on_failure`` (flat, as torchtitan
        configs are); :meth:`verify_options` combines them."""

        verify_on_failure: Literal["warn", "raise"] = "warn"
        """A saved checkpoint that fails verification: ``warn`` (a warning and an event) or ``raise`` (stop)."""

        verify_deep: bool = False
        """Also rebuild every tensor and compare its logical fingerprint with the one taken at save time."""

        verify_when: Literal["inline", "background"] = "inline"
        """``inline``: a save returns once its checkpoint is verified. ``background``: a save returns once it is
        written; its verdict arrives later (a failure with ``raise`` is raised at the next save or at ``close``)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            failure_policy("checkpoint.verify_on_failure", self.verify_on_failure)
            if self.verify_when not in WHEN:
                raise UsageError(f"checkpoint.verify_when must be one of {', '.join(WHEN)}, got {self.verify_when!r}")
            self.verify_options()  # every field checked now, not at the first save

        def verify_options(self) -> VerifyOptions:
            """The ``verify_*`` fields as the :class:`~ckptverify.options.VerifyOptions` every API takes."""
            return VerifyOptions(when=self.verify_when, deep=self.verify_deep, on_failure=self.verify_on_failure)

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        if filesystem.is_remote(self.folder):
            raise UsageError(f"checkpoint.folder {self.folder} is remote; ckptverify verifies local folders only")
        self.verifier = Verifier(verify=config.verify_options(), events_dir=self.folder)
        self.verdicts: list[Verification] = []
        self._pending: tuple[str, bool] | None = None
        self._verified_for_load: str | None = None

    # -- saving
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:  # safetensors export: torchtitan's own writer, then verified (and nothing to fingerprint)
            ret = super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
            hashed = False
        else:
            ret = self._hashing_save(state_dict, checkpoint_id, async_mode)
            hashed = True
            if enable_garbage_collection:
                from torchtitan.tools.utils import GarbageCollection

                GarbageCollection.collect("GC collection invoked by checkpointer.")
        if async_mode == AsyncMode.DISABLED:
            self._verify_saved(checkpoint_id, hashed)
        else:
            self._pending = (checkpoint_id, hashed)
        return ret

    def _hashing_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode) -> Any:
        from ckptverify.checkpoint.save import async_save, save

        if async_mode == AsyncMode.ASYNC:
            return async_save(state_dict, checkpoint_id, process_group=self.pg)
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            return async_save(state_dict, checkpoint_id, process_group=self.pg,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        save(state_dict, checkpoint_id)
        return None

    def _verify_saved(self, checkpoint_id: str, hashed: bool) -> None:
        m = _STEP.search(os.path.basename(os.path.normpath(checkpoint_id)))
        step = int(m.group(1)) if m else None
        # A hashed save wrote its own manifest, from what was in memory: nothing is fingerprinted after it.
        self.verdicts.append(self.verifier.after_save(checkpoint_id, step=step, group=torch_group(),
                                                      fingerprint=not hashed))

    def _wait_for_saving(self) -> None:
        super()._wait_for_saving()
        pending, self._pending = self._pending, None
        if pending is not None:
            self._verify_saved(*pending)

    def _close(self) -> None:
        # torchtitan does not wait for an asynchronous save on close; its verification needs the save done.
        if self._pending is not None and self.save_future is not None:
            self._wait_for_saving()
        try:
            if self.enable:
                self.verdicts = self.verifier.settle(self.verdicts, group=torch_group())
        finally:
            super()._close()

    # -- loading
    def _find_load_step(self, folder: str = "") -> int:
        """The newest ``step-N`` under ``folder`` that verifies (``-1`` if none exist); refuses if some exist and none
        verifies."""
        folder = folder or self.folder
        group = torch_group()
        steps = group.share(lambda: [step for step, _ in numbered_folders(folder, _STEP.search, _holds_a_checkpoint)])
        ids = {self._create_checkpoint_id(step, folder): step for step in steps}  # newest first, each step once
        verdict = self.verifier.newest_verified(list(ids), folder, group=group)
        if verdict is None:
            return -1
        self._verified_for_load = verdict.path
        return ids[verdict.path]

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        verified, self._verified_for_load = self._verified_for_load, None
        if verified != checkpoint_id:  # not the one _find_load_step has just verified
            self.verifier.before_resume(checkpoint_id, group=torch_group())
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)


def _holds_a_checkpoint(path: str) -> bool:
    """Whether torchtitan would load the ``step-N`` folder ``path``: it holds ``.metadata`` or an HF index."""
    return os.path.isfile(os.path.join(path, ".metadata")) \
        or os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
