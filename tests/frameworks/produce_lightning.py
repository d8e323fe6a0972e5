"""Real PyTorch Lightning 2.6 checkpoints, CPU, gloo.

Writes (``python produce_lightning.py OUT``):

- ``ws2/checkpoints/step=2.ckpt/``, ``ws2/checkpoints/step=4.ckpt/``: ``ModelParallelStrategy`` (FSDP2) on 2 ranks with
  ``ModelCheckpoint(every_n_train_steps=2)``; each is a DCP folder plus Lightning's ``meta.pt`` (global step,
  loop state, LR-scheduler state);
- ``ws1/checkpoints/step=4.ckpt/``: a 1-rank ``ModelParallelStrategy`` job that resumed ``ws2``'s step 4
  (``fit(ckpt_path=...)``, DCP reshards 2 -> 1) and saved it again with ``trainer.save_checkpoint``;
- ``plain/checkpoints/step=2.ckpt``, ``step=4.ckpt``: the default single-device strategy's ``.ckpt`` files.

Lightning launches extra ranks by running this script again with the same arguments, so each job is its own
``--stage`` and the top level only runs the stages one after another in fresh processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import write_produced

STEPS = 4


def lightning_module(sharded: bool):
    import pytorch_lightning as pl

    class TinyRegressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

        def configure_model(self) -> None:
            if not sharded:
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(7)
            data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
            return DataLoader(data, batch_size=4)

    return TinyRegressor()


def trainer(strategy, devices: int, dirpath: Path | None, **kwargs):
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    callbacks = []
    if dirpath is not None:
        callbacks.append(ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=2, save_top_k=-1))
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS,
                      callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=dirpath is not None, default_root_dir=kwargs.pop("root"), **kwargs)


def model_parallel():
    from pytorch_lightning.strategies import ModelParallelStrategy

    return ModelParallelStrategy(process_group_backend="gloo")


def stage_ws2(out: Path) -> None:
    t = trainer(model_parallel(), 2, out / "ws2" / "checkpoints", root=out / "ws2")
    t.fit(lightning_module(sharded=True))


def stage_ws1(out: Path) -> None:
    t = trainer(model_parallel(), 1, None, root=out / "ws1")
    t.fit(lightning_module(sharded=True), ckpt_path=out / "ws2" / "checkpoints" / "step=4.ckpt")
    if t.global_step != STEPS:
        raise RuntimeError(f"resumed at global step {t.global_step}, expected {STEPS}")
    t.save_checkpoint(out / "ws1" / "checkpoints" / "step=4.ckpt")


def stage_plain(out: Path) -> None:
    t = trainer("auto", 1, out / "plain" / "checkpoints", root=out / "plain")
    t.fit(lightning_module(sharded=False))


STAGES = {"ws2": stage_ws2, "ws1": stage_ws1, "plain": stage_plain}


def main() -> None:
    args = sys.argv[1:]
    if len(args) == 3 and args[1] == "--stage":
        STAGES[args[2]](Path(args[0]))
        return
    if len(args) != 1:
        raise SystemExit(f"usage: {sys.argv[0]} OUT_DIR [--stage {'|'.join(STAGES)}]")
    out = Path(args[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stage in STAGES:
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
        subprocess.run([sys.executable, __file__, str(out), "--stage", stage], check=True, env=env)
    write_produced(out, {
        "ws2-step2": {"path": "ws2/checkpoints/step=2.ckpt", "world_size": 2, "step": 2},
        "ws2-step4": {"path": "ws2/checkpoints/step=4.ckpt", "world_size": 2, "step": 4},
        "ws1-step4": {"path": "ws1/checkpoints/step=4.ckpt", "world_size": 1, "step": 4},
        "plain-step2": {"path": "plain/checkpoints/step=2.ckpt", "world_size": 1, "step": 2},
        "plain-step4": {"path": "plain/checkpoints/step=4.ckpt", "world_size": 1, "step": 4},
    })


if __name__ == "__main__":
    main()
