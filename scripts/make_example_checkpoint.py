"""Write an example DCP checkpoint to try ``ckptverify verify`` on.

    python scripts/make_example_checkpoint.py OUT_DIR [--ranks 2] [--size-mib 8]

One rank saves a plain model; two or more ranks shard it with FSDP2 (gloo, CPU) the way a real training
job does. Either way the checkpoint holds model weights, AdamW state after one step, and a few
non-tensor values, written by ``torch.distributed.checkpoint.save``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.multiproc import FileRendezvous, init_group


def _model(size_mib: int):
    import torch

    width = max(64, int((size_mib * (1 << 20) / 4 / 2) ** 0.5))
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(256, 64), torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, width),
        torch.nn.GELU(), torch.nn.Linear(width, 256),
    )


def _save(out: str, rank: int, world: int, size_mib: int, init_method: str | None) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model(size_mib)
    if world > 1:
        init_group(rank, world, init_method)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(rank))
    model(tokens).float().logsumexp(-1).mean().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "train": {"step": 1, "tokens_seen": 64 * world}},
             checkpoint_id=out)
    if world > 1:
        dist.barrier()  # no rank tears down while another is still in a collective
        dist.destroy_process_group()


def _worker(rank: int, out: str, world: int, size_mib: int, init_method: str) -> None:
    _save(out, rank, world, size_mib, init_method)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write the checkpoint into (created)")
    parser.add_argument("--ranks", type=int, default=1, help="number of ranks (gloo, CPU) [1]")
    parser.add_argument("--size-mib", type=int, default=8, help="approximate model size in MiB [8]")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error("--ranks must be at least 1")
    if args.ranks == 1:
        _save(args.out, 0, 1, args.size_mib, None)
    else:
        import torch.multiprocessing as mp

        with FileRendezvous() as init_method:  # the ranks meet through a file: no port to race for
            mp.spawn(_worker, args=(args.out, args.ranks, args.size_mib, init_method), nprocs=args.ranks)
    print(f"wrote a {args.ranks}-rank DCP checkpoint to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
