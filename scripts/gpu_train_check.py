#!/usr/bin/env python
"""Training, checkpoint and device-remap checks on GPUs (Python parts of scripts/gpu_check.sh and
scripts/gpu_check_multi.sh).

Each part prints what it measured and exits non-zero when its check fails:

* ``train`` (one GPU): a one-rank job (``torch.distributed``, world size 1, NCCL) trains a transformer of about 1B
  bf16 parameters sharded with FSDP2 (``fully_shard``), every block under non-reentrant activation checkpointing
  (``checkpoint_wrapper``), through the ``ckptverify.Run`` protocol once per trace level: ``none`` (no trace),
  ``state`` and ``comm``, each level with a fresh model built from the same seed. Each step ends with an all-reduce of
  the loss (on one rank FSDP2 issues no collective: this is the one level ``comm`` traces; the part checks that its
  trace has ``comm.*`` sites, and that each traced level wrote a row per step). Per level, one line: the median
  step time of the timed steps after the warm-up (each timed between device synchronizations, ``run.record``
  included), the peak device memory of its steps
  (``torch.cuda.max_memory_allocated``, reset before the level's first step), and the host synchronizations per
  step under ``torch.cuda.set_sync_debug_mode("warn")`` (counted on extra steps after the timed ones, so the
  warnings do not slow the timed steps). Fails when a level raises, or its loss is not finite.
* ``saveload`` (one GPU): ``ckptverify.save`` of a TrainState holding a model of about 1.5 GiB on the GPU, then
  ``ckptverify.load`` into a fresh model; prints the peak device memory of each as a ratio of the state's bytes.
  Fails when the load's peak (the fresh model it loads into, plus what the load itself allocates, counted from
  before that model was built) exceeds 1.3x the state's bytes, or a restored parameter differs from the saved one.
* ``remap`` (two GPUs): a process seeing ``CUDA_VISIBLE_DEVICES=A,B`` saves a TrainState on ``cuda:1`` (physical
  B) after drawing from that device's CUDA generator; a fresh process seeing only ``B`` (now ``cuda:0``, the same
  GPU) loads it and must get the saved CUDA stream back exactly (state and the next draw); a third seeing only
  ``A`` (another GPU) loads it, must get the stream restored too, and its load report must carry a
  ``restore-device`` finding. ``A`` and ``B`` are the first two GPUs visible to this script.

``--dry-run`` (or ``CKPTVERIFY_GPU_DRY_RUN=1``) runs the same code on the CPU with tiny sizes: ``train`` over Gloo
with a model of a few thousand parameters (memory as the process's RSS; synchronizations "n/a"), ``saveload``
with a tiny model (memory not measured), ``remap`` saving and loading the CPU stream in fresh processes (the CUDA
parts skipped, and said so). tests/processes/test_gpu_scripts.py runs them.

    python scripts/gpu_train_check.py --part train|saveload|remap [--dry-run]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as `python scripts/gpu_train_check.py` from a checkout without an install
    sys.path.insert(0, ROOT)

PARTS = ("train", "saveload", "remap")
LEVELS = ("none", "state", "comm")
#: The most device memory a load may peak at, as a multiple of the state's bytes.
LOAD_PEAK_LIMIT = 1.3


def _say(*args: Any) -> None:
    print(*args, flush=True)


def _rss_mib() -> str:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return f"{int(line.split()[1]) / 1024:.0f} MiB RSS"
    except OSError:
        pass
    return "n/a"


# --------------------------------------------------------------------------------------------------- train


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    d_model: int
    heads: int
    layers: int
    seq: int
    batch: int


#: About 1.04B parameters: 18 blocks of 12 * 2048**2, an embedding and an untied head of 32000 x 2048.
GPU_MODEL = ModelConfig(vocab=32000, d_model=2048, heads=16, layers=18, seq=2048, batch=4)
DRY_MODEL = ModelConfig(vocab=128, d_model=32, heads=4, layers=2, seq=16, batch=2)


def _transformer(cfg: ModelConfig) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = cfg.d_model
            self.norm1 = nn.RMSNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.norm2 = nn.RMSNorm(d)
            self.up = nn.Linear(d, 4 * d, bias=False)
            self.down = nn.Linear(4 * d, d, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, cfg.heads, d // cfg.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.layers))
            self.norm = nn.RMSNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return Transformer()


def _build(cfg: ModelConfig, dev: Any, mesh: Any) -> tuple[Any, Any]:
    """The model (bf16, each block activation-checkpointed and sharded, then the root) and its optimizer."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with torch.device(dev):
        model = _transformer(cfg)
    model.to(torch.bfloat16)
    for i, block in enumerate(model.blocks):
        wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        fully_shard(wrapped, mesh=mesh)
        model.blocks[i] = wrapped
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    return model, optimizer


