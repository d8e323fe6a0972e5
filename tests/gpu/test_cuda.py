"""The CUDA paths: fingerprints, saves, loads, traces, resume-check and replay on a GPU.

Every test here is skipped without CUDA. The CPU suite covers the same logic on CPU tensors; these tests hold
the GPU results to the CPU ones bit for bit (a fingerprint is defined by the values, not the device), and run
the harness and the production job with NCCL on one GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckptverify as cv
from ckptverify.fingerprint import chunk_fingerprint, tensor_fingerprint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def _values(dtype: torch.dtype, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), (n,), generator=gen, dtype=torch.int64
                         ).to(dtype)


@pytest.mark.parametrize("path", ["triton", "eager"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprints_on_the_gpu_equal_the_cpu_ones(dtype: torch.dtype, path: str) -> None:
    """Through the Triton kernel (what a CUDA tensor takes) and the eager path (where Triton is missing, or its
    check failed): the CPU's values."""
    from test_fingerprint import eager_fingerprint

    whole = tensor_fingerprint if path == "triton" else eager_fingerprint
    chunk = chunk_fingerprint if path == "triton" else eager_fingerprint
    for n in (1, 1000, (1 << 20) + 7):
        t = _values(dtype, n)
        assert whole(t.cuda()) == tensor_fingerprint(t), (dtype, n)
    t = _values(dtype, 6 * 1024).view(64, 96)
    part = t[16:48, 32:96]
    on_gpu = chunk(part.cuda(), (16, 32), (64, 96))
    assert on_gpu == chunk_fingerprint(part, (16, 32), (64, 96))
    # Non-contiguous views on the GPU fingerprint as their values.
    assert whole(t.cuda().t()) == tensor_fingerprint(t.t().contiguous())
    if path == "triton":
        from ckptverify.fingerprint import eager as ref
        from ckptverify.fingerprint import triton_kernel as tri

        width = ref._INT_VIEW_BY_SIZE[t.element_size()]
        assert tri._verified.get(("cuda", width)) is True  # the fused kernel ran, and matched eager first


@pytest.mark.parametrize("path", ["triton", "eager"])
def test_many_tensors_on_the_gpu_fingerprint_as_on_the_cpu(path: str) -> None:
    """What a trace digests each step (a list of tensors, one batched pass): the lanes on the GPU, through the
    Triton kernel or the eager path, equal the CPU's, and a flipped bit changes only its tensor's."""
    from ckptverify.fingerprint import eager as ref
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint import triton_kernel as tri

    many = kern.lanes_many if path == "triton" else ref.lanes_many_eager
    tensors = [_values(dtype, n) for dtype, n in zip(DTYPES, (1, 7, 1000, 5000, (1 << 20) + 3, 65), strict=False)]
    tensors.append(torch.zeros(0))
    want = kern.lanes_many(tensors).tolist()
    on_gpu = [t.cuda() for t in tensors]
    assert many(on_gpu).tolist() == want
    if path == "triton":
        assert tri._many_verified.get("cuda") is True
    on_gpu[3].view(torch.uint8)[11] ^= 1
    got = many(on_gpu).tolist()
    assert [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b] == [3]


def test_one_flipped_bit_on_the_gpu_changes_the_fingerprint() -> None:
    t = torch.randn(1 << 16, device="cuda")
    before = tensor_fingerprint(t)
    t.view(torch.int32)[12345] ^= 1 << 7
    assert tensor_fingerprint(t) != before


def _cuda_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, cv.TrainState]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, cv.TrainState(model=model, optimizer=opt)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(32, 64, device="cuda")  # draws from the CUDA generator
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_save_verify_load_of_gpu_state_is_bitwise_and_restores_the_cuda_generator(tmp_path: Path) -> None:
    model, opt, state = _cuda_state(0)
    for _ in range(3):
        _step(model, opt)
    ckpt = tmp_path / "ckpt"
    manifest = cv.save(state, ckpt)
    assert manifest is not None
    report = cv.verify_checkpoint(ckpt, deep=True)
    assert report.passed and report.exit_code == 0, report.findings
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _step(model, opt)  # what the continuous run does next
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}

    model2, opt2, state2 = _cuda_state(1)  # different weights and a different CUDA stream
    torch.cuda.manual_seed_all(999)
    loaded = cv.load(state2, ckpt)
    assert loaded.passed, loaded.findings
    assert all(torch.equal(saved[k], v) for k, v in model2.state_dict().items())
    assert all(v.is_cuda for v in model2.state_dict().values())
    _step(model2, opt2)  # same CUDA random draws, same kernels: bitwise the same step
    assert all(torch.equal(after[k], v) for k, v in model2.state_dict().items())


