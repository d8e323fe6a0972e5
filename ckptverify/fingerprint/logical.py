"""The logical tensor fingerprint: an identity of a tensor's *values* (see ``docs/fingerprint.md``).

Independent of how the tensor is sharded or serialized: :func:`tensor_fingerprint` for a whole tensor (or a
``DTensor``), :func:`chunk_fingerprint` for one chunk of a global tensor, and :func:`combine` to add chunk
fingerprints up to the whole. The arithmetic runs in :mod:`ckptverify.fingerprint.kernels` (imported, and
torch with it, only when a tensor is fingerprinted); the constants are :mod:`ckptverify.fingerprint.spec`'s.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptverify.errors import UsageError
from ckptverify.fingerprint.spec import FINGERPRINT_VERSION, signed
from ckptverify.fingerprint.spec import MASK64 as _MASK64

if TYPE_CHECKING:
    import torch

__all__ = ["FINGERPRINT_VERSION", "BlockwiseFingerprint", "TensorFingerprint", "blockwise_fingerprint",
           "chunk_fingerprint", "chunk_fingerprint_counted", "combine",
           "get_fingerprint_backend", "part_fingerprints", "set_fingerprint_backend", "tensor_fingerprint"]


@dataclass(frozen=True)
class TensorFingerprint:
    """The logical fingerprint of a tensor (or of part of one).

    ``value`` is 128 bits as 32 hex digits: lane 0 then lane 1, each 16 digits. ``shape`` is the *global*
    shape; ``elements`` counts the elements that contributed (``prod(shape)`` for a whole tensor; less for
    a single chunk). Two fingerprints describe equal tensors when all fields are equal.
    """

    value: str
    dtype: str
    shape: tuple[int, ...]
    version: int = FINGERPRINT_VERSION
    elements: int = 0

    @property
    def lanes(self) -> tuple[int, int]:
        return int(self.value[:16], 16), int(self.value[16:], 16)

    @property
    def complete(self) -> bool:
        """Whether every element of the global shape contributed exactly once (by count)."""
        n = 1
        for size in self.shape:
            n *= size
        return self.elements == n

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "version": self.version,
            "elements": self.elements,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorFingerprint:
        return cls(
            value=str(data["value"]),
            dtype=str(data["dtype"]),
            shape=tuple(int(s) for s in data["shape"]),
            version=int(data["version"]),
            elements=int(data["elements"]),
        )

    @classmethod
    def from_lanes(cls, lanes: tuple[int, int], dtype: str, shape: Sequence[int], elements: int) -> TensorFingerprint:
        value = f"{lanes[0] & _MASK64:016x}{lanes[1] & _MASK64:016x}"
        return cls(value, dtype, tuple(int(s) for s in shape), FINGERPRINT_VERSION, int(elements))


def combine(parts: Iterable[TensorFingerprint]) -> TensorFingerprint:
    """Add chunk fingerprints of one global tensor up to the fingerprint of the chunks together.

    The chunks must be disjoint; when they cover the tensor the result equals :func:`tensor_fingerprint`
    of the whole. All parts must agree on dtype, global shape and version.
    """
    parts = list(parts)
    if not parts:
        raise UsageError("combine() needs at least one fingerprint")
    first = parts[0]
    lane0 = lane1 = elements = 0
    for part in parts:
        if (part.dtype, part.shape, part.version) != (first.dtype, first.shape, first.version):
            raise UsageError(
                "cannot combine fingerprints of different tensors: "
                f"{first.dtype}{list(first.shape)} v{first.version} vs "
                f"{part.dtype}{list(part.shape)} v{part.version}"
            )
        a, b = part.lanes
        lane0 += a
        lane1 += b
        elements += part.elements
    return TensorFingerprint.from_lanes((lane0, lane1), first.dtype, first.shape, elements)


def chunk_fingerprint(t: torch.Tensor, global_offsets: Sequence[int], global_shape: Sequence[int]) -> TensorFingerprint:
    """Fingerprint of the chunk ``t`` that sits at ``global_offsets`` in a tensor of ``global_shape``.

    Computed on ``t``'s device. Chunk fingerprints of disjoint chunks :func:`combine` to the fingerprint of
    their union; of a covering set of chunks, to :func:`tensor_fingerprint` of the whole tensor.
    """
    return _chunk_fingerprint(t, global_offsets, global_shape, counted=False)[0]


def chunk_fingerprint_counted(
    t: torch.Tensor, global_offsets: Sequence[int], global_shape: Sequence[int]
) -> tuple[TensorFingerprint, int | None]:
    """:func:`chunk_fingerprint`, and how many of the chunk's elements are NaN or infinite, where the pass that
    fingerprinted it counted them on the same read of the chunk (the compiled kernel on CPU, for the dtypes in
    ``kernels.SPECIAL_BITS``); ``None`` where it did not, and the caller counts them itself. The fingerprint
    is the same as :func:`chunk_fingerprint`'s."""
    return _chunk_fingerprint(t, global_offsets, global_shape, counted=True)


