"""Real torchtitan 0.3 checkpoints: its ``CheckpointManager`` around a small FSDP2 model, CPU, gloo.

torchtitan's trainer assumes CUDA and ships no tokenizer or data files, so this drives the pieces users'
checkpoints come from: ``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` (warmup + decay), a train
state, and ``CheckpointManager.save`` on an interval, exactly as ``Trainer.train`` calls them.

Writes (``python produce_torchtitan.py OUT``):

- ``ws2/checkpoint/step-2``, ``ws2/checkpoint/step-4``: trained on 2 ranks (FSDP2), saved every 2 steps;
- ``ws1/checkpoint/step-4``: a 1-rank job that resumed ``ws2``'s step 4 with ``CheckpointManager.load``
  (DCP reshards 2 -> 1) and saved it again at once: the same state, other sharding.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import out_dir, spawn, write_produced

STEPS = 4
INTERVAL = 2


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({
            str(i): nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for i in range(layers)
        })
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = h + layer(h)
        return self.output(self.norm(h))


class TrainState:
    """What ``Trainer`` puts under ``train_state``: the step and the tokens seen."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"step": torch.tensor(self.step), "ntokens_seen": torch.tensor(self.ntokens_seen)}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.step = int(sd["step"])
        self.ntokens_seen = int(sd["ntokens_seen"])


def build(world: int, folder: Path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    opt_cfg = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
    )
    optimizers = opt_cfg.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    train_state = TrainState()
    ckpt_cfg = CheckpointManager.Config(enable=True, folder=str(folder), interval=INTERVAL, keep_latest_k=0)
    manager = ckpt_cfg.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                             lr_schedulers=lr_schedulers, states={"train_state": train_state}, sd_adapter=None)
    return model, optimizers, lr_schedulers, train_state, manager


def train(rank: int, world: int, out: Path) -> None:
    model, optimizers, lr_schedulers, train_state, manager = build(world, out / "ws2" / "checkpoint")
    gen = torch.Generator().manual_seed(1234)
    for step in range(1, STEPS + 1):
        batch = torch.randint(0, 64, (2 * world, 9), generator=gen)[rank * 2:(rank + 1) * 2]
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.step = step
        train_state.ntokens_seen += batch.numel() * world
        manager.save(step, last_step=False)
    manager.close()


def reshard(rank: int, world: int, out: Path) -> None:
    *_, train_state, loader = build(world, out / "ws2" / "checkpoint")
    if not loader.load(step=STEPS):
        raise RuntimeError("CheckpointManager.load found nothing to load")
    if train_state.step != STEPS:
        raise RuntimeError(f"resumed step {train_state.step}, expected {STEPS}")
    loader.close()
    saver = saver_like(loader, out / "ws1" / "checkpoint")
    saver.save(STEPS, last_step=False)
    saver.close()


def saver_like(loader, folder: Path):
    """A second CheckpointManager over the same (just loaded) model, optimizers and states, saving to ``folder``."""
    from torchtitan.components.checkpoint import LR_SCHEDULER, MODEL, OPTIMIZER, CheckpointManager

    cfg = CheckpointManager.Config(enable=True, folder=str(folder), interval=INTERVAL, keep_latest_k=0)
    states = loader.states
    saver = cfg.build(dataloader=None, model_parts=states[MODEL].model, optimizers=states[OPTIMIZER],
                      lr_schedulers=states[LR_SCHEDULER], states={"train_state": states["train_state"]},
                      sd_adapter=None)
    return saver


def main() -> None:
    out = out_dir()
    spawn(2, train, out)
    spawn(1, reshard, out)
    write_produced(out, {
        "ws2-step2": {"path": "ws2/checkpoint/step-2", "world_size": 2, "step": 2},
        "ws2-step4": {"path": "ws2/checkpoint/step-4", "world_size": 2, "step": 4},
        "ws1-step4": {"path": "ws1/checkpoint/step-4", "world_size": 1, "step": 4},
    })


if __name__ == "__main__":
    main()
