"""A tiny GPT-style causal language model and its training step: the built-in workload.

Small enough that a dozen steps take well under a second on one CPU core, yet it has everything whose state a
checkpoint must carry for an exact resume: parameters, AdamW moments and step counts, a LambdaLR schedule, dropout
(global RNG) and a data position.

Determinism (same seed, fresh processes):

* The parameters are initialised from a private CPU ``torch.Generator`` and then moved to ``device``, so the
  initial weights are the same on CPU and CUDA and do not depend on the global RNG.
* Attention is written with explicit matmuls, a boolean causal mask and ``softmax`` rather than
  ``F.scaled_dot_product_attention``: every op here is deterministic on CPU, and on CUDA it avoids the fused
  attention kernels whose backward passes use atomics (memory-efficient and flash backends). Matmuls on CUDA are
  deterministic for a fixed shape and cuBLAS workspace configuration (``CUBLAS_WORKSPACE_CONFIG=:4096:8``).
* Dropout draws from the global RNG of ``device``, which :func:`build_training` seeds with ``seed + rank``; that RNG
  state is part of what a checkpoint has to restore (per rank).
* On CPU, runs are bitwise reproducible for a fixed intra-op thread count (``torch.set_num_threads``), not across
  thread counts: LayerNorm's backward splits its weight/bias gradient reduction by thread, so 1 and 2 threads give
  gradients that differ in the last bits (measured on torch 2.13).
* FSDP2 on gloo: with two ranks each gradient element is the sum of exactly two addends, and floating-point addition
  is commutative, so the reduce-scatter result does not depend on the order in which the ranks' contributions
  arrive; the 1/world_size scaling is a fixed multiplication. Two launches therefore give bitwise-identical losses
  (checked in ``tests/processes/test_examples.py``). With more than two ranks the sum of three or more addends
  depends on the reduction order, which gloo fixes by its algorithm for a given world size and message size, not
  by contract.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ckptverify.examples.corpus import TokenDataset
from ckptverify.state.distributed import rank_world

__all__ = ["TinyGPT", "TinyGPTConfig", "Training", "WarmupCosine", "build_training", "lm_loss", "make_loader",
           "train_step", "wrap_fsdp2"]


@dataclass(frozen=True)
class TinyGPTConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.d_model, self.n_layers, self.n_heads, self.seq_len) < 1:
            raise ValueError("all sizes must be positive")
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("dropout must be in [0, 1)")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.d_model // config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        mask = torch.ones(config.seq_len, config.seq_len, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        # Explicit attention (not scaled_dot_product_attention): deterministic on CPU and on CUDA, see module doc.
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        scores = scores.masked_fill(~self.causal_mask[:t, :t], float("-inf"))
        probs = self.attn_dropout(F.softmax(scores, dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(b, t, d)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + learned position embeddings, ``n_layers`` pre-LN blocks, final LayerNorm, untied output head.

    ``forward(input_ids)`` takes int64 ``(batch, t)`` with ``t <= seq_len`` and returns logits ``(batch, t, vocab)``.
    The head is untied so that every parameter has exactly one FQN in state dicts.
    """

    def __init__(self, config: TinyGPTConfig, *, seed: int = 0, block_cls: type[Block] | None = None) -> None:
        super().__init__()
        block_cls = block_cls or Block
        self.config = config
        # The layers' default initialisation draws from the global CPU RNG; fork it so that building a model
        # leaves the caller's RNG stream untouched (the weights are overwritten by reset_parameters anyway).
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(block_cls(config) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.d_model)
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 style initialisation from a private CPU generator (independent of the global RNG and device)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                std = resid_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
            elif name.endswith("bias"):
                p.zero_()
            else:  # LayerNorm weights
                p.fill_(1.0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[-1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier: linear warmup ``(step + 1) / warmup_steps``, then cosine from 1 down to ``min_ratio``.

    A callable object rather than a lambda, so ``LambdaLR.state_dict()`` records its parameters.
    """

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class Training:
    """Everything one rank needs to train; :func:`train_step` advances it by one optimizer step."""

    model: nn.Module
    optimizer: torch.optim.AdamW
    #: ``None`` when the loop sets the learning rate itself.
    scheduler: torch.optim.lr_scheduler.LambdaLR | None
    dataset: TokenDataset
    device: torch.device
    grad_clip: float = 1.0


def wrap_fsdp2(model: nn.Module, mesh: Any, **kwargs: Any) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to each transformer block, then to the root; returns ``model``.

    ``mesh`` is a 1-D ``DeviceMesh`` (``init_device_mesh("cpu", (world,))`` with gloo, or ``"cuda"`` with NCCL);
    ``kwargs`` go to every ``fully_shard`` call. Build the optimizer after this, over the sharded parameters.
    """
    from torch.distributed.fsdp import fully_shard

    blocks: Iterable[nn.Module] = getattr(model, "blocks", ())
    for block in blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def build_training(config: TinyGPTConfig, *, lr: float = 3e-3, warmup_steps: int = 5, total_steps: int = 100,
                   weight_decay: float = 0.1, grad_clip: float = 1.0, seed: int = 0,
                   device: str | torch.device = "cpu", num_sequences: int = 2048, mesh: Any = None,
                   block_cls: type[Block] | None = None) -> Training:
    """Model, AdamW, warmup+cosine ``LambdaLR`` and the token dataset, all from ``seed``.

    The model is initialised from ``seed`` (identically on every rank), moved to ``device`` and, when ``mesh`` is
    given, sharded with :func:`wrap_fsdp2` before the optimizer is built. The dataset is ``TokenDataset``
    (``num_sequences`` sequences of ``config.seq_len`` tokens, same ``seed``). Side effect: the global RNG of
    every device (used by dropout) is seeded with ``seed + rank``. ``block_cls`` replaces the transformer block
    (a :class:`Block` subclass; the planted-bug workloads use it).
    """
    device = torch.device(device)
    model = TinyGPT(config, seed=seed, block_cls=block_cls).to(device)
    if mesh is not None:
        wrap_fsdp2(model, mesh)
    torch.manual_seed(seed + rank_world()[0])
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr,
        betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps))
    dataset = TokenDataset(num_sequences, config.seq_len, config.vocab_size, seed)
    return Training(model, optimizer, scheduler, dataset, device, grad_clip)