def _step(model: Any, optimizer: Any, tokens: Any) -> Any:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    # The loss averaged over the ranks, as a training loop logs it: on one rank FSDP2 issues no collective of its
    # own, so this is the collective that level ``comm`` traces.
    reported = loss.detach().clone()
    dist.all_reduce(reported)
    return reported / dist.get_world_size()


def _train_level(level: str, cfg: ModelConfig, dev: Any, mesh: Any, counts: tuple[int, int, int],
                 trace_root: str) -> dict[str, Any]:
    """Train one level's fresh model for warm-up + timed + sync-counted steps; what it measured."""
    import torch

    import ckptverify as cv
    from ckptverify.resume.run import RunConfig

    cuda = dev.type == "cuda"
    warmup, timed, counted = counts
    if cuda:
        torch.cuda.synchronize(dev)
    model, optimizer = _build(cfg, dev, mesh)
    gen = torch.Generator(device=dev).manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), device=dev, generator=gen)
    state = cv.TrainState(model=model, optimizer=optimizer)
    untraced = level == "none"
    run = cv.Run(RunConfig(name=level, stop_step=warmup + timed + counted, level="state" if untraced else level,
                           trace_dir=None if untraced else os.path.join(trace_root, level)))
    times: list[float] = []
    syncs: list[int] = []
    loss = None
    try:
        run.restore(state)
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        for step in run.steps():
            if step <= warmup + timed:
                if cuda:
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                loss = _step(model, optimizer, tokens)
                run.record(loss=loss, batch=tokens)
                if cuda:
                    torch.cuda.synchronize(dev)
                if step > warmup:
                    times.append(time.perf_counter() - t0)
            else:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    if cuda:
                        torch.cuda.set_sync_debug_mode("warn")
                    try:
                        loss = _step(model, optimizer, tokens)
                        run.record(loss=loss, batch=tokens)
                    finally:
                        if cuda:
                            torch.cuda.set_sync_debug_mode(0)
                syncs.append(sum("synchroniz" in str(w.message) for w in seen))
    finally:
        run.close()
    if cuda:
        torch.cuda.synchronize(dev)
    final = float(loss) if loss is not None else float("nan")
    trace = "no trace"
    if not untraced:  # what the level recorded: a row per step, and its sites
        from ckptverify.trace import open_trace, rank_store_path

        stored = open_trace(rank_store_path(os.path.join(trace_root, level), 0))
        comm = sum(s.name.startswith("comm.") for s in stored.sites)
        trace = f"{len(stored)} rows, {len(stored.sites)} sites ({comm} comm.*)"
        if len(stored) != warmup + timed + counted:
            raise RuntimeError(f"level {level}: the trace holds {len(stored)} rows, not {warmup + timed + counted}")
        if level == "comm" and not comm:
            raise RuntimeError("level comm: the trace holds no comm.* site for the steps' all-reduce")
    out = {
        "step_s": statistics.median(times) if times else float("nan"),
        "memory": (f"{torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB peak" if cuda else _rss_mib()),
        "syncs": (f"{statistics.median(syncs):.1f}" if cuda and syncs else "n/a"),
        "loss": final,
        "trace": trace,
    }
    del run, state, model, optimizer, tokens
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def part_train(dry: bool, steps: str | None = None) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cfg = DRY_MODEL if dry else GPU_MODEL
    counts = (1, 2, 1) if dry else (3, 6, 2)
    if steps:
        counts = tuple(int(x) for x in steps.split(","))  # type: ignore[assignment]
        if len(counts) != 3 or min(counts) < 0 or counts[1] < 1:
            _say(f"--steps takes warm-up,timed,sync-counted (timed at least 1), got {steps!r}")
            return 2
    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "gloo" if dry else "nccl"
    results: dict[str, dict[str, Any] | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            mesh = init_device_mesh(dev.type, (1,))
            with torch.device("meta"):
                params = sum(p.numel() for p in _transformer(cfg).parameters())
            _say(f"train: {params:,} bf16 parameters ({cfg}), FSDP2 over {backend} (world size 1), "
                 f"activation checkpointing (non-reentrant); steps per level: warm-up {counts[0]}, timed {counts[1]}, "
                 f"sync-counted {counts[2]}")
            for level in LEVELS:
                started = time.perf_counter()
                try:
                    results[level] = _train_level(level, cfg, dev, mesh, counts, tmp)  # type: ignore[arg-type]
                except Exception:
                    traceback.print_exc()
                    results[level] = None
                _say(f"  level {level}: done in {time.perf_counter() - started:.1f} s")
        finally:
            dist.destroy_process_group()
    failed = []
    base = results.get("none")
    for level in LEVELS:
        r = results.get(level)
        if r is None:
            _say(f"train level {level:<5}: CRASHED")
            failed.append(level)
            continue
        ratio = f" ({r['step_s'] / base['step_s']:.3f}x none)" if base and level != "none" else ""
        bad = not math.isfinite(r["loss"])
        _say(f"train level {level:<5}: step {r['step_s'] * 1e3:.1f} ms{ratio}, memory {r['memory']}, "
             f"host syncs/step {r['syncs']}, loss {r['loss']:.4f}, {r['trace']}{'  NOT FINITE' if bad else ''}")
        if bad:
            failed.append(level)
    if failed:
        _say(f"FAIL: train levels {', '.join(failed)}")
        return 1
    return 0


# ------------------------------------------------------------------------------------------------ saveload


def _state_bytes(model: Any) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _linears(n: int, width: int, dev: Any, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    with torch.device(dev):
        return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(n)))


