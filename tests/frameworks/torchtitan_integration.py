"""torchtitan 0.3's checkpointing through ckptverify's ``VerifiedCheckpointManager``: FSDP2, CPU, gloo.

``python torchtitan_integration.py OUT WORLD`` runs, on WORLD ranks, one after another:

1. ``train``: 4 steps, ``save`` every 2 (synchronous) into ``OUT/sync/step-{2,4}``;
2. ``async``: the same with ``async_mode="async"`` into ``OUT/async/``, then ``close``;
3. ``damaged``: storage that flips one bit of ``step-2`` right after it is written, ``verify_on_failure="raise"``,
   into ``OUT/damaged/``;
4. ``background``: as ``train``, with ``verify_when="background"``, into ``OUT/background/``, then ``close`` (which
   waits for the background verifications);
5. ``background_damaged``: as ``damaged``, with ``verify_when="background"``, into ``OUT/background_damaged/``; rank 0
   waits for the background verifier before the step 4 save, at which every rank raises step 2's failure;
6. ``retention``: as ``background``, 8 steps with ``keep_latest_k=2``; rank 0's background verifier holds
   ``step-2`` back until torchtitan has purged it (after the step 6 save: the last save purges nothing), into
   ``OUT/retention/``;
7. ``fallback``: rank 0 flips one bit of ``OUT/sync/step-4``; a fresh manager's ``load()`` (newest) and
   ``load(step=4)``; then ``load(step=2)``; then ``load()`` of ``OUT/damaged``, whose only checkpoint fails.

Each rank writes ``OUT/rank{R}.json``: per stage the verdicts, ckptverify's warnings, the error that stopped it,
the train state's step and whether the model kept its weights.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _launch import spawn
from helpers import faults as inj
from produce_torchtitan import TinyLM, TrainState

STEPS = 4


def build(world: int, folder: Path, cls: Any = None, steps: int = STEPS, **config: Any):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    from ckptverify.integrations.torchtitan import VerifiedCheckpointManager

    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt_cfg = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
    )
    optimizers = opt_cfg.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=steps)
    train_state = TrainState()
    config = {"keep_latest_k": 0, **config}
    cfg = (cls or VerifiedCheckpointManager).Config(enable=True, folder=str(folder), interval=2,
                                                    last_save_model_only=False, **config)
    manager = cfg.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
                        states={"train_state": train_state}, sd_adapter=None)
    return model, optimizers, lr_schedulers, train_state, manager


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().clone() for p in model.parameters()]


def train(rank: int, world: int, model: nn.Module, optimizers: Any, lr_schedulers: Any, train_state: Any,
          manager: Any, steps: int = STEPS) -> None:
    gen = torch.Generator().manual_seed(1234)
    for step in range(1, steps + 1):
        batch = torch.randint(0, 64, (2 * world, 9), generator=gen)[rank * 2:(rank + 1) * 2]
        logits = model(batch[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.step = step
        manager.save(step, last_step=step == steps)


def stage(result: dict[str, Any], name: str, fn: Any) -> None:
    from ckptverify.errors import CheckpointRefusedError, VerifyFailedWarning

    entry: dict[str, Any] = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            entry.update(fn() or {})
        except CheckpointRefusedError as exc:
            entry["error"] = {"type": type(exc).__name__, "message": str(exc)}
    entry["warnings"] = [str(w.message) for w in caught if issubclass(w.category, VerifyFailedWarning)]
    result[name] = entry


def job(rank: int, world: int, out: Path) -> None:
    from ckptverify.integrations.torchtitan import VerifiedCheckpointManager

    result: dict[str, Any] = {}

    def sync() -> dict[str, Any]:
        *parts, manager = build(world, out / "sync")
        train(rank, world, *parts, manager)
        manager.close()
        return {"verdicts": [v.to_dict() for v in manager.verdicts]}

    def async_() -> dict[str, Any]:
        *parts, manager = build(world, out / "async", async_mode="async")
        train(rank, world, *parts, manager)
        manager.close()
        return {"verdicts": [v.to_dict() for v in manager.verdicts]}

    class DamagingManager(VerifiedCheckpointManager):
        """Storage that flips one bit of ``step-2`` right after it is written."""

        @dataclass(kw_only=True, slots=True)
        class Config(VerifiedCheckpointManager.Config):
            pass

        def _hashing_save(self, state_dict: Any, checkpoint_id: str, async_mode: Any) -> Any:
            if rank == 0 and checkpoint_id.endswith("step-4"):
                # The earlier verdict is in, as in a run whose steps take longer than a verification.
                from ckptverify.verifier.background import wait_for_verifications

                assert wait_for_verifications(timeout=120)
            ret = super()._hashing_save(state_dict, checkpoint_id, async_mode)
            if rank == 0 and checkpoint_id.endswith("step-2"):
                inj.flip_in_tensor_payload(checkpoint_id)
            dist.barrier()
            return ret

    def damaged(folder: str = "damaged", **config: Any) -> Any:
        def run() -> dict[str, Any]:
            model, optimizers, lr_schedulers, train_state, manager = build(world, out / folder, DamagingManager,
                                                                           verify_on_failure="raise", **config)
            try:
                train(rank, world, model, optimizers, lr_schedulers, train_state, manager)
            finally:
                result[f"{folder}_step"] = train_state.step
                manager.close()
            return {"verdicts": [v.to_dict() for v in manager.verdicts]}
        return run

    def in_background() -> dict[str, Any]:
        *parts, manager = build(world, out / "background", verify_when="background")
        train(rank, world, *parts, manager)
        pending = [v.to_dict() for v in manager.verdicts]
        manager.close()
        return {"pending": pending, "verdicts": [v.to_dict() for v in manager.verdicts]}

    def retention() -> dict[str, Any]:
        if rank == 0:
            from ckptverify.verifier.background import default_verifier

            def hold_until_purged(path: str) -> None:
                deadline = time.monotonic() + 60
                while path.endswith("step-2") and os.path.exists(path) and time.monotonic() < deadline:
                    time.sleep(0.02)

            default_verifier().before_verify = hold_until_purged
        try:
            *parts, manager = build(world, out / "retention", steps=8, verify_when="background", keep_latest_k=2)
            train(rank, world, *parts, manager, steps=8)
            manager.close()
        finally:
            if rank == 0:
                default_verifier().before_verify = None
        return {"verdicts": [v.to_dict() for v in manager.verdicts]}

    def load(step: int, folder: str = "sync") -> Any:
        def run() -> dict[str, Any]:
            model, *_, train_state, manager = build(world, out / folder)
            before = weights(model)
            try:
                loaded = manager.load(step=step)
            finally:
                result.setdefault("untouched", {})[f"{folder}{step}"] = all(
                    torch.equal(p, q) for p, q in zip(weights(model), before, strict=True))
                result.setdefault("restored_step", {})[f"{folder}{step}"] = train_state.step
                manager.close()
            return {"loaded": loaded}
        return run

    stage(result, "sync", sync)
    stage(result, "async", async_)
    stage(result, "damaged", damaged())
    stage(result, "background", in_background)
    stage(result, "background_damaged", damaged("background_damaged", verify_when="background"))
    stage(result, "retention", retention)
    if rank == 0:
        result["fault"] = inj.flip_in_tensor_payload(out / "sync" / "step-4").file
    dist.barrier()
    stage(result, "load_newest", load(-1))
    stage(result, "load_4", load(4))
    stage(result, "load_2", load(2))
    stage(result, "load_damaged_newest", load(-1, "damaged"))
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    spawn(int(sys.argv[2]), job, Path(sys.argv[1]))