def _chunk_fingerprint(t: torch.Tensor, global_offsets: Sequence[int], global_shape: Sequence[int],
                       counted: bool) -> tuple[TensorFingerprint, int | None]:
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint.subclass import is_wrapper_subclass

    offsets = [int(o) for o in global_offsets]
    gshape = [int(s) for s in global_shape]
    if is_wrapper_subclass(t):
        # Its values are in its parts, which a chunk of the outer tensor does not address: whole tensors only.
        if any(offsets) or gshape != list(t.shape):
            raise UsageError(f"a chunk of a {type(t).__name__} has no fingerprint (only the whole tensor has)")
        return _subclass_fingerprint(t), None
    name = kern.dtype_name(t.dtype)
    if counted:
        lanes, count = kern.fingerprint_lanes_counted(t, offsets, gshape, name)
    else:
        lanes, count = kern.fingerprint_lanes(t, offsets, gshape, name), None
    return TensorFingerprint.from_lanes(lanes, name, gshape, t.numel()), count


class BlockwiseFingerprint:
    """:func:`chunk_fingerprint_counted` of one contiguous CPU chunk, taken a few blocks at a time as its bytes
    become ready: for a caller that reads those bytes anyway (a save writing them), so the fingerprint reads each
    block while it is still in the cache instead of in a pass of its own over memory. Made by
    :func:`blockwise_fingerprint`. Calls must not overlap (one caller at a time, from any thread)."""

    def __init__(self, runner: Any, name: str, global_shape: list[int], numel: int, counted: bool) -> None:
        self._runner = runner
        self._name = name
        self._shape = global_shape
        self._numel = numel
        self._counted = counted
        self._next = 0
        self._sums = [0, 0, 0]

    @property
    def nbytes(self) -> int:
        """The chunk's bytes (from its first element)."""
        return self._runner.byte_ends[-1]

    def advance(self, ready: int) -> None:
        """Fingerprint the blocks that lie within the chunk's first ``ready`` bytes and are not done yet."""
        ends = self._runner.byte_ends
        hi = self._next
        while hi < len(ends) and ends[hi] <= ready:
            hi += 1
        if hi > self._next:
            a, b, c = self._runner.run(self._next, hi)
            self._sums[0] += a
            self._sums[1] += b
            self._sums[2] += c
            self._next = hi

    @property
    def complete(self) -> bool:
        """Whether every block is fingerprinted."""
        return self._next == len(self._runner.byte_ends)

    def result(self) -> tuple[TensorFingerprint, int | None]:
        """What :func:`chunk_fingerprint_counted` gives for the chunk (call once :attr:`complete`)."""
        if not self.complete:
            raise RuntimeError("the chunk's fingerprint is not complete")
        lanes = (self._sums[0] & _MASK64, self._sums[1] & _MASK64)
        fp = TensorFingerprint.from_lanes(lanes, self._name, self._shape, self._numel)
        return fp, self._sums[2] if self._counted else None


