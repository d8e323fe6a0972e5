"""The last rung of the ladder: is the origin op nondeterministic by itself, and by what mechanism?

:func:`rerun` runs one captured op (``OpWindow.capture``) alone several times on fresh copies of its inputs:
differing outputs mean the kernel is nondeterministic (the verdict names torch's documented mechanism, if any);
agreeing outputs put the cause in the order or topology around it. Trap: the capture file is untrusted: loaded with
``weights_only=True``, the op resolved only as a registered operator, collectives refused, the op checked by schema
(:func:`check_op`) and sized on meta tensors before running, and the runs time-limited."""

from __future__ import annotations

import functools
import math
import os
import pickle
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from ckptverify.errors import UsageError
from ckptverify.findings import Finding, Location, info, warning
from ckptverify.safeparse.readers import open_regular
from ckptverify.trace.category import tensor_digests
from ckptverify.trace.comm import _name

if TYPE_CHECKING:
    import torch

    from ckptverify.trace.oplog import OpKey

__all__ = ["MAX_CAPTURE_BYTES", "MAX_FLOPS", "MECHANISMS", "OUTPUT_FACTOR", "OUTPUT_SLACK_BYTES", "RERUN_TIMEOUT_S",
           "Capture", "KernelVerdict", "check_op", "load_capture", "mechanism_of", "nvtx_enabled", "nvtx_site", "rerun",
           "resolve_op", "site_name"]

#: What a mechanism key means, as the verdict says it.
MECHANISMS: dict[str, str] = {
    "atomics": "atomic accumulation (torch.use_deterministic_algorithms lists the op as nondeterministic on "
               "this device; with it on, torch uses a deterministic algorithm or refuses the op)",
    "cublas-workspace": "cuBLAS's choice of reduction order per stream and workspace (set "
                        "CUBLAS_WORKSPACE_CONFIG=:4096:8 and torch.use_deterministic_algorithms(True))",
    "cudnn-benchmark": "cuDNN benchmark algorithm choice (torch.backends.cudnn.benchmark is on: each process "
                       "may time and pick another algorithm)",
    "cudnn-algorithm": "a nondeterministic cuDNN algorithm (torch.backends.cudnn.deterministic is off)",
    "none": "no documented mechanism; a custom or extension kernel",
}

# Ops torch's use_deterministic_algorithms documentation lists as nondeterministic (atomics), by device type.
_ATOMICS: dict[str, frozenset[str]] = {
    "cuda": frozenset({
        "index_add", "scatter_add", "scatter_reduce", "scatter", "put", "index_put", "_index_put_impl",
        "embedding_dense_backward", "_embedding_bag_backward", "_embedding_bag_dense_backward",
        "_embedding_bag_per_sample_weights_backward", "histc", "bincount", "cumsum", "median", "gather_backward",
        "index_select_backward", "repeat_interleave", "max_pool3d_with_indices_backward", "avg_pool3d_backward",
        "adaptive_avg_pool2d_backward", "_adaptive_avg_pool2d_backward", "adaptive_avg_pool3d_backward",
        "_adaptive_avg_pool3d_backward", "adaptive_max_pool2d_backward", "fractional_max_pool2d_backward",
        "fractional_max_pool3d_backward", "max_unpool1d", "max_unpool2d", "max_unpool3d", "upsample_linear1d_backward",
        "upsample_bilinear2d_backward", "upsample_bicubic2d_backward", "upsample_trilinear3d_backward",
        "reflection_pad1d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward",
        "replication_pad1d_backward", "replication_pad2d_backward", "replication_pad3d_backward", "nll_loss2d_forward",
        "nll_loss_forward", "_ctc_loss_backward", "grid_sampler_2d_backward", "grid_sampler_3d_backward",
        "index_copy"}),
    "cpu": frozenset({"index_put", "_index_put_impl", "put", "index_copy"}),
}

_MATMUL = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "addmv", "mv", "dot", "vdot",
                     "_scaled_mm", "_addmm_activation", "_int_mm", "_grouped_mm", "_scaled_grouped_mm"})
