"""Real accelerate 1.15 checkpoints, CPU, gloo.

On CPU accelerate silently ignores its FSDP plugin, so the two things users get are produced the way each is
reached on CPU:

- ``ws2/state-step2``, ``ws2/state-step4``: ``Accelerator.save_state`` after 2 and 4 steps of a 2-rank job
  (``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``, ``random_states_0.pkl``, ``random_states_1.pkl``);
- ``ws2/fsdp-step2/{pytorch_model_fsdp_0,optimizer_0}``, ``ws2/fsdp-step4/...``: ``save_fsdp_model`` and
  ``save_fsdp_optimizer`` (``SHARDED_STATE_DICT``, DCP) on the same job's model, sharded by hand with FSDP2;
- ``ws1/fsdp-step4/...``: a 1-rank job that loaded ``ws2/fsdp-step4`` with ``load_fsdp_model`` and
  ``load_fsdp_optimizer`` (DCP reshards 2 -> 1) and saved it again with the save functions.

Writes under ``OUT`` (``python produce_accelerate.py OUT``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import out_dir, spawn, write_produced

STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def shard(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp_plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")


def optimizer_and_scheduler(params):
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def train(rank: int, world: int, out: Path) -> None:
    from accelerate import Accelerator
    from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

    accelerator = Accelerator(cpu=True)
    if accelerator.num_processes != world:
        raise RuntimeError(f"accelerate sees {accelerator.num_processes} processes, expected {world}")
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
    model = make_model()
    opt, sched = optimizer_and_scheduler(model.parameters())
    model, opt, loader, sched = accelerator.prepare(model, opt, DataLoader(data, batch_size=4), sched)

    # The same training on an FSDP2 model, sharded by hand, saved with accelerate's FSDP save functions.
    sharded = shard(make_model(), world)
    sopt, ssched = optimizer_and_scheduler(sharded.parameters())
    plugin = fsdp_plugin()

    for step, (x, y) in enumerate(loader, start=1):
        for m, o, s in ((model, opt, sched), (sharded, sopt, ssched)):
            loss = nn.functional.mse_loss(m(x), y)
            accelerator.backward(loss) if m is model else loss.backward()
            o.step()
            s.step()
            o.zero_grad()
        if step % 2 == 0:
            accelerator.save_state(out / "ws2" / f"state-step{step}")
            save_fsdp_model(plugin, accelerator, sharded, out / "ws2" / f"fsdp-step{step}")
            save_fsdp_optimizer(plugin, accelerator, sopt, sharded, out / "ws2" / f"fsdp-step{step}")
        if step == STEPS:
            break


def reshard(rank: int, world: int, out: Path) -> None:
    from accelerate import Accelerator
    from accelerate.utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer

    accelerator = Accelerator(cpu=True)
    plugin = fsdp_plugin()
    sharded = shard(make_model(), world)
    sopt, _ = optimizer_and_scheduler(sharded.parameters())
    src, dst = out / "ws2" / f"fsdp-step{STEPS}", out / "ws1" / f"fsdp-step{STEPS}"
    load_fsdp_model(plugin, accelerator, sharded, src)
    load_fsdp_optimizer(plugin, accelerator, sopt, sharded, src)
    save_fsdp_model(plugin, accelerator, sharded, dst)
    save_fsdp_optimizer(plugin, accelerator, sopt, sharded, dst)


def main() -> None:
    out = out_dir()
    spawn(2, train, out)
    spawn(1, reshard, out)
    produced = {
        f"state-step{s}": {"path": f"ws2/state-step{s}", "world_size": 2, "step": s} for s in (2, 4)
    }
    for ws, steps in ((2, (2, 4)), (1, (4,))):
        for s in steps:
            produced[f"ws{ws}-model-step{s}"] = {"path": f"ws{ws}/fsdp-step{s}/pytorch_model_fsdp_0",
                                                 "world_size": ws, "step": s}
            produced[f"ws{ws}-optimizer-step{s}"] = {"path": f"ws{ws}/fsdp-step{s}/optimizer_0",
                                                     "world_size": ws, "step": s}
    write_produced(out, produced)


if __name__ == "__main__":
    main()