def blockwise_fingerprint(t: torch.Tensor, global_offsets: Sequence[int],
                          global_shape: Sequence[int]) -> BlockwiseFingerprint | None:
    """A :class:`BlockwiseFingerprint` of chunk ``t`` when the compiled CPU kernel would take its fingerprint now
    and ``t`` is contiguous (:func:`~ckptverify.fingerprint.kernels.cpu_block_lanes`); else ``None``: take it with
    :func:`chunk_fingerprint_counted`."""
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint.subclass import is_wrapper_subclass

    if is_wrapper_subclass(t):
        return None
    offsets = [int(o) for o in global_offsets]
    gshape = [int(s) for s in global_shape]
    try:
        name = kern.dtype_name(t.dtype)
    except UsageError:
        return None
    screen = kern.SPECIAL_BITS.get(t.dtype)
    runner = kern.cpu_block_lanes(t.detach(), offsets, gshape, name, screen)
    if runner is None or not runner.byte_ends:
        return None
    return BlockwiseFingerprint(runner, name, gshape, t.numel(), screen is not None)


def tensor_fingerprint(t: torch.Tensor) -> TensorFingerprint:
    """Fingerprint of a whole tensor, computed on its own device.

    A ``DTensor`` is fingerprinted collectively: each rank fingerprints its local shard at its global
    offsets and the lanes are summed across the device mesh, so every rank returns the fingerprint of the
    global tensor. Every rank of the mesh must call this.

    A wrapper subclass (torchao's ``MXTensor``, ``NVFP4Tensor``, ...) is fingerprinted by its parts
    (:mod:`ckptverify.fingerprint.subclass`): its ``value`` is the digest of its class, context and parts'
    fingerprints (not a lane sum: it does not :func:`combine` with anything), ``dtype`` its outer dtype.
    """
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint.subclass import is_wrapper_subclass

    dtensor_type = _dtensor_type()
    if dtensor_type is not None and isinstance(t, dtensor_type):
        return _dtensor_fingerprint(t)
    if is_wrapper_subclass(t):
        return _subclass_fingerprint(t)
    name = kern.dtype_name(t.dtype)
    shape = list(t.shape)
    lanes = kern.fingerprint_lanes(t, [0] * len(shape), shape, name)
    return TensorFingerprint.from_lanes(lanes, name, shape, t.numel())


def set_fingerprint_backend(name: str) -> None:
    """How CPU tensors are fingerprinted: ``"numpy"`` (one numpy pass over cache-sized blocks, on torch's number
    of threads; never compiles), ``"compiled"`` (the ``torch.compile`` fused kernel for large chunks, compiled at
    the first one, waiting) or ``"auto"`` (the default: numpy, and the compiled kernel once it is ready: it is
    compiled in a background thread once 1 GiB went through numpy in the process). CUDA tensors take the Triton
    kernel where it imports and eager torch otherwise, other devices eager torch, whatever the backend. All give
    the same values; the fused kernels are checked against eager before first use. The environment variable
    ``CKPTVERIFY_FINGERPRINT_BACKEND`` sets the initial choice."""
    from ckptverify.fingerprint import kernels as kern

    kern.set_backend(name)


def get_fingerprint_backend() -> str:
    from ckptverify.fingerprint import kernels as kern

    return kern.get_backend()


# ------------------------------------------------------------------------------------- wrapper subclasses


def part_fingerprints(t: torch.Tensor) -> dict[str, TensorFingerprint]:
    """The fingerprint of each inner tensor of a wrapper subclass, by the name ``__tensor_flatten__`` gives it
    (``qdata``, ``scale``, ...); an inner subclass is fingerprinted by its own parts. Raises
    :class:`~ckptverify.errors.UsageError` for a tensor that is not a wrapper subclass."""
    from ckptverify.fingerprint.subclass import flatten, is_wrapper_subclass

    if not is_wrapper_subclass(t):
        raise UsageError(f"a {type(t).__name__} is not a tensor subclass with parts")
    return {name: tensor_fingerprint(part) for name, part in flatten(t).parts}