_CONV = frozenset({"convolution", "_convolution", "convolution_backward", "cudnn_convolution",
                   "cudnn_convolution_transpose", "cudnn_convolution_relu", "cudnn_convolution_add_relu",
                   "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})

# No dunders: they would reach Python attributes of the namespace objects instead of operators.
_SEGMENT = r"(?!__)[A-Za-z_][A-Za-z0-9_]*"
_OP_NAME = re.compile(rf"({_SEGMENT})\.({_SEGMENT})\.({_SEGMENT})")
_REFUSED_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})
# torch's own operators: a string beside a tensor names a mode (reduce="sum"), never a file.
_TORCH_NAMESPACES = frozenset({"aten", "prim", "prims"})
# Argument kinds an op may take; strings are judged apart, anything else (Storage, Any, dict) is refused.
_PLAIN_KINDS = frozenset({"TensorType", "IntType", "SymIntType", "FloatType", "BoolType", "NumberType",
                          "ComplexType", "DeviceObjType", "GeneratorType", "NoneType"})
_SIZING_KINDS = frozenset({"IntType", "SymIntType", "NumberType"})

#: Cap on a capture's logical tensor bytes (a stride-0 view counts whole, as its copy would) and its file.
MAX_CAPTURE_BYTES = 4 << 30
#: Cap on what an op leaves (outputs and arguments): this many times the captured bytes, plus the slack.
OUTPUT_FACTOR = 8
OUTPUT_SLACK_BYTES = 1 << 30
#: Work one run may do, per device type (torch's flop counter).
MAX_FLOPS: dict[str, float] = {"cpu": 1e12, "default": 1e14}
#: Time limit of all runs of a re-run together.
RERUN_TIMEOUT_S = 600.0


def site_name(key: OpKey) -> str:
    """The name of an op site, as NVTX ranges and reports spell it: ``step<s>/<phase>/<module>/<op>#<occ>``."""
    step, phase, module, op, occurrence = key
    return f"step{step}/{phase}/{module or '-'}/{op}#{occurrence}"


@functools.cache
def nvtx_enabled() -> bool:
    """Whether :func:`nvtx_site` pushes ranges in this process (CUDA is there; asked once)."""
    import torch

    return bool(torch.cuda.is_available())


@contextmanager
def nvtx_site(name: str) -> Iterator[None]:
    """An NVTX range named ``name`` around the block on CUDA, for ``nsys``; nothing without CUDA (asked once per
    process: this wraps every op of a window)."""
    if not nvtx_enabled():
        yield
        return
    import torch

    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


@dataclass(frozen=True, slots=True, kw_only=True)
class Capture:
    """One op's captured call: ``op`` (``<ns>.<name>.<overload>``), ``args`` and ``kwargs``."""

    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def resolve_op(name: Any) -> torch._ops.OpOverload:
    """The registered operator ``torch.ops.<ns>.<name>.<overload>`` that ``name`` names; never evaluates the name.
    :class:`~ckptverify.errors.UsageError` for another shape, a collective, or an unregistered operator."""
    import torch

    if not isinstance(name, str) or (m := _OP_NAME.fullmatch(name)) is None:
        raise UsageError(f"refused op name {name!r}: expected a registered operator as <namespace>.<name>.<overload>, "
                         f"such as aten.mm.default")
    ns, op, overload = m.groups()
    if ns in _REFUSED_NAMESPACES:
        raise UsageError(f"refused op {name}: a collective cannot be re-run alone (it needs its peers)")
    namespace = getattr(torch.ops, ns, None)
    if not isinstance(namespace, torch._ops._OpNamespace):
        raise UsageError(f"refused op {name}: {ns} is not an operator namespace")
    try:
        packet = getattr(namespace, op)
    except (AttributeError, RuntimeError):
        packet = None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise UsageError(f"refused op {name}: no operator {ns}::{op} is registered in this process (a custom op "
                         f"is registered when the code that defines it is imported)")
    try:
        resolved = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        resolved = None
    if not isinstance(resolved, torch._ops.OpOverload):
        raise UsageError(f"refused op {name}: {ns}::{op} has no overload {overload!r}")
    return resolved


