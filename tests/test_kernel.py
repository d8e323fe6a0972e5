"""Re-running one op alone on its captured inputs (ckptverify.trace.kernel): nondeterministic kernels, ops that
are deterministic alone, in-place and random ops that must not be mistaken for nondeterministic kernels, and
capture files that must be refused without running anything they hold."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from ckptverify.errors import UsageError
from ckptverify.trace import kernel
from ckptverify.trace.kernel import Capture, load_capture, mechanism_of, nvtx_site, rerun, resolve_op, site_name


@torch.library.custom_op("ckptv_kernel_test::noisy_scale", mutates_args=())
def noisy_scale(x: torch.Tensor) -> torch.Tensor:
    """A kernel that is nondeterministic by itself: it adds noise drawn from the OS, not from torch's RNG."""
    (u,) = struct.unpack("<I", os.urandom(4))
    return x * 2 + (u % 1000 + 1) * 1e-3


@torch.library.custom_op("ckptv_kernel_test::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def save(tmp_path, name: str, payload: object) -> str:
    path = str(tmp_path / name)
    torch.save(payload, path)
    return path


def test_custom_op_with_os_noise_is_nondeterministic_by_itself(tmp_path):
    path = save(tmp_path, "cap.pt", {"op": "ckptv_kernel_test.noisy_scale.default",
                                     "args": (torch.randn(16, 4),), "kwargs": {}})
    v = rerun(path, runs=4)
    assert v.nondeterministic and v.distinct > 1 and v.outputs_differing == (0,)
    assert v.mechanism == "none"
    assert "nondeterministic by itself" in v.sentence()
    assert "no documented mechanism; a custom or extension kernel" in v.sentence()
    d = json.loads(json.dumps(v.to_dict()))
    assert d["nondeterministic"] is True and d["mechanism"] == "none" and d["runs"] == 4


def test_deterministic_custom_op_and_mm_are_deterministic_alone(tmp_path):
    for op, args in (("ckptv_kernel_test.scale.default", (torch.randn(8, 3),)),
                     ("aten.mm.default", (torch.randn(64, 32), torch.randn(32, 16)))):
        v = rerun(save(tmp_path, "cap.pt", {"op": op, "args": args, "kwargs": {}}), runs=5)
        assert not v.nondeterministic and v.distinct == 1 and v.mechanism is None, op
        assert v.outputs_differing == ()
        assert "deterministic alone" in v.sentence() and "order or topology around it" in v.sentence()


def test_in_place_op_is_re_run_on_fresh_inputs(tmp_path):
    """add_ writes its first argument: run on the same tensor twice it would give two results; on fresh copies
    it is deterministic."""
    path = save(tmp_path, "cap.pt", {"op": "aten.add_.Tensor", "args": (torch.ones(5), torch.full((5,), 0.5)),
                                     "kwargs": {"alpha": 3}})
    v = rerun(path, runs=3)
    assert not v.nondeterministic and v.distinct == 1
    # The captured tensors themselves are left untouched.
    cap = load_capture(path)
    assert torch.equal(cap.args[0], torch.ones(5))


def test_in_place_nondeterministic_op_names_the_written_argument():
    @torch.library.custom_op("ckptv_kernel_test::noisy_fill", mutates_args=("x",))
    def noisy_fill(x: torch.Tensor) -> None:
        x.fill_(float(os.urandom(1)[0]) + 1000.0 * float(os.urandom(1)[0]))

    v = rerun(Capture(op="ckptv_kernel_test.noisy_fill.default", args=(torch.zeros(3),), kwargs={}), runs=4)
    assert v.nondeterministic and v.arguments_differing == (0,)
    assert "written argument 0" in v.sentence()


def test_random_op_is_judged_with_its_generator_fixed(tmp_path):
    path = save(tmp_path, "cap.pt", {"op": "aten.native_dropout.default", "args": (torch.randn(100), 0.5, True),
                                     "kwargs": {}})
    before = torch.get_rng_state()
    v = rerun(path, runs=3)
    assert not v.nondeterministic and v.random
    assert "random generator" in v.sentence() and "generator's state" in v.sentence()
    # The caller's generator is not consumed.
    assert torch.equal(torch.get_rng_state(), before)
    # A plain op is not called random.
    assert not rerun(Capture(op="aten.mm.default", args=(torch.eye(2), torch.eye(2)), kwargs={})).random


def test_mechanisms_named_from_the_documented_table():
    cpu = {"cudnn_benchmark": False}
    assert mechanism_of(torch.ops.aten.index_add_.default, "cuda:0", cpu) == "atomics"
    assert mechanism_of(torch.ops.aten.scatter_add.default, "cuda", cpu) == "atomics"
    assert mechanism_of(torch.ops.aten.index_put_.default, "cpu", cpu) == "atomics"
    assert mechanism_of(torch.ops.aten.index_add_.default, "cpu", cpu) == "none"  # deterministic on the CPU
    assert mechanism_of(torch.ops.aten.mm.default, "cuda:0", cpu) == "cublas-workspace"
    assert mechanism_of(torch.ops.aten.mm.default, "cpu", cpu) == "none"
    assert mechanism_of(torch.ops.aten.convolution.default, "cuda", {"cudnn_benchmark": True}) == "cudnn-benchmark"
    assert mechanism_of(torch.ops.aten.convolution.default, "cuda", cpu) == "cudnn-algorithm"
    assert mechanism_of(torch.ops.ckptv_kernel_test.noisy_scale.default, "cuda", cpu) == "none"


class _Marker:
    """Pickles as a call that would create a directory: if it ever exists, the capture was executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_capture_with_a_pickle_global_is_refused_unexecuted(tmp_path):
    marker = str(tmp_path / "executed")
    path = save(tmp_path, "evil.pt", {"op": "aten.mm.default", "args": (_Marker(marker),), "kwargs": {}})
    with pytest.raises(UsageError, match="refused capture file"):
        rerun(path)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("name", [
    "builtins.eval.default",
    "os.system.default",
    "aten.mm",
    "torch.ops.aten.mm.default",
    "aten.__class__.default",
    "load_library.x.default",
    "aten.mm.__call__",
    "aten.mm.no_such_overload",
    "aten.mm.default; import os",
    "c10d.allreduce_.default",
    "_c10d_functional.all_reduce.default",
    42,
])
def test_op_names_other_than_registered_operators_are_refused(tmp_path, name):
    path = save(tmp_path, "cap.pt", {"op": name, "args": ("1+1",), "kwargs": {}})
    with pytest.raises(UsageError):
        rerun(path)
    with pytest.raises(UsageError):
        resolve_op(name)


@pytest.mark.parametrize("payload", [
    [1, 2, 3],
    {"op": "aten.mm.default", "args": (torch.eye(2),)},
    {"op": "aten.mm.default", "args": "x", "kwargs": {}},
    {"op": "aten.mm.default", "args": (), "kwargs": {1: 2}},
])
def test_malformed_capture_is_a_usage_error(tmp_path, payload):
    with pytest.raises(UsageError):
        rerun(save(tmp_path, "cap.pt", payload))


def test_unreadable_capture_paths(tmp_path):
    with pytest.raises(UsageError):
        rerun(str(tmp_path / "missing.pt"))
    with pytest.raises(UsageError):
        rerun(str(tmp_path))  # a directory
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch.save file")
    with pytest.raises(UsageError, match="not a readable capture file"):
        rerun(str(garbage))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UsageError):
        rerun(str(fifo))  # refused without blocking on open


def test_op_that_fails_on_its_inputs_and_bad_runs_are_usage_errors(tmp_path):
    path = save(tmp_path, "cap.pt", {"op": "aten.mm.default", "args": (torch.eye(2), torch.eye(3)), "kwargs": {}})
    with pytest.raises(UsageError, match="failed on the captured inputs"):
        rerun(path)
    with pytest.raises(UsageError, match="at least 2"):
        rerun(path, runs=1)


def test_nvtx_site_is_a_no_op_without_cuda_and_pairs_push_and_pop_with_it(monkeypatch):
    calls: list[tuple[str, str | None]] = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop", None)))
    kernel._nvtx_enabled.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with nvtx_site("x"):
        pass
    assert calls == []
    kernel._nvtx_enabled.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    name = site_name((3, "backward", "blocks.1.fc", "aten.mm.default", 2))
    assert name == "step3/backward/blocks.1.fc/aten.mm.default#2"
    with pytest.raises(RuntimeError), nvtx_site(name):
        raise RuntimeError("the range is closed all the same")
    assert calls == [("push", name), ("pop", None)]
    kernel._nvtx_enabled.cache_clear()


def test_kernel_findings():
    noisy = rerun(Capture(op="ckptv_kernel_test.noisy_scale.default", args=(torch.ones(4),), kwargs={}), runs=3)
    f = noisy.finding()
    assert (f.check, f.severity.value, f.location.record) == \
        ("kernel-nondeterministic", "warning", "ckptv_kernel_test.noisy_scale.default")
    f = rerun(Capture(op="aten.mm.default", args=(torch.eye(3), torch.eye(3)), kwargs={})).finding()
    assert (f.check, f.severity.value) == ("kernel-deterministic", "info")


def test_results_that_cannot_be_fingerprinted_are_a_usage_error():
    # A meta tensor has no values: the verdict cannot be drawn, and says so instead of a traceback.
    with pytest.raises(UsageError, match="cannot fingerprint"):
        rerun(Capture(op="aten.mm.default", args=(torch.eye(2, device="meta"), torch.eye(2, device="meta")),
                      kwargs={}), device="meta")


def test_tf32_is_named_beside_the_cublas_mechanism():
    base = dict(op="aten.mm.default", device="cuda:0", runs=3, distinct=2, outputs_differing=(0,),
                nondeterministic=True, mechanism="cublas-workspace")
    on = kernel.KernelVerdict(**base, settings={"matmul_allow_tf32": True}).sentence()
    off = kernel.KernelVerdict(**base, settings={"matmul_allow_tf32": False}).sentence()
    assert "CUBLAS_WORKSPACE_CONFIG" in on and "TF32 is on" in on
    assert "CUBLAS_WORKSPACE_CONFIG" in off and "TF32" not in off


def test_bad_device_is_a_usage_error():
    with pytest.raises(UsageError, match="not a device"):
        rerun(Capture(op="aten.mm.default", args=(torch.eye(2), torch.eye(2)), kwargs={}), device="gpu please")