def part_saveload(dry: bool) -> int:
    import torch

    import ckptverify as cv

    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    cuda = dev.type == "cuda"
    n, width = (4, 64) if dry else (6, 8192)  # GPU: 6 x 8192 x 8192 float32 = 1.5 GiB
    if cuda:
        torch.cuda.set_device(dev)

    def mem() -> int:
        torch.cuda.synchronize(dev)
        return torch.cuda.memory_allocated(dev)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        model = _linears(n, width, dev, seed=1)
        state = cv.TrainState(model=model)
        size = _state_bytes(model)
        want = [cv.tensor_fingerprint(p.detach()) for p in model.parameters()]
        if cuda:
            base = mem()
            torch.cuda.reset_peak_memory_stats(dev)
        started = time.perf_counter()
        cv.save(state, path)
        save_s = time.perf_counter() - started
        if cuda:
            save_peak = torch.cuda.max_memory_allocated(dev)
            _say(f"save: {size / 2**30:.3f} GiB state in {save_s:.1f} s; peak device memory {save_peak / size:.3f}x "
                 f"the state (extra over the resident model {(save_peak - base) / size:.3f}x)")
        else:
            _say(f"save: {size} bytes of state in {save_s:.2f} s; device memory not measured on the CPU")
        del state, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            before = mem()
            torch.cuda.reset_peak_memory_stats(dev)
        fresh = _linears(n, width, dev, seed=2)
        if cuda:
            resident = mem()
        state = cv.TrainState(model=fresh)
        started = time.perf_counter()
        report = cv.load(state, path)
        load_s = time.perf_counter() - started
        if cuda:
            load_peak = torch.cuda.max_memory_allocated(dev) - before
        got = [cv.tensor_fingerprint(p.detach()) for p in fresh.parameters()]
    errors = [f for f in report.findings if f.severity.value == "error"]
    if got != want or errors:
        _say(f"FAIL: the loaded parameters differ from the saved ones, or the load reported errors: {errors}")
        return 1
    if not cuda:
        _say(f"load: {len(got)} parameters restored equal in {load_s:.2f} s; device memory not measured on the CPU "
             f"(limit on a GPU: {LOAD_PEAK_LIMIT}x the state)")
        return 0
    ratio = load_peak / size
    model_share = (resident - before) / size
    _say(f"load: restored equal in {load_s:.1f} s; peak device memory {ratio:.3f}x the state, counted from before "
         f"the fresh model ({before / 2**20:.0f} MiB allocated then): the model loaded into {model_share:.3f}x, the "
         f"load's own extra {ratio - model_share:.3f}x; limit {LOAD_PEAK_LIMIT}x")
    if ratio > LOAD_PEAK_LIMIT:
        _say(f"FAIL: the load peaked at {ratio:.3f}x the state's bytes on the device (limit {LOAD_PEAK_LIMIT}x)")
        return 1
    return 0