def _kinds(t: Any) -> Iterator[str]:
    """The kinds of a schema argument's type, through Optional and List."""
    kind = t.kind()
    if kind in ("OptionalType", "ListType"):
        yield from _kinds(t.getElementType())
    else:
        yield kind


def check_op(op: torch._ops.OpOverload) -> None:
    """Refuse by schema an op the re-run must not call (:class:`~ckptverify.errors.UsageError`): one taking no tensor
    or device; one taking a type beyond tensors, numbers, dtypes, devices, generators (memory or objects it was not
    given); a string anywhere but beside a tensor input of torch's own ops (else it may name a file:
    ``aten.from_file``)."""
    name = str(op)
    arguments = op._schema.arguments
    # Whether it reads a tensor: a write-only out= buffer is not read.
    reads = any("TensorType" in _kinds(a.type) and not (a.kwarg_only and a.alias_info is not None
                                                          and a.alias_info.is_write) for a in arguments)
    if not any({"TensorType", "DeviceObjType"} & set(_kinds(a.type)) for a in arguments):
        raise UsageError(f"refused op {name}: it takes neither a tensor nor a device, so it computes on no tensor")
    for a in arguments:
        kinds = set(_kinds(a.type))
        if "StringType" in kinds:
            if op.namespace not in _TORCH_NAMESPACES or not reads:
                raise UsageError(f"refused op {name}: its string argument {a.name!r} may name a file or device "
                                 f"(only torch's own tensor operators take a string, as a mode)")
            kinds.discard("StringType")
        if not kinds <= _PLAIN_KINDS:
            raise UsageError(f"refused op {name}: it takes a {a.real_type} argument ({a.name!r}); only tensors, "
                             f"numbers, dtypes, devices and generators are re-run")