def test_a_flipped_byte_in_a_gpu_checkpoint_is_found(tmp_path: Path) -> None:
    model, opt, state = _cuda_state(0)
    _step(model, opt)
    ckpt = tmp_path / "ckpt"
    cv.save(state, ckpt)
    shard = max((p for p in ckpt.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    report = cv.verify_checkpoint(ckpt)
    assert not report.passed and report.exit_code == 1


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptverify", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_resume_check_on_the_gpu_passes_the_correct_workload_and_names_a_planted_bug(tmp_path: Path) -> None:
    good = _cli("resume-check", "ckptverify.examples.workloads:correct", "-T", "6", "-K", "3", "--device", "cuda",
                "--json", "--keep", str(tmp_path / "good"))
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    report = json.loads(good.stdout)
    assert report["passed"]
    bad = _cli("resume-check", "ckptverify.examples.workloads:rng_not_restored", "-T", "6", "-K", "3",
               "--device", "cuda", "--json", "--keep", str(tmp_path / "bad"))
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    verdict = json.loads(bad.stdout)["stats"]["verdict"]
    assert (verdict["kind"], verdict["step"]) == ("rng", 4), verdict


WORKLOAD = textwrap.dedent('''
    import sys
    import torch
    import ckptverify as cv
    from ckptverify.examples import TinyGPTConfig, build_training, make_loader, train_step

    CONFIG = TinyGPTConfig(d_model=64, n_layers=2, n_heads=2, seq_len=32)

    def train(run):
        training = build_training(CONFIG, total_steps=40, num_sequences=256, seed=0, device="cuda")
        loader = make_loader(training.dataset, 4, rank=run.rank, world_size=run.world_size, seed=1)
        state = cv.TrainState(model=training.model, optimizer=training.optimizer, scheduler=training.scheduler,
                              dataloader=loader)
        run.restore(state)
        for batch in run.steps(loader):
            out = train_step(training, batch)
            run.record(loss=out["loss"], lr=out["lr"])

    if __name__ == "__main__":
        fault = sys.argv[3] if len(sys.argv) > 3 else None
        cv.Run.main(train, steps=int(sys.argv[2]), run_dir=sys.argv[1], save_every=3, trace="state", fault=fault)
''')


def test_production_on_the_gpu_replays_as_reproduced_and_a_flipped_gradient_is_named(tmp_path: Path) -> None:
    from ckptverify.hardware.inject import BitFlip
    from ckptverify.production.mode import read_run_file
    from ckptverify.replay.replay import replay

    torch.backends.cudnn.deterministic = True
    script = tmp_path / "gpu_job.py"
    script.write_text(WORKLOAD)
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONPATH": os.pathsep.join(sys.path)}

    def job(run: Path, *extra: str) -> None:
        done = subprocess.run([sys.executable, str(script), str(run), "6", *extra], capture_output=True,
                              text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    clean = tmp_path / "clean"
    job(clean)
    host = json.loads((clean / "trace" / "from-00000000" / "host-rank0.json").read_text())
    assert host["device"]["type"] == "cuda" and host["device"]["name"], host
    report = replay(clean, target=read_run_file(str(clean))["target"], device="cuda")
    assert report.stats["verdict"]["kind"] == "reproduced", report.stats["verdict"]

    site = "blocks.0.mlp.fc.weight"
    faulty = tmp_path / "faulty"
    job(faulty, BitFlip(kind="grad", name=site, step=5, rank=0, element=3, bit=22).to_json())
    report = replay(faulty, target=read_run_file(str(faulty))["target"], start=3, end=6, device="cuda")
    verdict = report.stats["verdict"]
    assert verdict["kind"] == "hardware-fault-suspected", verdict
    assert (verdict["step"], verdict["rank"], verdict["site"]) == (5, 0, f"grad.{site}")
    assert "device cuda" in verdict["message"]


def test_a_state_trace_on_the_gpu_reads_back_once_per_step(tmp_path: Path) -> None:
    """Gradients, parameters, optimizer state, batch and metrics digested on the GPU and read back together
    once per step; a flipped parameter bit is named at its step."""
    import test_trace_device_path

    done = test_trace_device_path.run_script(tmp_path, "cuda")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


# ---------------------------------------------------------------------------------- the ladder on the GPU

LADDER_WORKLOAD = textwrap.dedent('''
    """A regressor on the GPU whose second layer sums rows into buckets with index_add_ (float atomics: the order
    of the additions, and so the last bits, changes from launch to launch), or does the same sum with a
    deterministic matmul (``train_clean``). Its own Dataset, DataLoader workers with augmentation, AdamW,
    OneCycleLR, clipping, an EMA."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    from torch.utils.data import DataLoader, Dataset

    import ckptverify as cv

    class Points(Dataset):
        def __init__(self, n=4096):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(n, 64, generator=g)
            self.y = self.x.sin().sum(1, keepdim=True)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i] + 0.05 * torch.randn(64), self.y[i]

    class Buckets(nn.Module):
        def __init__(self, atomics):
            super().__init__()
            self.atomics = atomics
            self.fc = nn.Linear(64, 4096)
            self.register_buffer("index", torch.arange(4096) % 8)

        def forward(self, x):
            h = self.fc(x)
            if self.atomics:
                out = torch.zeros(x.shape[0], 8, device=x.device, dtype=h.dtype)
                return out.index_add_(1, self.index, h)
            return h @ F.one_hot(self.index, 8).to(h.dtype)

    def _train(run, atomics):
        torch.manual_seed(0)
        model = nn.Sequential(Buckets(atomics), nn.Linear(8, 1)).to(run.device or "cuda")
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=run.total_steps)
        data = Points()
        loader = DataLoader(data, batch_size=512, sampler=cv.ResumableSampler(len(data), seed=1), num_workers=2)
        state = cv.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader, extras={"ema": ema})
        run.restore(state)
        for x, y in run.steps(loader):
            x, y = x.to(run.device or "cuda"), y.to(run.device or "cuda")
            loss = F.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            ema.update_parameters(model)
            run.record(loss=loss.detach())

    def train(run):
        _train(run, atomics=True)

    def train_clean(run):
        _train(run, atomics=False)
''')


def test_the_walk_on_the_gpu_names_index_add_and_its_atomics(tmp_path: Path) -> None:
    script = tmp_path / "buckets.py"
    script.write_text(LADDER_WORKLOAD)
    done = _cli("resume-check", f"{script}:train", "--steps", "2", "--resume-at", "1", "--runs", "A,A2",
                "--device", "cuda", "--json", "--locate-repeats", "2", timeout=900)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    verdict = json.loads(done.stdout)["stats"]["verdict"]
    assert verdict["kind"] == "nondeterministic", verdict
    origin = verdict["origin"]
    assert origin is not None and origin["kind"] == "op" and "index_add" in origin["op"], verdict["locate"]
    kernel = verdict["locate"]["kernel"]
    assert kernel["nondeterministic"] is True and kernel["mechanism"] == "atomics", kernel


def test_a_clean_job_on_the_gpu_stays_clean(tmp_path: Path) -> None:
    script = tmp_path / "buckets.py"
    script.write_text(LADDER_WORKLOAD)
    done = _cli("resume-check", f"{script}:train_clean", "--steps", "2", "--resume-at", "1", "--runs", "A,A2,B",
                "--device", "cuda", "--json", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    verdict = json.loads(done.stdout)["stats"]["verdict"]
    assert verdict["kind"] == "pass" and verdict["origin"] is None, verdict


def test_a_tensor_written_on_a_side_stream_fingerprints_in_a_fresh_thread_as_on_the_cpu() -> None:
    """A fresh thread's current stream is the default one: the fingerprint runs on the tensor's device and that
    device's current stream in the thread, and a save's fingerprint thread waits for the saving thread's."""
    import threading

    from ckptverify.fingerprint.device import FingerprintStreams

    side = torch.cuda.Stream()
    host = _values(torch.float32, (1 << 22) + 5)
    with torch.cuda.stream(side):
        on_gpu = host.to("cuda", non_blocking=True).mul_(2)  # queued on the side stream
        streams = FingerprintStreams.capture([on_gpu.device])  # the saving thread's current stream: the side one
    out = []

    def fingerprint() -> None:
        with streams.scope(on_gpu):
            out.append(tensor_fingerprint(on_gpu))

    worker = threading.Thread(target=fingerprint)
    worker.start()
    worker.join()
    assert out == [tensor_fingerprint(host * 2)]


def test_the_many_tensor_fingerprint_of_a_large_list_keeps_its_extra_memory_bounded() -> None:
    from ckptverify.fingerprint import eager as ref
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint import triton_kernel as tri

    tensors = [torch.randn((1 << 18) + i, device="cuda") for i in range(256)]  # 256 MiB of small tensors
    want = ref.lanes_many_eager(tensors).tolist()
    kern.lanes_many(tensors[:2])  # the kernel checked and compiled outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = kern.lanes_many(tensors).tolist()
    peak = torch.cuda.max_memory_allocated() - base
    assert got == want
    if tri._many_verified.get("cuda"):
        assert peak <= tri.MANY_GROUP_BYTES + (16 << 20), peak