# --------------------------------------------------------------------------------------------------- remap


def _remap_save(out: str, dry: bool) -> int:
    """Role ``save``: draw from this process's cuda:1 generator (CPU's in a dry run), save a TrainState."""
    import torch

    import ckptverify as cv

    torch.manual_seed(5)
    torch.randn(1000)
    if dry:
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", 1)
        torch.cuda.set_device(dev)
        torch.cuda.manual_seed(1234)
        torch.randn(1 << 20, device=dev)  # move the stream off its seed
    model = torch.nn.Linear(64, 64).to(dev)
    state = cv.TrainState(model=model)
    want = {"cpu": torch.get_rng_state().clone()}
    if not dry:
        want["cuda"] = torch.cuda.get_rng_state(dev).clone()
        want["uuid"] = str(getattr(torch.cuda.get_device_properties(dev), "uuid", ""))
        want["name"] = torch.cuda.get_device_name(dev)
    cv.save(state, os.path.join(out, "ckpt"))
    # The next draws of the saved streams, as the uninterrupted run makes them.
    torch.set_rng_state(want["cpu"])
    want["cpu_draw"] = torch.rand(16)
    if not dry:
        torch.cuda.set_rng_state(want["cuda"], dev)
        want["cuda_draw"] = torch.rand(16, device=dev).cpu()
    torch.save(want, os.path.join(out, "want.pt"))
    _say(f"remap save: TrainState saved on {dev}" + ("" if dry else f" (GPU {want['uuid']})"))
    return 0