def load_capture(path: str | os.PathLike[str]) -> Capture:
    """Read a capture file safely (regular file, ``weights_only=True``, onto the host): a dict of ``op`` (str),
    ``args`` (list/tuple), ``kwargs`` (str keys), at most :data:`MAX_CAPTURE_BYTES` plus a sixteenth.
    :class:`~ckptverify.errors.UsageError` otherwise; a pickle global is refused unexecuted."""
    import torch

    path = os.fspath(path)
    try:
        fd, st = open_regular(path)
    except OSError as e:
        raise UsageError(f"cannot open capture file {path}: {e}") from e
    if st.st_size > MAX_CAPTURE_BYTES + MAX_CAPTURE_BYTES // 16:  # its tensors, and room for the pickle
        os.close(fd)
        raise UsageError(f"refused capture file {path}: {st.st_size} bytes, over the {MAX_CAPTURE_BYTES} bytes of "
                         f"tensors a capture may hold")
    try:
        with os.fdopen(fd, "rb") as f:
            data = torch.load(f, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        is_global, reason = _unpickler_reason(str(e))
        if is_global:
            raise UsageError(f"refused capture file {path}: it holds a pickle global, not only plain data and "
                             f"tensors ({reason})") from e
        raise UsageError(f"{path} is not a readable capture file: {reason}") from e
    except Exception as e:  # a truncated or foreign file: torch raises RuntimeError, EOFError, ...
        raise UsageError(f"{path} is not a readable capture file: {type(e).__name__}: {e}") from e
    if not isinstance(data, Mapping) or not {"op", "args", "kwargs"} <= set(data):
        raise UsageError(f"{path} is not a capture file: expected a dict with 'op', 'args' and 'kwargs'")
    op, args, kwargs = data["op"], data["args"], data["kwargs"]
    if not isinstance(op, str):
        raise UsageError(f"{path}: 'op' must be a string, got {type(op).__name__}")
    if not isinstance(args, (list, tuple)):
        raise UsageError(f"{path}: 'args' must be a list or tuple, got {type(args).__name__}")
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise UsageError(f"{path}: 'kwargs' must be a dict with string keys")
    return Capture(op=op, args=tuple(args), kwargs=dict(kwargs))


def _unpickler_reason(message: str) -> tuple[bool, str]:
    """Whether torch's weights-only unpickler refused a pickle global, and its reason without the advice to load
    unsafely."""
    lines = [" ".join(line.split()) for line in message.splitlines()]
    lines = [line.partition("WeightsUnpickler error:")[2].strip() or line for line in lines if line.strip()]
    lines = [line for line in lines if line and not line.startswith(("Weights only load failed", "Check the "
             "documentation", "(1)", "(2)", "Please file an issue")) and "WeightsUnpickler error:" not in line]
    is_global = "GLOBAL" in message
    chosen = next((line for line in lines if "GLOBAL" in line), None) if is_global else None
    reason = chosen or (lines[0] if lines else "the weights-only unpickler refused it")
    return is_global, reason.split(". ")[0].rstrip(".")


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelVerdict:
    """The op re-run alone: ``distinct`` results over ``runs``; indices of differing flattened outputs and written
    ``(args, kwargs)``; ``mechanism`` a :data:`MECHANISMS` key when nondeterministic. ``random``: the op is
    ``nondeterministic_seeded``, judged from one fixed generator state per run."""

    op: str
    device: str
    runs: int
    distinct: int
    outputs_differing: tuple[int, ...]
    nondeterministic: bool
    arguments_differing: tuple[int, ...] = ()
    mechanism: str | None
    random: bool = False
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op, "device": self.device, "runs": self.runs, "distinct": self.distinct,
            "outputs_differing": list(self.outputs_differing),
            "arguments_differing": list(self.arguments_differing), "nondeterministic": self.nondeterministic,
            "mechanism": self.mechanism,
            "mechanism_text": MECHANISMS[self.mechanism] if self.mechanism is not None else None,
            "random": self.random, "settings": dict(self.settings), "sentence": self.sentence(),
        }

    def finding(self) -> Finding:
        """The verdict as a finding: ``kernel-nondeterministic`` (a warning) or ``kernel-deterministic`` (info)."""
        make = warning if self.nondeterministic else info
        check = "kernel-nondeterministic" if self.nondeterministic else "kernel-deterministic"
        return make(check, self.sentence(), actual=self.to_dict(), location=Location(record=self.op))

    def sentence(self) -> str:
        """The verdict in one sentence."""
        if self.nondeterministic:
            assert self.mechanism is not None
            which = [f"output {i}" for i in self.outputs_differing] + \
                [f"written argument {i}" for i in self.arguments_differing]
            tf32 = ""
            if self.mechanism == "cublas-workspace" and self.settings.get("matmul_allow_tf32"):
                tf32 = ("; TF32 is on (torch.backends.cuda.matmul.allow_tf32), so its results also differ from a "
                        "run without it")
            elif self.mechanism in ("cudnn-benchmark", "cudnn-algorithm") and self.settings.get("cudnn_allow_tf32"):
                tf32 = ("; TF32 is on (torch.backends.cudnn.allow_tf32), so its results also differ from a run "
                        "without it")
            return (f"{self.op} is nondeterministic by itself on {self.device}: {self.runs} runs on the recorded "
                    f"inputs gave {self.distinct} different results ({', '.join(which)}); mechanism: "
                    f"{MECHANISMS[self.mechanism]}{tf32}.")
        if self.random:
            return (f"{self.op} draws from the random generator and is deterministic alone on {self.device} for a "
                    f"fixed generator state ({self.runs} runs agree): a difference at it comes from the generator's "
                    f"state (not restored, or consumed differently before it), or from the order or topology "
                    f"around it.")
        return (f"{self.op} is deterministic alone on {self.device} ({self.runs} runs on the recorded inputs agree): "
                f"the cause is the order or topology around it (its inputs' history, the scheduling, the number of "
                f"threads or ranks), not the kernel.")


