"""Where a fingerprint runs: the tensor's own device and a stream chosen on purpose (see ``docs/fingerprint.md``).

A CUDA kernel (a Triton launch, each eager torch operation) runs on the *current* device and stream of the
calling thread, not on the tensor's. A fresh thread's current device is ``cuda:0``: a save's fingerprint thread
on rank 3 of a node would launch on GPU 0 with pointers into GPU 3 (an illegal memory access) and open a CUDA
context on GPU 0. So every device-side fingerprint runs inside :func:`device_scope` of its tensor's device, and a
save's fingerprints run on a side stream of their own that waits for the stream that produced the tensors
(:class:`FingerprintStreams`).

Every CUDA call of this module goes through three module functions (``_cuda_scope``, ``_side_stream``,
``_producer_streams``) that the CPU test suite replaces to watch which device and stream each fingerprint
enters, on a machine without CUDA. Also here: :func:`check_fingerprintable`, the tensors no path may read (a
meta or fake tensor has no values; a CUDA tensor whose stream is being captured into a CUDA graph cannot be
read back). This module imports nothing of the package but :mod:`ckptverify.errors`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from ckptverify.errors import UsageError

__all__ = ["FingerprintStreams", "check_fingerprintable", "device_scope", "is_capturing"]


def _cuda_scope(device: torch.device, stream: Any | None) -> AbstractContextManager[Any]:
    """Make ``device`` the current CUDA device and, where given, ``stream`` its current stream (``None``: the
    calling thread's current stream of ``device``, as it is)."""
    if stream is None:
        return torch.cuda.device(device)
    return _device_and_stream(device, stream)


@contextmanager
def _device_and_stream(device: torch.device, stream: Any) -> Iterator[None]:
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


@contextmanager
def device_scope(device: torch.device, stream: Any | None = None) -> Iterator[None]:
    """Within the block, CUDA work launches on ``device`` (a CUDA tensor's device) and on ``stream`` (default:
    the calling thread's current stream of ``device``), whatever the thread's current device was; the previous
    device and stream are restored after. Nothing happens for any other device type."""
    if device.type != "cuda":
        yield
        return
    with _cuda_scope(device, stream):
        yield


def is_capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph (call inside :func:`device_scope`)."""
    if device.type != "cuda":
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:  # a torch built without CUDA: nothing can be capturing
        return False


def check_fingerprintable(t: Any) -> None:
    """Refuse (:class:`~ckptverify.errors.UsageError`) a tensor whose values cannot be read: a meta tensor, a fake
    tensor (``torch.compile`` traces with them: a fingerprint inside a compiled region sees no values), and a
    CUDA tensor while its device's current stream is capturing a CUDA graph (a fingerprint reads its sums back
    to the host, which a capture forbids; call inside :func:`device_scope`)."""
    if t.device.type == "meta" or _is_fake(t):
        raise UsageError(f"a {'meta' if t.device.type == 'meta' else 'fake'} tensor has no values to fingerprint")
    if is_capturing(t.device):
        raise UsageError("cannot fingerprint a CUDA tensor while its stream is capturing a CUDA graph")


def _is_fake(t: Any) -> bool:
    # Fake tensors exist only once torch's fake tensor module is loaded (torch.compile loads it): no import here.
    module = sys.modules.get("torch._subclasses.fake_tensor")
    return module is not None and bool(module.is_fake(t))


def _producer_streams(devices: Iterable[torch.device]) -> dict[int, Any]:
    """The calling thread's current stream of each CUDA device among ``devices`` (those of the tensors to
    fingerprint), by index. Nothing is asked of CUDA for any other device, and nothing at all without one."""
    return {d.index if d.index is not None else 0: torch.cuda.current_stream(d)
            for d in dict.fromkeys(devices) if d.type == "cuda"}


def _side_stream(device: torch.device, kept: Any | None, producer: Any, t: torch.Tensor) -> Any:
    """The fingerprint's stream on ``device`` (``kept``, or a new one), made to wait for the work queued so far
    on ``producer`` (the stream that wrote ``t``), with ``t`` recorded on it: the allocator does not hand
    ``t``'s memory to anyone until the fingerprint's work queued on it has run. Called inside
    :func:`device_scope` of ``device``."""
    stream = kept if kept is not None else torch.cuda.Stream(device)
    stream.wait_stream(producer)
    # A wrapper subclass (MXTensor) may not take it: its parts are read inside the scope, while the caller holds
    # the tensor, and the scope ends only once the sums are back on the host.
    with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
        t.record_stream(stream)
    return stream


class FingerprintStreams:
    """The streams a save's fingerprints run on, for a fingerprint thread of its own.

    Made in the saving thread (:meth:`capture`): it notes that thread's current stream of each CUDA device the
    tensors are on, the stream they were written on. In the fingerprint thread, :meth:`scope` of a tensor
    enters the tensor's device and a side stream of that device (one per device, made on first use) that first
    waits for the saving thread's stream; the fingerprint's sums are read back to the host inside the block, so
    its work is done when the block ends. A CPU tensor's scope does nothing. A CUDA tensor on a device that was
    not captured runs on that device's current stream in the fingerprint thread."""

    def __init__(self, producers: dict[int, Any]) -> None:
        self._producers = producers
        self._side: dict[int, Any] = {}

    @classmethod
    def capture(cls, devices: Iterable[torch.device]) -> FingerprintStreams:
        """The calling (saving) thread's current streams of ``devices`` (the tensors'), for fingerprints taken in
        another thread."""
        return cls(_producer_streams(devices))

    @contextmanager
    def scope(self, t: Any) -> Iterator[None]:
        """Run the block on ``t``'s device and this save's side stream of that device."""
        device = t.device
        if device.type != "cuda":
            yield
            return
        index = device.index if device.index is not None else 0
        if index not in self._producers:
            with device_scope(device):
                yield
            return
        with device_scope(device):
            stream = _side_stream(device, self._side.get(index), self._producers[index], t)
            self._side[index] = stream
            with device_scope(device, stream):
                yield
