"""Re-running one op alone on its captured inputs (ckptverify.trace.kernel): nondeterministic kernels, ops that
are deterministic alone, in-place and random ops that must not be mistaken for nondeterministic kernels, and
capture files that must be refused without running anything they hold."""

from __future__ import annotations

import json
import os
import struct
import time

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
    kernel.nvtx_enabled.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with nvtx_site("x"):
        pass
    assert calls == []
    kernel.nvtx_enabled.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    name = site_name((3, "backward", "blocks.1.fc", "aten.mm.default", 2))
    assert name == "step3/backward/blocks.1.fc/aten.mm.default#2"
    with pytest.raises(RuntimeError), nvtx_site(name):
        raise RuntimeError("the range is closed all the same")
    assert calls == [("push", name), ("pop", None)]
    kernel.nvtx_enabled.cache_clear()


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


# ------------------------------------------------------------------------------------------- what is re-run


@torch.library.custom_op("ckptv_kernel_test::dump", mutates_args=())
def dump(x: torch.Tensor, path: str) -> torch.Tensor:
    """A custom op whose string argument names a file it writes."""
    with open(path, "w") as f:
        f.write("written")
    return x.clone()


@torch.library.custom_op("ckptv_kernel_test::tile_n", mutates_args=())
def tile_n(x: torch.Tensor, n: int) -> torch.Tensor:
    """A custom op whose integer argument sizes its result, without a fake implementation to size it by."""
    return x.repeat(n)


def test_from_file_capture_is_refused_and_the_file_is_left_as_it_was(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"twelve bytes")
    path = save(tmp_path, "cap.pt", {"op": "aten.from_file.default", "args": (str(outside), True, 1 << 18),
                                     "kwargs": {"dtype": torch.float32}})
    with pytest.raises(UsageError, match=r"refused op aten\.from_file\.default: its string argument 'filename'"):
        rerun(path)
    assert outside.read_bytes() == b"twelve bytes"


@pytest.mark.timeout(60)
def test_from_file_on_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="may name a file"):
        rerun(Capture(op="aten.from_file.out", args=(str(fifo), False, 4), kwargs={"out": torch.empty(4)}))


@pytest.mark.parametrize(("op", "args", "why"), [
    ("aten.save.default", (torch.ones(2), "saved.pt"), "neither a tensor nor a device"),
    ("aten.set_.source_Storage", (torch.ones(2), None), "Storage argument"),
    ("ckptv_kernel_test.dump.default", (torch.ones(2), "dumped.txt"), "string argument 'path'"),
])
def test_ops_that_may_name_a_file_or_take_foreign_memory_are_refused_by_schema(tmp_path, monkeypatch, op, args,
                                                                               why):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=why):
        rerun(Capture(op=op, args=args, kwargs={}))
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize(("op", "args"), [
    ("aten.randn.default", ([1 << 40],)),
    ("aten.new_empty.default", (torch.ones(4), [1 << 40])),
    ("aten.resize_.default", (torch.ones(4), [1 << 40])),
    ("aten.expand.default", (torch.ones(4, 1), [4, 1 << 40])),
    ("aten.repeat.default", (torch.ones(4), [1 << 20, 1 << 20])),
])
def test_ops_sized_beyond_the_captured_tensors_are_refused_before_they_run(op, args):
    with pytest.raises(UsageError, match=rf"refused op {op}: on the captured inputs it would leave \d+ bytes"):
        rerun(Capture(op=op, args=args, kwargs={}))


@pytest.mark.parametrize(("op", "args"), [
    ("aten.bincount.default", (torch.tensor([1 << 40]),)),
    ("aten.repeat_interleave.Tensor", (torch.tensor([1 << 40]),)),
    ("aten._nested_view_from_buffer.default", (torch.ones(4), torch.tensor([[1 << 40]]), torch.tensor([[1]]),
                                               torch.tensor([0]))),
])
def test_ops_sized_by_the_values_of_their_inputs_are_refused_before_they_run(op, args):
    with pytest.raises(UsageError, match=rf"refused op {op}: the size of its results cannot be worked out"):
        rerun(Capture(op=op, args=args, kwargs={}))


def test_custom_op_with_an_integer_and_no_fake_implementation_is_refused():
    with pytest.raises(UsageError, match=r"integer arguments \(n\) may size them: register a fake"):
        rerun(Capture(op="ckptv_kernel_test.tile_n.default", args=(torch.ones(4), 1 << 40), kwargs={}))


def test_captured_tensor_counted_by_its_logical_size_is_capped(tmp_path):
    # 8 GiB as a stride-0 view of one element: the file is small, a copy of it is not.
    path = save(tmp_path, "cap.pt", {"op": "aten.neg.default", "args": (torch.zeros(1).expand(1 << 31),),
                                     "kwargs": {}})
    with pytest.raises(UsageError, match=r"its tensors hold 8589934592 bytes"):
        rerun(path)


def test_capture_file_over_the_cap_is_refused_before_it_is_loaded(tmp_path, monkeypatch):
    path = save(tmp_path, "cap.pt", {"op": "aten.neg.default", "args": (torch.zeros(1 << 20),), "kwargs": {}})
    monkeypatch.setattr(kernel, "MAX_CAPTURE_BYTES", 1 << 10)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(UsageError, match=r"refused capture file .*bytes, over the 1024 bytes"):
        rerun(path)


def test_op_whose_work_is_over_the_cap_is_refused_before_it_runs():
    # Two 1 GiB matrices as stride-0 views: a product of 8.8e12 operations.
    a = torch.ones(1, 1).expand(1 << 14, 1 << 14)
    with pytest.raises(UsageError, match=r"floating-point operations, over the 1e\+12 allowed on cpu"):
        rerun(Capture(op="aten.mm.default", args=(a, a), kwargs={}))


def test_runs_stop_at_the_time_limit():
    calls = []

    @torch.library.custom_op("ckptv_kernel_test::slow", mutates_args=())
    def slow(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        time.sleep(0.3)
        return x * 2

    with pytest.raises(UsageError, match=r"stopped after 1 of 10 runs .* time limit of 0\.5 s"):
        rerun(Capture(op="ckptv_kernel_test.slow.default", args=(torch.ones(2),), kwargs={}), runs=10, timeout_s=0.5)
    assert len(calls) == 1


def test_torch_ops_with_a_string_mode_and_small_factory_ops_still_re_run():
    index = torch.tensor([0, 1, 0])
    for op, args, kwargs in (
        ("aten.div.Tensor_mode", (torch.arange(6.0), torch.full((6,), 4.0)), {"rounding_mode": "floor"}),
        ("aten.scatter_reduce.two", (torch.zeros(2), 0, index, torch.ones(3), "sum"), {}),
        ("aten.randn.default", ([16],), {"device": torch.device("cpu")}),
    ):
        v = rerun(Capture(op=op, args=args, kwargs=kwargs), runs=2)
        assert not v.nondeterministic, op