def _remap_load(out: str, dry: bool, role: str) -> int:
    """Role ``load-same`` / ``load-other``: load the TrainState into this process's cuda:0; check its streams."""
    import torch

    import ckptverify as cv

    want = torch.load(os.path.join(out, "want.pt"), weights_only=True)
    torch.manual_seed(77)  # streams elsewhere: the load must put them back
    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    if not dry:
        torch.cuda.set_device(dev)
        torch.cuda.manual_seed(99)
        uuid = str(getattr(torch.cuda.get_device_properties(dev), "uuid", ""))
    state = cv.TrainState(model=torch.nn.Linear(64, 64).to(dev))
    report = cv.load(state, os.path.join(out, "ckpt"))
    device_notes = [f.message for f in report.findings if f.check == "restore-device"]
    problems = []
    if not torch.equal(torch.get_rng_state(), want["cpu"]) or not torch.equal(torch.rand(16), want["cpu_draw"]):
        problems.append("the CPU stream was not restored")
    if not dry:
        if not torch.equal(torch.cuda.get_rng_state(dev), want["cuda"]):
            problems.append("the CUDA generator state differs from the saved one")
        # The next draw's values also depend on the kernel's launch shape, which depends on the device model.
        if torch.cuda.get_device_name(dev) == want["name"] and \
                not torch.equal(torch.rand(16, device=dev).cpu(), want["cuda_draw"]):
            problems.append("the CUDA stream's next draw differs from the saved run's")
        same = uuid == want["uuid"]
        if uuid and want["uuid"] and same != (role == "load-same"):
            problems.append(f"expected {'the same' if role == 'load-same' else 'another'} physical GPU, "
                            f"saved on {want['uuid']}, loading on {uuid}")
        if role == "load-other" and not device_notes:
            problems.append("no restore-device finding in the load report for a stream saved on another GPU")
    where = "cpu" if dry else f"cuda:0 (GPU {uuid})"
    _say(f"remap {role}: loaded on {where}; restore-device findings: {len(device_notes)}"
         + "".join(f"\n    {m}" for m in device_notes))
    for p in problems:
        _say(f"FAIL ({role}): {p}")
    return 1 if problems else 0


def part_remap(dry: bool) -> int:
    import torch

    visible: list[str] = []
    if not dry:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = [v.strip() for v in env.split(",") if v.strip()] if env else \
            [str(i) for i in range(torch.cuda.device_count())]
        if len(visible) < 2:
            _say(f"remap: needs two GPUs, sees {len(visible)}")
            return 1
    a, b = (visible[0], visible[1]) if visible else ("", "")
    failed = 0
    with tempfile.TemporaryDirectory() as out:
        steps = [("save", f"{a},{b}"), ("load-same", b), ("load-other", a)]
        for role, devices in steps:
            if dry and role == "load-other":
                continue  # the same CPU stream again: nothing more to see without GPUs
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
            if not dry:
                env["CUDA_VISIBLE_DEVICES"] = devices
            cmd = [sys.executable, os.path.abspath(__file__), "--part", "remap", "--role", role, "--dir", out]
            if dry:
                cmd.append("--dry-run")
            _say(f"remap: {role}" + ("" if dry else f" with CUDA_VISIBLE_DEVICES={devices}"))
            done = subprocess.run(cmd, env=env, check=False)
            if done.returncode != 0:
                _say(f"FAIL: remap {role} exited {done.returncode}")
                failed += 1
                if role == "save":
                    break
    if dry:
        _say("remap: CPU stream saved and restored in a fresh process; CUDA parts skipped (dry run: no GPU; "
             "on two GPUs the saved cuda:1 stream is loaded on the same GPU as cuda:0 and on another GPU)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, required=True)
    parser.add_argument("--dry-run", action="store_true",
                        help="run on the CPU with tiny sizes (also: CKPTVERIFY_GPU_DRY_RUN=1)")
    parser.add_argument("--steps", help="train: warm-up,timed,sync-counted steps per level (default 3,6,2)")
    parser.add_argument("--role", choices=("save", "load-same", "load-other"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dry = args.dry_run or os.environ.get("CKPTVERIFY_GPU_DRY_RUN") == "1"
    import torch

    if not dry and not torch.cuda.is_available():
        _say("no CUDA device: run with --dry-run on the CPU")
        return 2
    if args.part == "train":
        return part_train(dry, args.steps)
    if args.part == "saveload":
        return part_saveload(dry)
    if args.role == "save":
        return _remap_save(args.dir, dry)
    if args.role is not None:
        return _remap_load(args.dir, dry, args.role)
    return part_remap(dry)


if __name__ == "__main__":
    sys.exit(main())