def make_loader(dataset: TokenDataset, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                shuffle: bool = True, loader_cls: type = DataLoader, **kwargs: Any) -> Any:
    """A loader over this rank's part of ``dataset``: a seeded :class:`~ckptverify.state.sampler.ResumableSampler`
    (sharded like ``DistributedSampler``, ``drop_last``, resumable mid-epoch) and fixed-size batches.
    ``loader_cls`` may be ``torchdata.stateful_dataloader.StatefulDataLoader``; ``kwargs`` go to it. Call
    ``loader.sampler.set_epoch(epoch)`` between epochs for a new order.
    """
    from ckptverify.state.sampler import ResumableSampler

    sampler = ResumableSampler(len(dataset), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                               drop_last=True)
    return loader_cls(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)


def train_step(training: Training, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float | torch.Tensor]:
    """One optimizer step on ``batch = (input_ids, targets)`` (:func:`optimizer_step` after the backward pass).

    Returns ``{"loss": 0-d tensor, "grad_norm": 0-d tensor (before clipping), "lr": float}``, where ``lr`` is the
    learning rate this step used (read before ``scheduler.step()``). Tensors stay on the device: nothing here
    forces a host synchronisation.
    """
    model = training.model
    model.train()
    input_ids, targets = (z.to(training.device, non_blocking=True) for z in batch)
    loss = lm_loss(model, input_ids, targets)
    loss.backward()
    return optimizer_step(training, loss.detach())


def lm_loss(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy of ``model`` on ``input_ids`` against ``targets`` (mean over tokens)."""
    logits = model(input_ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def optimizer_step(training: Training, loss: torch.Tensor) -> dict[str, float | torch.Tensor]:
    """Clip the gradients, step the optimizer and the scheduler (when there is one), clear the gradients; returns
    the step's ``loss``, ``grad_norm`` and ``lr`` as :func:`train_step` does."""
    model, optimizer = training.model, training.optimizer
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip)
    full_tensor = getattr(grad_norm, "full_tensor", None)
    if full_tensor is not None:  # FSDP2: a DTensor norm over sharded gradients
        grad_norm = full_tensor()
    lr = float(optimizer.param_groups[0]["lr"])
    optimizer.step()
    if training.scheduler is not None:
        training.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "grad_norm": grad_norm.detach(), "lr": lr}
