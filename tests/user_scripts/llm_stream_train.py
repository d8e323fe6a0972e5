"""Pretrain a small GPT on an endless token stream, the way language-model trainers write it.

    python llm_stream_train.py --steps 20
    torchrun --nproc_per_node 2 llm_stream_train.py --steps 20            # DDP
    PARALLEL=fsdp2 torchrun --nproc_per_node 2 llm_stream_train.py        # FSDP2 (fully_shard)

An IterableDataset whose position is its state, read through torchdata's StatefulDataLoader with 2 workers;
ACCUM micro-batches per optimizer step (DDP ``no_sync`` on all but the last), bf16 autocast on CPU, AdamW with
a LambdaLR warmup-cosine schedule, gradient clipping and dropout.

``PLANT`` plants one bug, on the ranks ``PLANT_RANKS`` names (``1`` or ``all``; default ``all``):

* ``rng``: torch is re-seeded after ``run.restore()``;
* ``data``: the loop reads its batches from an iterator of the loader made before ``run.restore()``, so a
  resumed rank reads from the start of the stream again;
* ``scheduler``: the LambdaLR is rebuilt after ``run.restore()`` (the loop steps a scheduler the TrainState
  does not hold);
* ``held``: a running count of tokens seen, kept outside the TrainState, scales the loss;
* ``restore``: the stream's ``load_state_dict`` drops the position it was given;
* ``accum``: each ``run.steps()`` item is one micro-batch (the optimizer steps every ACCUM of them), and saves
  fall between micro-batches;
* ``replaced-loader``: the loader is rebuilt after ``run.restore()``;
* ``noisy``: the attention scores get a little noise drawn from the OS (a nondeterministic computation).
"""

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

import ckptverify as cv

VOCAB, CTX, DIM, LAYERS, HEADS = 97, 16, 32, 2, 4
MICRO, ACCUM, WARMUP = 2, 4, 3
PLANT = os.environ.get("PLANT", "")
PLANT_RANKS = os.environ.get("PLANT_RANKS", "all")
PARALLEL = os.environ.get("PARALLEL", "ddp")


def planted(name, rank):
    return name == PLANT and (PLANT_RANKS == "all" or str(rank) == PLANT_RANKS)


class TokenStream(IterableDataset):
    """An endless stream of token windows from a fixed pseudo-corpus; each worker reads every n-th window.
    Its position is its state (saved by StatefulDataLoader in the workers)."""

    def __init__(self, rank, world, forget=False):
        self.rank, self.world = rank, world
        self.pos = 0
        self.forget = forget

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        while True:
            i = (self.pos * nw + wid) * self.world + self.rank
            g = torch.Generator().manual_seed(1000 + i)
            window = torch.randint(0, VOCAB, (CTX + 1,), generator=g)
            self.pos += 1
            yield window[:-1], window[1:]

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        if not self.forget:
            self.pos = state["pos"]


class Block(nn.Module):
    def __init__(self, noisy=False):
        super().__init__()
        self.noisy = noisy
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(DIM // HEADS)
        if self.noisy:
            att = att + int.from_bytes(os.urandom(2), "little") * 1e-7
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(-1))
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, DIM))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, noisy=False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(CTX, DIM)
        self.blocks = nn.ModuleList(Block(noisy) for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def warmup_cosine(total):
    def f(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, total - WARMUP)))
    return f


def make_loader(ds):
    return StatefulDataLoader(ds, batch_size=MICRO, num_workers=2)


def train(run):
    torch.set_num_threads(1)
    rank, world = run.rank, run.world_size
    torch.manual_seed(0)
    model = GPT(noisy=planted("noisy", rank))
    if world > 1 and PARALLEL == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif world > 1:
        model = DistributedDataParallel(model)
    torch.manual_seed(1 + rank)  # dropout differs per rank, as it should
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(run.total_steps))
    ds = TokenStream(rank, world, forget=planted("restore", rank))
    loader = make_loader(ds)
    early = iter(loader) if planted("data", rank) else None
    run.restore(cv.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader))
    if run.step > 0 and planted("rng", rank):
        torch.manual_seed(1234)
    if run.step > 0 and planted("scheduler", rank):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(run.total_steps))
    if run.step > 0 and planted("replaced-loader", rank):
        loader = make_loader(TokenStream(rank, world))
    tokens_seen = 0
    if PLANT == "accum":
        train_micro(run, model, opt, sched, loader, world)
        return
    for batches in run.steps(loader, micro_batches=ACCUM):
        if early is not None:
            batches = [next(early) for _ in range(ACCUM)]
        for i, (x, y) in enumerate(batches):
            sync = i == ACCUM - 1 or world == 1 or PARALLEL != "ddp"
            with model.no_sync() if not sync else _nothing():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1)) / ACCUM
                if planted("held", rank):
                    tokens_seen += x.numel()
                    loss = loss * (1 + 1e-3 * (tokens_seen % 7))
                loss.backward()
        gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        run.record(loss=loss.detach(), grad_norm=gnorm, batch=batches)


def train_micro(run, model, opt, sched, loader, world):
    """One run.steps() item per micro-batch; the optimizer steps every ACCUM of them."""
    for x, y in run.steps(loader):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1)) / ACCUM
        loss.backward()
        if (run.step + 1) % ACCUM == 0:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        run.record(loss=loss.detach(), batch=(x, y))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    cv.Run.main(train, steps=ap.parse_args().steps)
    if dist.is_initialized():
        dist.destroy_process_group()