def _subclass_fingerprint(t: Any) -> TensorFingerprint:
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint.subclass import combine_parts, flatten

    flat = flatten(t)
    dtype = kern.dtype_name(t.dtype)
    shape = [int(s) for s in t.shape]
    parts = [(name, tensor_fingerprint(part)) for name, part in flat.parts]
    value = combine_parts(flat.label, dtype, shape, flat.context, parts)
    return TensorFingerprint(value, dtype, tuple(shape), FINGERPRINT_VERSION, t.numel())


# ------------------------------------------------------------------------------------------- DTensor


def _dtensor_type() -> type | None:
    """``DTensor``, if its module is loaded (a tensor cannot be a DTensor otherwise)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


#: A DTensor's local shard that is not one box of the global tensor (``_StridedShard``) is fingerprinted as the
#: boxes it is made of; beyond this many boxes it is refused rather than gathered.
MAX_SHARD_BOXES = 1 << 16


def _dtensor_fingerprint(t: Any) -> TensorFingerprint:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    from ckptverify.fingerprint import kernels as kern

    mesh = t.device_mesh
    placements = list(t.placements)
    name = kern.dtype_name(t.dtype)
    gshape = list(t.shape)
    if any(p.is_partial() for p in placements):
        # Pending reductions: the local values are not the tensor's values until they are reduced (a reduction,
        # not a gather: each rank keeps its shard's size).
        if t.to_local().device.type != mesh.device_type:
            raise UsageError(f"cannot fingerprint a DTensor with a Partial placement whose local tensor is on "
                             f"{t.to_local().device.type}, not on its mesh's {mesh.device_type}: reduce it first")
        placements = [Replicate() if p.is_partial() else p for p in placements]
        t = t.redistribute(mesh, placements)

    local = t.to_local()
    coordinate = mesh.get_coordinate()
    # Replicated mesh dims hold the same shard several times: only coordinate 0 of each contributes.
    contributes = coordinate is not None and all(
        coordinate[d] == 0 for d, p in enumerate(placements) if isinstance(p, Replicate)
    )
    lanes, count = (0, 0), 0
    if contributes and local.numel():
        # Each element's global index is known from where the placements put the shard's rows along each
        # dimension, so no placement needs a gather: the shard is fingerprinted box by box at global offsets.
        index = _shard_indices(gshape, mesh, placements, coordinate)
        if [len(ix) for ix in index] != list(local.shape):
            raise UsageError(f"DTensor local shard has shape {list(local.shape)}, expected "
                             f"{[len(ix) for ix in index]}")
        sums = [0, 0]
        for box, offsets in _boxes(index):
            a, b = kern.fingerprint_lanes(local[box], offsets, gshape, name)
            sums[0] += a
            sums[1] += b
        lanes, count = (sums[0] & _MASK64, sums[1] & _MASK64), local.numel()

    # Sum over the whole mesh, one mesh dimension at a time. All-gather (exact) then add modulo 2**64.
    values = [signed(lanes[0]), signed(lanes[1]), count]
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        size = dist.get_world_size(group)
        device = _collective_device(group, local.device, mesh.device_type)
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        gathered = torch.empty(size * 3, dtype=torch.int64, device=device)
        with warnings.catch_warnings():
            # torch 2.13 marks the name deprecated in favour of one older releases lack; same collective.
            warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
            dist.all_gather_into_tensor(gathered, mine, group=group)
        rows = gathered.view(size, 3).tolist()
        values = [
            signed(sum(r[0] for r in rows)),
            signed(sum(r[1] for r in rows)),
            sum(r[2] for r in rows),
        ]
    return TensorFingerprint.from_lanes((values[0], values[1]), name, gshape, values[2])


def _shard_indices(gshape: list[int], mesh: Any, placements: list[Any], coordinate: list[int]) -> list[Any]:
    """For each dimension of the global tensor, the global index of each of the local shard's positions along
    it, in order (a 1-D int64 tensor): the placements applied left to right over the mesh dimensions, as DTensor
    applies them (``Shard`` keeps a slice of the positions, ``_StridedShard`` an interleaving of slices).
    Placements that shard nothing (``Replicate``) keep every position."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    index = [torch.arange(n) for n in gshape]
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        current = index[p.dim] if isinstance(p, Shard) or _is_strided_shard(p) else None
        if current is None:
            raise UsageError(f"cannot fingerprint a DTensor placed as {p!r} without gathering it")
        num_chunks, rank = mesh.size(mesh_dim), coordinate[mesh_dim]
        if _is_strided_shard(p):
            index[p.dim] = _strided_positions(p, current, num_chunks, rank)
        else:
            size, start = Shard.local_shard_size_and_offset(len(current), num_chunks, rank)
            index[p.dim] = current[int(start) : int(start) + int(size)]
    return index


