"""The last rung of the ladder: is the origin op nondeterministic by itself, and by what mechanism?

:func:`rerun` loads the inputs the recorder captured for one op (``OpWindow.capture``: a ``torch.save`` of
``{"op": "<ns>.<name>.<overload>", "args": ..., "kwargs": ...}``, tensors on the host), runs that op alone on
fresh copies of them several times, and compares the fingerprints of its outputs. Outputs that differ among
the runs mean the kernel is nondeterministic by itself: the verdict names the mechanism torch documents for it
where there is one (atomics for the ops ``torch.use_deterministic_algorithms`` lists, the cuBLAS workspace for
matrix products, cuDNN's algorithm choice for convolutions), and otherwise says no mechanism is documented (a
custom or extension kernel). Outputs that agree mean the op is deterministic alone: the difference comes from
the order or topology around it (its inputs' history, the scheduling, the number of threads or ranks).

The capture file is untrusted input: it is loaded with ``torch.load(weights_only=True)`` (plain data and
tensors only; a pickle global is refused, never called), and the op is resolved only as a registered operator
``torch.ops.<ns>.<name>.<overload>`` after its name is checked; anything else is refused with a
:class:`~ckptverify.errors.UsageError` (exit 2). Collectives are refused too: one alone has no peers.

:func:`nvtx_site` marks an op site with an NVTX range on CUDA (a no-op elsewhere), so ``nsys`` can map kernels
to the sites of an op trace (``docs/locate.md``, section "Kernel and mechanism").
"""

from __future__ import annotations

import functools
import os
import pickle
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from ckptverify.errors import UsageError
from ckptverify.findings import Finding, Location, info, warning
from ckptverify.safeparse.readers import open_regular
from ckptverify.trace.category import tensor_digests

if TYPE_CHECKING:
    import torch

    from ckptverify.trace.oplog import OpKey

__all__ = [
    "MECHANISMS",
    "Capture",
    "KernelVerdict",
    "load_capture",
    "mechanism_of",
    "nvtx_enabled",
    "nvtx_site",
    "rerun",
    "resolve_op",
    "site_name",
]

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

# Ops (name without namespace and overload, in-place and out= forms included) that torch's
# use_deterministic_algorithms documentation lists as nondeterministic, and on which devices: they accumulate
# with atomics (or, for the backward of pooling, padding and interpolation, scatter their gradient that way).
_ATOMICS: dict[str, frozenset[str]] = {}
for _names, _devices in (
    (("index_add", "scatter_add", "scatter_reduce", "scatter", "put", "index_put", "_index_put_impl",
      "embedding_dense_backward", "_embedding_bag_backward", "_embedding_bag_dense_backward",
      "_embedding_bag_per_sample_weights_backward", "histc", "bincount", "cumsum", "median", "gather_backward",
      "index_select_backward", "repeat_interleave", "max_pool3d_with_indices_backward", "avg_pool3d_backward",
      "adaptive_avg_pool2d_backward", "_adaptive_avg_pool2d_backward", "adaptive_avg_pool3d_backward",
      "_adaptive_avg_pool3d_backward", "adaptive_max_pool2d_backward", "fractional_max_pool2d_backward",
      "fractional_max_pool3d_backward", "max_unpool1d", "max_unpool2d", "max_unpool3d",
      "upsample_linear1d_backward", "upsample_bilinear2d_backward", "upsample_bicubic2d_backward",
      "upsample_trilinear3d_backward", "reflection_pad1d_backward", "reflection_pad2d_backward",
      "reflection_pad3d_backward", "replication_pad1d_backward", "replication_pad2d_backward",
      "replication_pad3d_backward", "nll_loss2d_forward", "nll_loss_forward", "_ctc_loss_backward",
      "grid_sampler_2d_backward", "grid_sampler_3d_backward", "index_copy"), ("cuda",)),
    (("index_put", "_index_put_impl", "put", "index_copy"), ("cpu",)),
):
    for _name in _names:
        _ATOMICS[_name] = _ATOMICS.get(_name, frozenset()) | frozenset(_devices)

_MATMUL = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "addmv", "mv", "dot", "vdot",
                     "_scaled_mm", "_addmm_activation", "_int_mm", "_grouped_mm", "_scaled_grouped_mm"})
_CONV = frozenset({"convolution", "_convolution", "convolution_backward", "cudnn_convolution",
                   "cudnn_convolution_transpose", "cudnn_convolution_relu", "cudnn_convolution_add_relu",
                   "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})

# A segment of an operator name: an identifier that is not a dunder (which would reach Python attributes of
# the namespace objects instead of operators).
_SEGMENT = r"(?!__)[A-Za-z_][A-Za-z0-9_]*"
_OP_NAME = re.compile(rf"({_SEGMENT})\.({_SEGMENT})\.({_SEGMENT})")
# One collective alone has no peers to run with.
_REFUSED_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})


# ------------------------------------------------------------------------------------------- NVTX


def site_name(key: OpKey) -> str:
    """The name of an op site, as NVTX ranges and reports spell it: ``step<s>/<phase>/<module>/<op>#<occ>``."""
    step, phase, module, op, occurrence = key
    return f"step{step}/{phase}/{module or '-'}/{op}#{occurrence}"


@functools.cache
def _nvtx_enabled() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def nvtx_enabled() -> bool:
    """Whether :func:`nvtx_site` pushes ranges in this process (CUDA is there; asked once)."""
    return _nvtx_enabled()


