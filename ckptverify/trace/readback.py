"""Batched read-back: digests of device tensors computed there and read to the host once a step.

Deferred cells (:class:`_Deferred`) of a step are read together (:class:`_ReadBack`), one copy per device, started
when the step is recorded and finished when the next one is. Host tensors are digested at once, unless
``CKPTVERIFY_TRACE_HOST_AS_DEVICE=1`` sends them down the device path too."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptverify.fingerprint.subclass import is_wrapper_subclass
from ckptverify.trace import category, hostread
from ckptverify.trace.store import Cell

if TYPE_CHECKING:
    import torch

#: Host tensors take the device path, so CPU-only machines (the tests) run it; such traces compare only with
#: traces recorded the same way.
_HOST_AS_DEVICE = os.environ.get("CKPTVERIFY_TRACE_HOST_AS_DEVICE") == "1"


def digest_encoding(on_host: bool, host_as_device: bool = _HOST_AS_DEVICE) -> str:
    """The ``digest_encoding`` (:data:`~ckptverify.trace.store.DIGEST_ENCODINGS`) of a trace whose tensors are on
    the host or not; ``host_as_device``: ``CKPTVERIFY_TRACE_HOST_AS_DEVICE=1`` (this process's, at import)."""
    return "device" if not on_host else "host-as-device" if host_as_device else "host"


def _has_parts(t: Any) -> bool:
    """A wrapper subclass (MXTensor, ...): digested now by its parts, never batched as one tensor."""
    return type(t).__name__ not in _PLAIN_TYPES and is_wrapper_subclass(t)


_PLAIN_TYPES = frozenset({"Tensor", "Parameter", "Buffer"})


def _on_host(t: Any) -> bool:
    """Whether a (local) tensor is digested by its bytes on the host, now; else by the batched device path."""
    return t.device.type == "cpu" and not _HOST_AS_DEVICE


class _Deferred:
    """Cells still on an accelerator: ``make(values)`` builds them once ``tensor`` is read back (its elements as
    Python ints, flattened). All of a step's deferred items share one read per device instead of a synchronizing read
    each."""

    __slots__ = ("make", "tensor")

    def __init__(self, tensor: torch.Tensor, make: Callable[[list[int]], list[Cell]]) -> None:
        self.tensor, self.make = tensor, make


Item = Cell | _Deferred


class _ReadBack:
    """A step's deferred values on their way to the host: one copy per device, started when the step is recorded and
    finished (:meth:`cells`) at the next, so nothing waits in between. On CUDA a non-blocking copy into
    ``pinned[device]`` (reused: allocation costs milliseconds; one read at a time per recorder) with an event."""

    def __init__(self, items: list[Item], pinned: dict[Any, Any] | None = None) -> None:
        import torch

        self.items = items
        by_device: dict[Any, dict[int, Any]] = {}  # {id: tensor} per device, in order of first use
        for x in items:
            if type(x) is _Deferred:
                by_device.setdefault(x.tensor.device, {})[id(x.tensor)] = x.tensor
        self._reads: list[tuple[list[tuple[int, int]], Any, Any]] = []  # (key, numel) per member, values, event
        for device, members in by_device.items():
            flat = torch.cat([t.reshape(-1).to(torch.int64) for t in members.values()])
            layout = [(key, t.numel()) for key, t in members.items()]
            event = None
            if device.type == "cuda" and pinned is not None:
                buf = pinned.get(device)
                if buf is None or buf.numel() < flat.numel():
                    buf = pinned[device] = torch.empty(max(flat.numel(), 1024), dtype=torch.int64,
                                                             pin_memory=True)
                out = buf[:flat.numel()]
                out.copy_(flat, non_blocking=True)  # enqueued on the source device's current stream
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                flat = out
            self._reads.append((layout, flat, event))

    def cells(self) -> list[Cell]:
        """The step's cells, every deferred item made from the values read back."""
        values: dict[int, list[int]] = {}
        for layout, flat, event in self._reads:
            if event is not None:
                event.synchronize()
            got = hostread.to_host(flat)
            at = 0
            for key, n in layout:
                values[key] = got[at:at + n]
                at += n
        out: list[Cell] = []
        for x in self.items:
            if type(x) is _Deferred:
                out.extend(x.make(values[id(x.tensor)]))
            else:
                out.append(x)  # type: ignore[arg-type]
        return out


def _digests_later(tensors: list[Any], finish: Callable[[list[int]], list[Cell]]) -> list[Item]:
    """``finish(digests)`` of the member digests of plain local ``tensors``: host ones now, device ones in one
    batched pass read back with the step. Returns the cells, or one deferred item making them."""
    from ckptverify.fingerprint import kernels as kern

    device = [i for i, t in enumerate(tensors) if not _on_host(t) and not _has_parts(t)]
    if len({tensors[i].device for i in device}) != 1:  # all on the host, or several accelerators: read now
        return list(finish(category.tensor_digests(tensors)))
    host = [i for i, t in enumerate(tensors) if _on_host(t) or _has_parts(t)]
    known = dict(zip(host, category.tensor_digests([tensors[i] for i in host]), strict=True))
    lanes = kern.lanes_many([tensors[i] for i in device])

    def make(values: list[int]) -> list[Cell]:
        got = {**known, **dict(zip(device, category.pair_digests(values), strict=True))}
        return finish([got[i] for i in range(len(tensors))])

    return [_Deferred(lanes, make)]

