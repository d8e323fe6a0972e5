"""Real Megatron Core 0.19 ``dist_checkpointing`` checkpoints (``torch_dist`` backend), CPU, gloo.

A tiny ``GPTModel`` (local layer spec, CPU initialization) takes a few AdamW steps with tensor parallelism 2 on
2 ranks and is saved with ``dist_checkpointing.save`` the way Megatron's training loop saves it: the model's
sharded state dict plus plain values (``iteration``, ``checkpoint_version``) that go to ``common.pt``.

Megatron Core assumes CUDA in two places of its save path even for CPU tensors (``torch.cuda.synchronize``
after staging, and a flag tensor put on ``torch.cuda.current_device()`` after writing). This process has no
GPU, so both are pointed at the CPU here, in this producer only.

Writes (``python produce_megatron.py OUT``):

- ``tp2/iter_0000002``, ``tp2/iter_0000004``: saved by the 2-rank TP=2 job;
- ``tp1/iter_0000004``: a 1-rank job that loaded ``tp2/iter_0000004`` with ``dist_checkpointing.load``
  (resharding TP 2 -> 1) and saved it again at once.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import out_dir, spawn, write_produced

STEPS = 4
VOCAB, SEQ = 64, 16


def cpu_only_cuda_calls() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def build(tp: int):
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu_only_cuda_calls()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=tp, params_dtype=torch.float32,
                               attention_dropout=0.0, hidden_dropout=0.0)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ)


def state(model, iteration: int) -> dict:
    return {"model": model.sharded_state_dict(), "iteration": iteration, "checkpoint_version": 3.0}


def train(rank: int, world: int, out: Path) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    model = build(tp=world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, STEPS + 1):
        # Megatron's attention forks its CUDA RNG tracker even with dropout off, so a forward pass cannot run
        # on a CPU-only torch: the update comes from a loss on the parameters themselves. What is saved (the
        # sharded state dict of a real GPTModel, TP-sharded) is what matters here.
        loss = sum((p.float() - 0.01 * step).square().mean() for p in model.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:
            path = out / "tp2" / f"iter_{step:07d}"
            path.mkdir(parents=True, exist_ok=True)
            dist_checkpointing.save(state(model, step), str(path))
    parallel_state.destroy_model_parallel()


def reshard(rank: int, world: int, out: Path) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    model = build(tp=world)
    loaded = dist_checkpointing.load(state(model, 0), str(out / "tp2" / f"iter_{STEPS:07d}"))
    if loaded["iteration"] != STEPS:
        raise RuntimeError(f"loaded iteration {loaded['iteration']}, expected {STEPS}")
    model.load_state_dict(loaded["model"])
    path = out / "tp1" / f"iter_{STEPS:07d}"
    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state(model, STEPS), str(path))
    parallel_state.destroy_model_parallel()


def main() -> None:
    out = out_dir()
    spawn(2, train, out)
    spawn(1, reshard, out)
    write_produced(out, {
        "tp2-step2": {"path": "tp2/iter_0000002", "world_size": 2, "step": 2},
        "tp2-step4": {"path": "tp2/iter_0000004", "world_size": 2, "step": 4},
        "tp1-step4": {"path": "tp1/iter_0000004", "world_size": 1, "step": 4},
    })


if __name__ == "__main__":
    main()