@contextmanager
def nvtx_site(name: str) -> Iterator[None]:
    """An NVTX range named ``name`` around the block on CUDA, so ``nsys profile --trace=cuda,nvtx`` puts the
    kernels the block launches under the site; nothing without CUDA. Whether CUDA is there is asked once per
    process (this is called around every op of a window)."""
    if not _nvtx_enabled():
        yield
        return
    import torch

    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


# ------------------------------------------------------------------------------------------- capture


@dataclass(frozen=True, slots=True, kw_only=True)
class Capture:
    """One op's captured call: ``op`` its name (``<ns>.<name>.<overload>``), ``args``/``kwargs`` its arguments."""

    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def resolve_op(name: Any) -> torch._ops.OpOverload:
    """The registered operator ``torch.ops.<ns>.<name>.<overload>`` that ``name`` (``"<ns>.<name>.<overload>"``)
    names. Raises :class:`~ckptverify.errors.UsageError` for anything else: a name of another shape, a
    collective, an operator not registered in this process (a custom op is registered by importing the code
    that defines it). Never evaluates the name."""
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


def load_capture(path: str | os.PathLike[str]) -> Capture:
    """Read a capture file safely: a regular file, loaded with ``torch.load(weights_only=True)`` onto the host,
    holding a dict with ``op`` (a string), ``args`` (a list or tuple) and ``kwargs`` (a dict with string keys).
    Raises :class:`~ckptverify.errors.UsageError` for anything else (a pickle global is refused unexecuted)."""
    import torch

    path = os.fspath(path)
    try:
        fd, _ = open_regular(path)
    except OSError as e:
        raise UsageError(f"cannot open capture file {path}: {e}") from e
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
    """Whether torch's weights-only unpickler refused a pickle global, and its reason, without its advice to
    load the file unsafely (its wording differs between the kinds of refusal)."""
    lines = [" ".join(line.split()) for line in message.splitlines()]
    lines = [line.partition("WeightsUnpickler error:")[2].strip() or line for line in lines if line.strip()]
    lines = [line for line in lines if line and not line.startswith(("Weights only load failed", "Check the "
             "documentation", "(1)", "(2)", "Please file an issue")) and "WeightsUnpickler error:" not in line]
    is_global = "GLOBAL" in message
    chosen = next((line for line in lines if "GLOBAL" in line), None) if is_global else None
    reason = chosen or (lines[0] if lines else "the weights-only unpickler refused it")
    return is_global, reason.split(". ")[0].rstrip(".")


# ------------------------------------------------------------------------------------------- verdict


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelVerdict:
    """The op re-run alone. ``runs``: how many times; ``distinct``: how many different results they gave;
    ``outputs_differing``: the indices (in the flattened outputs) of those that differ among runs,
    ``arguments_differing`` those of the flattened ``(args, kwargs)`` an in-place or ``out=`` op wrote;
    ``nondeterministic``: ``distinct > 1``; ``mechanism``: a key of :data:`MECHANISMS` when nondeterministic
    (``None`` otherwise); ``random``: the op draws from a random generator (tagged ``nondeterministic_seeded``:
    every run starts from the same generator state, so its results are compared as for any op); ``settings``:
    the determinism settings in force."""

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


def _settings() -> dict[str, Any]:
    import torch

    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def _base_name(op: torch._ops.OpOverload) -> str:
    """The op's name without namespace and overload, and without the in-place ``_`` of ``index_add_``."""
    name = op._schema.name.split("::", 1)[-1]
    return name[:-1] if name.endswith("_") and not name.endswith("__") and name[:-1] else name


def mechanism_of(op: torch._ops.OpOverload, device: str, settings: Mapping[str, Any]) -> str:
    """The documented mechanism that makes ``op`` nondeterministic on ``device`` (a key of :data:`MECHANISMS`)."""
    name = _base_name(op)
    kind = device.split(":", 1)[0]
    if kind in _ATOMICS.get(name, frozenset()) or kind in _ATOMICS.get(name.rstrip("_"), frozenset()):
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


def rerun(capture: str | os.PathLike[str] | Capture, *, runs: int = 5, device: str | None = None,
          seed: int = 0) -> KernelVerdict:
    """Run the captured op alone ``runs`` times on fresh copies of its inputs (moved to ``device``, default:
    the host) and judge whether its outputs agree. Each run starts from the same random generator state
    (``seed``), so a random op is judged as a kernel, not by its generator. An op that fails on its inputs is a
    :class:`~ckptverify.errors.UsageError` (exit 2)."""
    import torch
    from torch.utils._pytree import tree_map

    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 2:
        raise UsageError(f"runs must be an integer of at least 2 (a kernel is judged against itself), got {runs!r}")
    cap = capture if isinstance(capture, Capture) else load_capture(capture)
    op = resolve_op(cap.op)
    try:
        target = torch.device(device) if device is not None else torch.device("cpu")
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"not a device: {device!r} ({e})") from e
    if target.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"cannot re-run {cap.op} on {target}: CUDA is not available here")
    settings = _settings()

    def fresh(x: Any) -> Any:
        # A copy per run: an in-place op would otherwise feed its own result to the next run.
        return x.detach().to(target, copy=True) if isinstance(x, torch.Tensor) else x

    devices = [target.index if target.index is not None else torch.cuda.current_device()] \
        if target.type == "cuda" else []
    results: list[tuple[list[int], list[int]]] = []
    for _ in range(runs):
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
