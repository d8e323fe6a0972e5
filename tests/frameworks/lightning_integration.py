"""Lightning's ``ModelParallelStrategy`` (FSDP2, gloo, CPU) training with ckptverify's
``VerifyCheckpointsCallback``: the model (:func:`module`) and one ``fit`` of it (:func:`run_stage`), which
``tests/helpers/lightning_model_parallel.py`` runs stage after stage in ranks forked with the environment torchrun
gives (Lightning takes the group it finds).

Each rank writes ``OUT/STAGE-rank{R}.json``: the verdicts it got, the warnings ckptverify raised, the error that
stopped it (type and message), the global step reached, and whether the model's weights are still those it was
built with (nothing loaded).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def module():
    import pytorch_lightning as pl

    class TinyRegressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
            self.initial = [p.detach().clone() for p in self.net.parameters()]

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def untouched(self) -> bool:
            return all(torch.equal(p.full_tensor() if hasattr(p, "full_tensor") else p.detach(), q)
                       for p, q in zip(self.net.parameters(), self.initial, strict=True))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(7)
            data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
            return DataLoader(data, batch_size=4)

    return TinyRegressor()


def run_stage(out: Path, world: int, stage: str, max_steps: int, ckpt: Path | None = None) -> dict[str, Any]:
    """One ``fit`` of ``lightning_integration``'s model on ``world`` ranks; return (and write) this rank's result."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.strategies import ModelParallelStrategy

    from ckptverify.errors import VerifyFailedWarning
    from ckptverify.integrations.lightning import VerifyCheckpointsCallback
    from ckptverify.options import VerifyOptions

    verify = VerifyCheckpointsCallback(verify=VerifyOptions(on_failure="raise"), fingerprint=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=ModelParallelStrategy(process_group_backend="gloo"),
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out,
        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", filename="{step}", every_n_train_steps=2,
                                   save_top_k=-1), verify])
    model = module()
    result: dict[str, Any] = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, ckpt_path=ckpt)
        except Exception as exc:  # reported to the test, which judges it
            result["error"] = {"type": type(exc).__name__, "message": str(exc)}
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, VerifyFailedWarning)]
    result["verdicts"] = [v.to_dict() for v in verify.verdicts]
    result["global_step"] = trainer.global_step
    result["untouched"] = model.untouched() if result["error"] else None
    (out / f"{stage}-rank{trainer.global_rank}.json").write_text(json.dumps(result, indent=1))
    return result