def mechanism_of(op: torch._ops.OpOverload, device: str, settings: Mapping[str, Any]) -> str:
    """The documented mechanism that makes ``op`` nondeterministic on ``device`` (a key of :data:`MECHANISMS`)."""
    name = _name(op)
    if name.endswith("_") and not name.endswith("__") and name[:-1]:
        name = name[:-1]  # in place: index_add_ is index_add
    kind = device.split(":", 1)[0]
    atomics = _ATOMICS.get(kind, frozenset())
    if name in atomics or name.rstrip("_") in atomics:
        return "atomics"
    if kind == "cuda" and name in _MATMUL:
        return "cublas-workspace"
    if kind == "cuda" and name in _CONV:
        return "cudnn-benchmark" if settings.get("cudnn_benchmark") else "cudnn-algorithm"
    return "none"


def _digest(value: Any) -> list[int]:
    import torch
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(value)
    tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    out: list[int] = [xxhash.xxh3_128_intdigest(repr(x).encode()) for x in leaves]
    for (i, _), d in zip(tensors, tensor_digests([t for _, t in tensors]), strict=True):
        out[i] = d
    return out


def _differing(runs: list[list[int]]) -> tuple[int, ...]:
    width = max(len(r) for r in runs)
    return tuple(i for i in range(width) if len({r[i] if i < len(r) else None for r in runs}) > 1)


def _tensor_bytes(value: Any) -> int:
    """The logical bytes of the distinct tensors in ``value`` (``numel * element_size``: what a copy holds)."""
    import torch
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(value)
    seen = {id(x): x for x in leaves if isinstance(x, torch.Tensor)}
    return sum(x.numel() * x.element_size() for x in seen.values())


def _check_size(op: torch._ops.OpOverload, cap: Capture, device: torch.device) -> None:
    """Refuse before running a capture over :data:`MAX_CAPTURE_BYTES`, or whose op on meta tensors leaves more than
    ``OUTPUT_FACTOR`` times that plus ``OUTPUT_SLACK_BYTES`` or exceeds :data:`MAX_FLOPS`. An op that cannot be sized
    on meta is refused, unless it is outside torch's namespaces and takes no integer (its result size is then its own
    code's, not the capture's)."""
    import torch
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import FlopCounterMode

    try:
        captured = _tensor_bytes((cap.args, cap.kwargs))
    except Exception as e:  # a tensor without a size (a foreign layout)
        raise UsageError(f"refused capture of {cap.op}: a tensor in it has no size ({type(e).__name__}: {e})") from e
    if captured > MAX_CAPTURE_BYTES:
        raise UsageError(f"refused capture of {cap.op}: its tensors hold {captured} bytes, over the "
                         f"{MAX_CAPTURE_BYTES} a capture may hold")

    def meta(x: Any) -> Any:
        return x.detach().to("meta") if isinstance(x, torch.Tensor) else x

    try:
        args, kwargs = tree_map(meta, cap.args), tree_map(meta, cap.kwargs)
        # Device arguments become meta too, or a factory op would allocate for real.
        for i, a in enumerate(op._schema.arguments):
            if "DeviceObjType" in _kinds(a.type):
                if i < len(args) and not a.kwarg_only:
                    args = (*args[:i], torch.device("meta"), *args[i + 1:])
                else:
                    kwargs[a.name] = torch.device("meta")
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            out = op(*args, **kwargs)
        left = _tensor_bytes((out, args, kwargs))
    except Exception as e:  # no meta kernel, a size that depends on the values, inputs that do not fit the op
        sizing = sorted({a.name for a in op._schema.arguments if set(_kinds(a.type)) & _SIZING_KINDS})
        if op.namespace in _TORCH_NAMESPACES or sizing:
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            hint = "" if op.namespace in _TORCH_NAMESPACES else \
                f"; its integer arguments ({', '.join(sizing)}) may size them: register a fake implementation " \
                f"(torch.library.register_fake) so they can be sized"
            raise UsageError(f"refused op {cap.op}: the size of its results cannot be worked out before it runs "
                             f"(it failed on the captured inputs as meta tensors: {why}){hint}") from e
        return
    limit = OUTPUT_FACTOR * captured + OUTPUT_SLACK_BYTES
    if left > limit:
        raise UsageError(f"refused op {cap.op}: on the captured inputs it would leave {left} bytes of tensors, over "
                         f"its limit of {limit} ({OUTPUT_FACTOR} times the {captured} captured bytes plus "
                         f"{OUTPUT_SLACK_BYTES})")
    flops, most = counter.get_total_flops(), MAX_FLOPS.get(device.type, MAX_FLOPS["default"])
    if flops > most:
        raise UsageError(f"refused op {cap.op}: one run would take {flops:.3g} floating-point operations, over the "
                         f"{most:.3g} allowed on {device.type}")