def _is_strided_shard(p: Any) -> bool:
    return type(p).__name__ == "_StridedShard"


def _strided_positions(p: Any, current: Any, num_chunks: int, rank: int) -> Any:
    """Of the positions ``current`` (1-D) along its dimension, those a ``_StridedShard`` keeps on mesh coordinate
    ``rank``, in local order: split by the placement's own ``_split_tensor``, the function DTensor distributes a
    tensor with (its offset helpers differ between torch releases; this one does not)."""
    try:
        shards, _ = p._split_tensor(current.reshape([1] * p.dim + [len(current)]), num_chunks, with_padding=False)
        return shards[rank].reshape(-1)
    except (AttributeError, TypeError, IndexError):  # pragma: no cover - another torch's private API
        raise UsageError(f"this torch does not say where a {p!r} shard's elements lie: not fingerprinted") from None


def _runs(positions: Any) -> list[tuple[int, int, int]]:
    """``positions`` (a 1-D int64 tensor: global indices along one dimension, in local order) as maximal runs of
    consecutive indices: ``(local start, global start, length)``."""
    import torch

    n = len(positions)
    if n == 0:
        return []
    breaks = (torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, n]
    firsts = positions[torch.tensor(starts)].tolist()
    return [(lo, g, hi - lo) for lo, hi, g in zip(starts, ends, firsts, strict=True)]


def _boxes(index: list[Any]) -> list[tuple[tuple[slice, ...], list[int]]]:
    """The local shard as boxes of the global tensor: for each combination of one run per dimension, the slice
    of the shard it is and its global offsets. Disjoint, covering the shard: their lane sums add up to its."""
    import itertools

    per_dim = [_runs(ix) for ix in index]
    total = 1
    for runs in per_dim:
        total *= len(runs)
    if total > MAX_SHARD_BOXES:
        raise UsageError(f"a DTensor shard made of {total} separate boxes of its global tensor is not fingerprinted "
                         f"(at most {MAX_SHARD_BOXES}); fingerprint its full_tensor() instead")
    out = []
    for combo in itertools.product(*per_dim):
        box = tuple(slice(local, local + n) for local, _, n in combo)
        out.append((box, [start for _, start, _ in combo]))
    return out


def _collective_device(group: Any, local_device: Any, mesh_device_type: str) -> Any:
    """The device the lane sums travel on over ``group``: the local shard's, where the group's backend serves
    that device type; else one the backend serves (a CPU-offloaded shard over NCCL: the mesh's current CUDA
    device). NCCL never receives a CPU tensor."""
    import torch

    served = _backend_device_types(group) or {mesh_device_type}
    if local_device.type in served:
        return local_device
    if "cpu" in served:
        return torch.device("cpu")
    kind = mesh_device_type if mesh_device_type in served else sorted(served)[0]
    return torch.device(kind, _current_index(kind))


def _backend_device_types(group: Any) -> set[str]:
    """Device types the group's backend takes tensors on: ``"cpu:gloo,cuda:nccl"`` names them; NCCL takes CUDA
    tensors, Gloo CPU and CUDA ones; empty for any other backend (the caller takes its mesh's device type)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:
        return {pair.split(":")[0].strip() for pair in backend.split(",")}
    return {"nccl": {"cuda"}, "gloo": {"cpu", "cuda"}}.get(backend, set())


def _current_index(kind: str) -> int:
    import torch

    module = getattr(torch, kind, None)
    return int(module.current_device()) if module is not None and hasattr(module, "current_device") else 0
