"""Tensor member digests, and category cells: one cell for every tensor of a category that still names the tensor when
only one differs.

Member digest (:func:`tensor_digests`): on the host xxh3-128 of the bytes xor a dtype/shape signature (an unseeded call:
a seeded xxh3 derives a secret per call); on a device the logical fingerprint, batched. Traces compare runs of one
configuration only, so this suffices. A wrapper subclass is digested by its parts (:func:`subclass_digest`), so equal
data with different scales differ.

Category cell, over members' low 64 bits ``l_j``, modulo 2**64::

    lane 0 = sum of l_j        lane 1 = sum of w(name_j) * l_j      (w odd, :func:`weight`)

When exactly one member differs, ``Δlane1 = w * Δlane0`` gives ``w`` modulo ``2**(64-k)`` (:func:`locate`), so a
``detail="tensor"`` trace names it; several differing members match none (odds about n / 2**(64-k)). Sums are
order-free, an absent member counts as a difference, and host sums use Python ints (cheaper than numpy's per-call
cost at these sizes)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from operator import mul as _mul
from operator import xor as _xor
from typing import TYPE_CHECKING, Any

import xxhash

from ckptverify.fingerprint.spec import MASK64 as _MASK64
from ckptverify.fingerprint.subclass import flatten, is_wrapper_subclass
from ckptverify.trace import hostread
from ckptverify.trace.sites import local_view

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["HostViews", "combine", "host_digest", "host_view", "locate", "matches", "pair_digests", "subclass_digest",
           "tensor_digests", "weight"]


@functools.cache
def weight(name: str) -> int:
    """``w(name)``: a member's weight in its category cell, an odd 64-bit number drawn from its site name."""
    return xxhash.xxh3_64_intdigest(name.encode("utf-8", "surrogatepass")) | 1


def combine(members: Sequence[int], weights: Sequence[int]) -> tuple[int, int]:
    """The two lanes of a category cell over its ``members`` with ``weights`` (sums mod 2**64): member digests of 128
    bits or their low halves alike, since mod 2**64 only the low halves count."""
    return sum(members) & _MASK64, sum(map(_mul, members, weights)) & _MASK64


def locate(expected: Sequence[int], actual: Sequence[int]) -> tuple[int, int] | None:
    """The weight modulo ``2**bits`` that the one member turning cell ``expected`` into ``actual`` must have, as
    ``(w, bits)`` (see :func:`matches`); ``None`` when equal or no single member explains it."""
    d0 = (int(actual[0]) - int(expected[0])) & _MASK64
    d1 = (int(actual[1]) - int(expected[1])) & _MASK64
    if d0 == 0:
        return None
    k = (d0 & -d0).bit_length() - 1  # 2**k divides d0, and must divide d1 = w * d0
    if d1 & ((1 << k) - 1):
        return None
    bits = 64 - k
    return ((d1 >> k) * pow(d0 >> k, -1, 1 << bits)) & ((1 << bits) - 1), bits


def matches(name: str, located: tuple[int, int]) -> bool:
    """Whether the member named ``name`` has the weight :func:`locate` found."""
    w, bits = located
    return weight(name) & ((1 << bits) - 1) == w


@functools.cache
def signature(dtype: Any, shape: tuple[int, ...]) -> int:
    """xxh3-128 of a dtype and shape: what a host tensor's byte digest is xor-ed with."""
    return xxhash.xxh3_128_intdigest(f"{dtype}|{shape}".encode())


def host_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array over the bytes of host tensor ``t`` (its own memory when contiguous, else a copy)."""
    import torch

    t = t.detach()
    if t.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True)): its values as a dense tensor
        t = t.to_dense()
    if not t.is_contiguous():
        t = t.contiguous()
    try:
        return t.numpy()
    except TypeError:  # a dtype numpy lacks (bfloat16, float8, ...): its bytes
        return t.reshape(-1).view(torch.uint8).numpy()


def host_digest(t: torch.Tensor) -> int:
    """The member digest of a host tensor: xxh3-128 of its bytes, xor the signature of its dtype and shape."""
    return xxhash.xxh3_128_intdigest(host_view(t)) ^ signature(t.dtype, tuple(t.shape))


def tensor_digests(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The member digest of each tensor (unsigned 128-bit), in order: :func:`host_digest` on the host; on a device
    ``lane0 << 64 | lane1`` of the fingerprint, one batched pass and read-back per device. A DTensor stands for its
    local shard."""
    out: list[int] = [0] * len(tensors)
    by_device: dict[Any, list[int]] = {}
    locals_ = [local_view(t) for t in tensors]
    for n, t in enumerate(locals_):
        if is_wrapper_subclass(t):
            out[n] = subclass_digest(t)
        elif t.device.type == "cpu":
            out[n] = host_digest(t)
        else:
            by_device.setdefault(t.device, []).append(n)
    for members in by_device.values():
        for n, d in zip(members, device_digests([locals_[n] for n in members]), strict=True):
            out[n] = d
    return out


