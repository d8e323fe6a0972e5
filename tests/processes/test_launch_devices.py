"""How the harness starts ranks on a device: the process group's backend for each device, the number of ranks
checked against the visible GPUs before any process starts, and a failing rank that ends the launch at once
instead of leaving its peers (and the launch) waiting in a collective."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.resume import launch as launch_mod
from ckptverify.resume.launch import launch_jobs
from ckptverify.resume.run import RunConfig, _group_backend


@pytest.mark.parametrize(("device", "available", "backend"), [
    ("cpu", False, "gloo"),
    ("cpu", True, "gloo"),  # a CPU model on a GPU host: NCCL cannot carry its tensors
    ("cuda", True, "cpu:gloo,cuda:nccl"),  # NCCL for the model, gloo for what is exchanged in host memory
    (None, True, "cpu:gloo,cuda:nccl"),  # torchrun, device not said: each tensor goes where it can
    (None, False, "gloo"),
])
def test_the_backend_follows_the_device_the_ranks_were_launched_for(device: str | None, available: bool,
                                                                   backend: str) -> None:
    assert _group_backend(device, available) == backend


def test_cuda_without_cuda_or_an_unknown_device_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="no CUDA device"):
        _group_backend("cuda", False)
    with pytest.raises(UsageError, match="'cpu' or 'cuda'"):
        _group_backend("tpu", True)


@pytest.mark.parametrize(("nproc", "visible", "refused"), [(3, 2, True), (2, 2, False), (1, 0, True)])
def test_more_cuda_ranks_than_visible_gpus_is_refused_before_any_process_starts(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, nproc: int, visible: int, refused: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    started: list[int] = []

    def start_processes(*args: object, **kwargs: object) -> object:
        started.append(1)
        return SimpleNamespace(join=lambda timeout=None: True)  # every rank done

    monkeypatch.setattr(torch.multiprocessing, "start_processes", start_processes)
    script = tmp_path / "noop.py"
    script.write_text("def train(run):\n    pass\n")
    config = RunConfig(name="A", stop_step=1, workload=f"{script}:train")
    if refused:
        with pytest.raises(UsageError, match="--device cuda"):
            launch_jobs(nproc, "cuda", [(f"{script}:train", config)])
        assert started == []
    else:
        launch_jobs(nproc, "cuda", [(f"{script}:train", config)])
        assert started == [1]
    assert launch_mod._check_devices(nproc, "cpu") is None  # on CPU the GPUs are no limit


@pytest.mark.slow
def test_a_rank_that_raises_inside_collectives_ends_the_launch_promptly_with_its_traceback(tmp_path: Path) -> None:
    """Rank 1 raises while rank 0 waits in an all-reduce. Tearing the group down there waits for the peers (with
    NCCL until the watchdog): here ``destroy_process_group`` hangs in the ranks as it can on GPUs, so a rank
    that called it on failure would never exit, and the launch would run into its timeout."""
    script = tmp_path / "crash_train.py"
    script.write_text(textwrap.dedent('''
        import time

        import torch
        import torch.distributed as dist


        def _hang(*args, **kwargs):
            time.sleep(3600)


        def train(run):
            dist.destroy_process_group = _hang
            rank = dist.get_rank()
            t = torch.ones(4)
            for i in range(1_000_000):
                if rank == 1 and i == 20:
                    raise RuntimeError("rank one fell over")
                dist.all_reduce(t)
                t.fill_(1.0)
    '''))
    config = RunConfig(name="A", stop_step=2, trace_dir=str(tmp_path / "trace"), level="metrics",
                       workload=f"{script}:train", log_dir=str(tmp_path / "logs"))
    start = time.monotonic()
    with pytest.raises(CkptVerifyError) as crash:
        launch_jobs(2, "cpu", [(f"{script}:train", config)], timeout_s=150)
    took = time.monotonic() - start
    assert "did not finish" not in str(crash.value), str(crash.value)
    assert "rank one fell over" in str(crash.value), str(crash.value)
    assert took < 60, f"the launch took {took:.0f} s to report the crash"


def test_a_torchrun_job_on_a_gpu_host_gets_both_backends_and_no_cuda_context_until_it_uses_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    from helpers.fake_cuda import FakeCuda

    from ckptverify.resume import run as run_mod

    cuda = FakeCuda(monkeypatch, n=8, current=0, initialized=False)
    queued: list[Callable[[], None]] = []
    monkeypatch.setattr(torch.cuda, "_lazy_call", lambda fn, **kwargs: queued.append(fn))
    seen: dict[str, object] = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend=None, **kwargs: seen.update(backend=backend,
                                                                                               **kwargs))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_mod._init_group_from_env() is True
    assert seen == {"backend": "cpu:gloo,cuda:nccl"}
    assert cuda.touched() == [], cuda.calls
    assert len(queued) == 1
    queued[0]()  # what torch runs when the process first initialises CUDA: the rank's own device
    assert cuda.current == 1
