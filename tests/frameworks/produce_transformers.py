"""Real transformers Trainer checkpoints (``checkpoint-N/`` folders), CPU, one process, no downloads.

A tiny GPT-2 built from a config in code trains 4 steps with ``save_steps=2``: ``checkpoint-2/`` and
``checkpoint-4/`` hold ``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``,
``trainer_state.json``, ``training_args.bin`` and the model's ``config.json``.

Writes under ``OUT`` (``python produce_transformers.py OUT``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import out_dir, write_produced


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seq: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    out = out_dir()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(out / "run"), max_steps=4, save_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, use_cpu=True, report_to=[], logging_steps=1, seed=0,
                             disable_tqdm=True, save_only_model=False)
    Trainer(model=model, args=args, train_dataset=TokenDataset()).train()
    write_produced(out, {f"checkpoint-{s}": {"path": f"run/checkpoint-{s}", "world_size": 1, "step": s}
                         for s in (2, 4)})


if __name__ == "__main__":
    main()
