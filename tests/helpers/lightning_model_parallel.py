"""Lightning ``ModelParallelStrategy`` (FSDP2, gloo, CPU) runs with ckptverify's ``VerifyCheckpointsCallback``, every
stage of one check in the same ranks.

The ranks come from :func:`helpers.multiproc.spawn_ranks` (forked from the fork server, with the environment
torchrun gives: Lightning takes the group it finds and starts no processes of its own) and run the stages one
after another, each a ``lightning_integration.run_stage`` with a fresh ``Trainer`` and a fresh model (a stage per
fresh interpreter would pay torch's and Lightning's imports nine times on two ranks):

- ``save``: train 4 steps, ``ModelCheckpoint`` every 2 (``OUT/checkpoints/step={2,4}.ckpt/``, DCP folders with
  ``meta.pt``), with ``VerifyCheckpointsCallback(verify=VerifyOptions(on_failure="raise"), fingerprint=True)``;
- rank 0 writes the stamps of both folders to ``OUT/stamps.json``, flips one bit of ``step=2.ckpt``'s largest
  tensor (``helpers.faults.flip_in_tensor_payload``) and writes what it changed to ``OUT/fault.json``;
- ``refused``: ``fit(ckpt_path=step=2.ckpt)`` to step 6;
- ``resumed``: ``fit(ckpt_path=step=4.ckpt)`` to step 6, saving ``step=6.ckpt``.

Each rank writes ``OUT/STAGE-rank{R}.json`` (``run_stage``): the verdicts it got, the warnings ckptverify
raised, the error that stopped it (type and message), the global step reached, and whether the model's weights
are still those it was built with (nothing loaded).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from frameworks.lightning_integration import run_stage


def save_flip_resume(rank: int, world: int, out: str) -> None:
    """The three stages and the flip between them (run under ``spawn_ranks(..., launcher_env=True)``)."""
    import torch.distributed as dist

    from ckptverify.runs.stamp import read_stamp
    from helpers import faults as inj

    root = Path(out)
    checkpoints = root / "checkpoints"
    run_stage(root, world, "save", 4)
    dist.barrier()  # every rank's save stage is over before a byte is changed
    if rank == 0:
        stamps = {}
        for step in (2, 4):  # as the save stage left them
            stamp = read_stamp(checkpoints / f"step={step}.ckpt")
            stamps[step] = None if stamp is None else {"passed": stamp.passed, "current": stamp.current,
                                                       "manifest": stamp.data["manifest"], "repr": repr(stamp)}
        (root / "stamps.json").write_text(json.dumps(stamps))
        fault = inj.flip_in_tensor_payload(checkpoints / "step=2.ckpt")
        (root / "fault.json").write_text(json.dumps(dataclasses.asdict(fault), default=list))
    dist.barrier()
    run_stage(root, world, "refused", 6, checkpoints / "step=2.ckpt")
    dist.barrier()
    run_stage(root, world, "resumed", 6, checkpoints / "step=4.ckpt")