def subclass_digest(t: torch.Tensor) -> int:
    """Member digest of a wrapper subclass: xxh3-128 of the canonical JSON of its class, outer dtype and shape,
    flatten context (uncanonical attributes by type) and each inner tensor's member digest."""
    import json

    flat = flatten(t, strict=False)  # an attribute without a canonical form must not stop the run
    inner = tensor_digests([part for _, part in flat.parts])
    text = json.dumps({"class": flat.label, "dtype": str(t.dtype), "shape": list(t.shape), "context": flat.context,
                       "parts": [[name, f"{d:032x}"] for (name, _), d in zip(flat.parts, inner, strict=True)]},
                      sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_intdigest(b"S" + text.encode())


def device_digests(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Member digests of tensors on one device (``lane0 << 64 | lane1`` of the fingerprint), computed there in one
    pass and read back once."""
    from ckptverify.fingerprint import kernels as kern

    return pair_digests(hostread.to_host(kern.lanes_many(tensors).reshape(-1)))


def pair_digests(values: list[int]) -> list[int]:
    """Flattened ``(n, 2)`` lane sums (signed, as read back) as ``n`` unsigned 128-bit member digests."""
    it = iter(values)
    return [(a & _MASK64) << 64 | (b & _MASK64) for a, b in zip(it, it, strict=True)]


def digest_lanes(d: int) -> tuple[int, int]:
    """A 128-bit member digest as a cell's two 64-bit lanes."""
    return (d >> 64) & _MASK64, d & _MASK64


class HostViews:
    """Digests of host tensors whose storage stays put across steps (parameters, optimizer state, buffers): views and
    signatures made once, one C call per tensor per step. :meth:`digests` returns ``None`` when a storage moved
    (``p.data = ...``): the caller rebuilds."""

    def __init__(self, tensors: Sequence[torch.Tensor], owners: Sequence[Any] | None = None) -> None:
        import torch

        self.tensors = list(tensors)
        #: Read data pointers from these to see a moved storage (e.g. the Parameter behind a state-dict alias).
        self.owners = list(owners) if owners is not None else self.tensors
        self._subclassed = [n for n, t in enumerate(self.tensors) if is_wrapper_subclass(t)]
        plain = not self._subclassed and not any(is_wrapper_subclass(o) for o in self.owners)
        self.views = [None if n in self._subclassed else host_view(t) for n, t in enumerate(self.tensors)]
        self.signatures = [signature(t.dtype, tuple(t.shape)) for t in self.tensors]
        self._ptr = torch.Tensor.data_ptr if plain else _pointer
        self.pointers = list(map(self._ptr, self.owners))
        # A non-contiguous tensor's view is a copy: remade each time.
        self._copies = [n for n, t in enumerate(self.tensors) if n not in self._subclassed and not t.is_contiguous()]

    def digests(self) -> list[int] | None:
        """Each tensor's member digest (as :func:`host_digest`), or ``None`` when a storage moved."""
        if list(map(self._ptr, self.owners)) != self.pointers:
            return None
        for n in self._copies:
            self.views[n] = host_view(self.tensors[n])
        if not self._subclassed:
            return list(map(_xor, map(xxhash.xxh3_128_intdigest, self.views), self.signatures))
        out = [0 if v is None else xxhash.xxh3_128_intdigest(v) ^ sig for v, sig in zip(self.views, self.signatures,
                                                                                          strict=True)]
        for n in self._subclassed:
            out[n] = subclass_digest(self.tensors[n])
        return out


def _pointer(t: Any) -> Any:
    """Where a tensor's values live (data pointer, or a subclass's parts'), to see them move."""
    if is_wrapper_subclass(t):
        return tuple(_pointer(part) for _, part in flatten(t).parts)
    return t.data_ptr()