def rerun(capture: str | os.PathLike[str] | Capture, *, runs: int = 5, device: str | None = None,
          seed: int = 0, timeout_s: float = RERUN_TIMEOUT_S) -> KernelVerdict:
    """Run the captured op alone ``runs`` times on fresh copies of its inputs on ``device`` (default host), each from
    generator state ``seed``, and judge whether the results agree. Checked first by :func:`check_op` and
    :func:`_check_size`; stops before a run that would end past ``timeout_s``. A refusal, a failure on the inputs or
    a timeout is a :class:`~ckptverify.errors.UsageError`."""
    import torch
    from torch.utils._pytree import tree_map

    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 2:
        raise UsageError(f"runs must be an integer of at least 2 (a kernel is judged against itself), got {runs!r}")
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0 \
            or not math.isfinite(timeout_s):
        raise UsageError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    cap = capture if isinstance(capture, Capture) else load_capture(capture)
    op = resolve_op(cap.op)
    check_op(op)
    try:
        target = torch.device(device) if device is not None else torch.device("cpu")
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"not a device: {device!r} ({e})") from e
    if target.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"cannot re-run {cap.op} on {target}: CUDA is not available here")
    _check_size(op, cap, target)
    settings = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }

    def fresh(x: Any) -> Any:
        # A copy per run: an in-place op would otherwise feed its own result to the next run.
        return x.detach().to(target, copy=True) if isinstance(x, torch.Tensor) else x

    devices = [target.index if target.index is not None else torch.cuda.current_device()] \
        if target.type == "cuda" else []
    results: list[tuple[list[int], list[int]]] = []
    start = time.monotonic()
    for done in range(runs):
        if done:
            # A started run cannot be stopped: stop before one that would end past the limit.
            now = time.monotonic()
            if now + (now - start) / done > start + timeout_s:
                raise UsageError(f"re-running {cap.op} on {target} stopped after {done} of {runs} runs "
                                 f"({now - start:.1f} s): the next run would end past its time limit of "
                                 f"{timeout_s:g} s")
        args, kwargs = tree_map(fresh, cap.args), tree_map(fresh, cap.kwargs)
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            try:
                with torch.no_grad():
                    out = op(*args, **kwargs)
            except Exception as e:  # the captured arguments do not fit the op
                raise UsageError(f"{cap.op} failed on the captured inputs on {target}: {type(e).__name__}: {e}") from e
            # In-place and out= ops write their arguments: those are results too.
            try:
                results.append((_digest(out), _digest((args, kwargs))))
            except Exception as e:  # a result the fingerprint cannot read (a quantized or meta tensor)
                raise UsageError(f"cannot fingerprint the results of {cap.op} on {target}: {type(e).__name__}: "
                                 f"{e}") from e
    distinct = len({(tuple(o), tuple(w)) for o, w in results})
    nondeterministic = distinct > 1
    return KernelVerdict(
        op=cap.op, device=str(target), runs=runs, distinct=distinct,
        outputs_differing=_differing([o for o, _ in results]), arguments_differing=_differing([w for _, w in results]),
        nondeterministic=nondeterministic,
        mechanism=mechanism_of(op, str(target), settings) if nondeterministic else None,
        random=torch.Tag.nondeterministic_seeded in op.tags, settings=settings,
    )
