"""The logical tensor fingerprint: an identity of a tensor's *values*, independent of sharding or serialization
(``docs/fingerprint.md``). Arithmetic is in :mod:`ckptverify.fingerprint.kernels` (torch imported only when a
tensor is fingerprinted); constants in :mod:`ckptverify.fingerprint.spec`."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ckptverify.errors import UsageError
from ckptverify.fingerprint.spec import FINGERPRINT_VERSION, add_lanes, signed
from ckptverify.fingerprint.spec import MASK64 as _MASK64

if TYPE_CHECKING:
    import torch

__all__ = ["FINGERPRINT_VERSION", "BlockwiseFingerprint", "TensorFingerprint", "blockwise_fingerprint",
           "chunk_fingerprint", "chunk_fingerprint_counted", "collective_device", "combine",
           "get_fingerprint_backend", "part_fingerprints", "set_fingerprint_backend", "tensor_fingerprint"]


@dataclass(frozen=True)
class TensorFingerprint:
    """The logical fingerprint of a tensor (or part of one). ``value``: 128 bits as 32 hex digits (lane 0, lane 1);
    ``shape``: the *global* shape; ``elements``: elements that contributed. Equal fields mean equal tensors."""

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
        return self.elements == math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape)}

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
    """Add fingerprints of disjoint chunks of one tensor (same dtype, global shape, version); covering chunks give
    :func:`tensor_fingerprint` of the whole."""
    parts = list(parts)
    if not parts:
        raise UsageError("combine() needs at least one fingerprint")
    first = parts[0]
    for part in parts:
        if (part.dtype, part.shape, part.version) != (first.dtype, first.shape, first.version):
            raise UsageError(
                "cannot combine fingerprints of different tensors: "
                f"{first.dtype}{list(first.shape)} v{first.version} vs "
                f"{part.dtype}{list(part.shape)} v{part.version}"
            )
    return TensorFingerprint.from_lanes(add_lanes(p.lanes for p in parts), first.dtype, first.shape,
                                        sum(p.elements for p in parts))


def chunk_fingerprint(t: torch.Tensor, global_offsets: Sequence[int], global_shape: Sequence[int]) -> TensorFingerprint:
    """Fingerprint of chunk ``t`` at ``global_offsets`` in a tensor of ``global_shape``, computed on ``t``'s device.
    Disjoint chunks :func:`combine`; a covering set gives :func:`tensor_fingerprint` of the whole."""
    return _chunk_fingerprint(t, global_offsets, global_shape, counted=False)[0]


def chunk_fingerprint_counted(
    t: torch.Tensor, global_offsets: Sequence[int], global_shape: Sequence[int]
) -> tuple[TensorFingerprint, int | None]:
    """:func:`chunk_fingerprint` plus the NaN/Inf count where the same pass counted it (compiled CPU kernel,
    ``kernels.SPECIAL_BITS`` dtypes); else ``None`` and the caller counts."""
    return _chunk_fingerprint(t, global_offsets, global_shape, counted=True)


def _chunk_fingerprint(t: torch.Tensor, global_offsets: Sequence[int], global_shape: Sequence[int],
                       counted: bool) -> tuple[TensorFingerprint, int | None]:
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint.eager import dtype_name
    from ckptverify.fingerprint.subclass import is_wrapper_subclass

    offsets = [int(o) for o in global_offsets]
    gshape = [int(s) for s in global_shape]
    if is_wrapper_subclass(t):
        # Its values are in its parts, which a chunk of the outer tensor does not address: whole tensors only.
        if any(offsets) or gshape != list(t.shape):
            raise UsageError(f"a chunk of a {type(t).__name__} has no fingerprint (only the whole tensor has)")
        return _subclass_fingerprint(t), None
    name = dtype_name(t.dtype)
    if counted:
        lanes, count = kern.fingerprint_lanes_counted(t, offsets, gshape, name)
    else:
        lanes, count = kern.fingerprint_lanes(t, offsets, gshape, name), None
    return TensorFingerprint.from_lanes(lanes, name, gshape, t.numel()), count


class BlockwiseFingerprint:
    """:func:`chunk_fingerprint_counted` of a contiguous CPU chunk, taken blocks at a time as a writer makes them ready,
    so each block is read while in cache. Made by :func:`blockwise_fingerprint`; calls must not overlap."""

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
            self._sums = [x + y for x, y in zip(self._sums, self._runner.run(self._next, hi), strict=True)]
            self._next = hi

    @property
    def complete(self) -> bool:
        """Whether every block is fingerprinted."""
        return self._next == len(self._runner.byte_ends)

    def result(self) -> tuple[TensorFingerprint, int | None]:
        """What :func:`chunk_fingerprint_counted` gives for the chunk (call once :attr:`complete`)."""
        if not self.complete:
            raise RuntimeError("the chunk's fingerprint is not complete")
        fp = TensorFingerprint.from_lanes(add_lanes([self._sums]), self._name, self._shape, self._numel)
        return fp, self._sums[2] if self._counted else None


def blockwise_fingerprint(t: torch.Tensor, global_offsets: Sequence[int],
                          global_shape: Sequence[int]) -> BlockwiseFingerprint | None:
    """A :class:`BlockwiseFingerprint` of plain tensor ``t`` (not a wrapper subclass) when the compiled kernel would
    take it now and ``t`` is contiguous; else ``None`` (use :func:`chunk_fingerprint_counted`)."""
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint.eager import dtype_name

    offsets = [int(o) for o in global_offsets]
    gshape = [int(s) for s in global_shape]
    try:
        name = dtype_name(t.dtype)
    except UsageError:
        return None
    screen = kern.SPECIAL_BITS.get(t.dtype)
    runner = kern.cpu_block_lanes(t.detach(), offsets, gshape, name, screen)
    if runner is None or not runner.byte_ends:
        return None
    return BlockwiseFingerprint(runner, name, gshape, t.numel(), screen is not None)


def tensor_fingerprint(t: torch.Tensor) -> TensorFingerprint:
    """Fingerprint of a whole tensor, computed on its own device.

    A ``DTensor`` is fingerprinted collectively (local shards at global offsets, lanes summed over the mesh): every
    rank of the mesh must call this, and each gets the global fingerprint. A wrapper subclass (``MXTensor``,
    ``NVFP4Tensor``) is fingerprinted by its parts (:mod:`ckptverify.fingerprint.subclass`): ``value`` is a digest,
    not a lane sum (it does not :func:`combine`); ``dtype`` is its outer dtype.
    """
    from ckptverify.fingerprint.subclass import dtensor_type

    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        return _dtensor_fingerprint(t)
    return chunk_fingerprint(t, [0] * len(t.shape), t.shape)  # the one chunk covering it


def set_fingerprint_backend(name: str) -> None:
    """How CPU tensors are fingerprinted: ``"numpy"`` (never compiles), ``"compiled"`` (``torch.compile`` kernel for
    large chunks, compiled at the first, waiting) or ``"auto"`` (default: numpy, then the kernel once compiled in the
    background after 1 GiB). CUDA takes Triton where available, else eager; other devices eager. All give the same
    values. ``CKPTVERIFY_FINGERPRINT_BACKEND`` sets the initial choice."""
    from ckptverify.fingerprint import kernels as kern

    kern.set_backend(name)


def get_fingerprint_backend() -> str:
    from ckptverify.fingerprint import kernels as kern

    return kern.get_backend()


# ------------------------------------------------------------------------------------- wrapper subclasses


def part_fingerprints(t: torch.Tensor) -> dict[str, TensorFingerprint]:
    """Fingerprint of each inner tensor of a wrapper subclass by its ``__tensor_flatten__`` name (inner subclasses by
    their own parts). :class:`~ckptverify.errors.UsageError` if ``t`` is not one."""
    from ckptverify.fingerprint.subclass import flatten, is_wrapper_subclass

    if not is_wrapper_subclass(t):
        raise UsageError(f"a {type(t).__name__} is not a tensor subclass with parts")
    return {name: tensor_fingerprint(part) for name, part in flatten(t).parts}


def _subclass_fingerprint(t: Any) -> TensorFingerprint:
    from ckptverify.fingerprint.eager import dtype_name
    from ckptverify.fingerprint.subclass import combine_parts, flatten

    flat = flatten(t)
    dtype = dtype_name(t.dtype)
    shape = [int(s) for s in t.shape]
    parts = [(name, tensor_fingerprint(part)) for name, part in flat.parts]
    value = combine_parts(flat.label, dtype, shape, flat.context, parts)
    return TensorFingerprint(value, dtype, tuple(shape), FINGERPRINT_VERSION, t.numel())


# ------------------------------------------------------------------------------------------- DTensor


#: A ``_StridedShard`` shard is fingerprinted box by box; beyond this many boxes it is refused, not gathered.
MAX_SHARD_BOXES = 1 << 16


def _dtensor_fingerprint(t: Any) -> TensorFingerprint:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    from ckptverify.fingerprint import kernels as kern
    from ckptverify.fingerprint.eager import dtype_name

    mesh = t.device_mesh
    placements = list(t.placements)
    name = dtype_name(t.dtype)
    gshape = list(t.shape)
    if any(p.is_partial() for p in placements):
        # Pending reductions: local values are not the tensor's until reduced.
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
        # Placements give each element's global index: no gather, the shard is fingerprinted box by box.
        index = _shard_indices(gshape, mesh, placements, coordinate)
        if [len(ix) for ix in index] != list(local.shape):
            raise UsageError(f"DTensor local shard has shape {list(local.shape)}, expected "
                             f"{[len(ix) for ix in index]}")
        lanes = add_lanes(kern.fingerprint_lanes(local[box], offsets, gshape, name) for box, offsets in _boxes(index))
        count = local.numel()

    # Sum over the whole mesh, one mesh dimension at a time. All-gather (exact) then add modulo 2**64.
    values = [signed(lanes[0]), signed(lanes[1]), count]
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        size = dist.get_world_size(group)
        device = collective_device(group, local.device, mesh.device_type)
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
    """Per global dimension, the global index of each local position (1-D int64), applying placements over mesh dims
    left to right as DTensor does (``Replicate`` keeps all)."""
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
    """The positions of ``current`` a ``_StridedShard`` keeps on coordinate ``rank``, via the placement's own
    ``_split_tensor`` (its offset helpers differ between torch releases)."""
    try:
        shards, _ = p._split_tensor(current.reshape([1] * p.dim + [len(current)]), num_chunks, with_padding=False)
        return shards[rank].reshape(-1)
    except (AttributeError, TypeError, IndexError):  # pragma: no cover - another torch's private API
        raise UsageError(f"this torch does not say where a {p!r} shard's elements lie: not fingerprinted") from None


def _runs(positions: Any) -> list[tuple[int, int, int]]:
    """``positions`` (1-D global indices in local order, at least one) as maximal consecutive runs ``(local start,
    global start, length)``."""
    import torch

    n = len(positions)
    breaks = (torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, n]
    firsts = positions[torch.tensor(starts)].tolist()
    return [(lo, g, hi - lo) for lo, hi, g in zip(starts, ends, firsts, strict=True)]


def _boxes(index: list[Any]) -> list[tuple[tuple[slice, ...], list[int]]]:
    """The local shard as disjoint boxes of the global tensor (one run per dimension): slice and global offsets."""
    import itertools

    per_dim = [_runs(ix) for ix in index]
    total = math.prod(map(len, per_dim))
    if total > MAX_SHARD_BOXES:
        raise UsageError(f"a DTensor shard made of {total} separate boxes of its global tensor is not fingerprinted "
                         f"(at most {MAX_SHARD_BOXES}); fingerprint its full_tensor() instead")
    out = []
    for combo in itertools.product(*per_dim):
        box = tuple(slice(local, local + n) for local, _, n in combo)
        out.append((box, [start for _, start, _ in combo]))
    return out


def collective_device(group: Any, local_device: Any, fallback_type: str = "cpu") -> Any:
    """The device a tensor on ``local_device`` travels on over ``group``: its own, if the backend serves it; else the
    CPU if served; else ``fallback_type``'s or one it serves (NCCL never receives a CPU tensor). ``fallback_type``
    also stands for an unknown backend's."""
    import torch

    served = _backend_device_types(group) or {fallback_type}
    if local_device.type in served:
        return local_device
    if "cpu" in served:
        return torch.device("cpu")
    kind = fallback_type if fallback_type in served else sorted(served)[0]
    return torch.device(kind, _current_index(kind))


def _backend_device_types(group: Any) -> set[str]:
    """Device types the group's backend takes (from ``"cpu:gloo,cuda:nccl"``; NCCL CUDA, Gloo both); empty otherwise."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:
        return {pair.split(":")[0].strip() for pair in backend.split(",")}
    return {"nccl": {"cuda"}, "gloo": {"cpu", "cuda"}}.get(backend, set())


def _current_index(kind: str) -> int:
    import torch

    module = getattr(torch, kind, None)
    return int(module.current_device()) if module is not None and hasattr(module, "current_device") else 0
