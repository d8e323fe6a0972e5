"""Where a fingerprint runs: the tensor's own device and a deliberately chosen stream (``docs/fingerprint.md``).

CUDA work launches on the calling thread's *current* device and stream; a fresh thread's is ``cuda:0``, so rank
3's fingerprint thread would read GPU 3 pointers on GPU 0 (illegal access). Hence every device-side fingerprint
runs in :func:`device_scope`, and a save's on a side stream waiting for the producing stream
(:class:`FingerprintStreams`). All CUDA calls go through ``_cuda_scope``, ``_side_stream`` and
``_producer_streams``, which CPU tests replace. :func:`check_fingerprintable` refuses unreadable tensors.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from ckptverify.errors import UsageError

__all__ = ["FingerprintStreams", "check_fingerprintable", "device_scope", "is_capturing"]


@contextmanager
def _cuda_scope(device: torch.device, stream: Any | None) -> Iterator[None]:
    """Make ``device`` current and, if given, ``stream`` its current stream (``None``: leave it)."""
    with torch.cuda.device(device), nullcontext() if stream is None else torch.cuda.stream(stream):
        yield


@contextmanager
def device_scope(device: torch.device, stream: Any | None = None) -> Iterator[None]:
    """Within the block, CUDA work launches on ``device`` and ``stream`` (default: this thread's current stream of it),
    whatever the thread's current device; both restored after. No-op for non-CUDA devices."""
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
    """Refuse (:class:`~ckptverify.errors.UsageError`) a tensor whose values cannot be read: meta, fake (inside
    ``torch.compile``), or CUDA while its device's current stream captures a graph (the sums are read back to the
    host, which capture forbids; call inside :func:`device_scope`)."""
    if t.device.type == "meta" or _is_fake(t):
        raise UsageError(f"a {'meta' if t.device.type == 'meta' else 'fake'} tensor has no values to fingerprint")
    if is_capturing(t.device):
        raise UsageError("cannot fingerprint a CUDA tensor while its stream is capturing a CUDA graph")


def _is_fake(t: Any) -> bool:
    # Fake tensors exist only once torch's fake tensor module is loaded (torch.compile loads it): no import here.
    module = sys.modules.get("torch._subclasses.fake_tensor")
    return module is not None and bool(module.is_fake(t))


def _producer_streams(devices: Iterable[torch.device]) -> dict[int, Any]:
    """This thread's current stream of each CUDA device in ``devices``, by index; asks CUDA nothing otherwise."""
    return {d.index if d.index is not None else 0: torch.cuda.current_stream(d)
            for d in dict.fromkeys(devices) if d.type == "cuda"}


def _side_stream(device: torch.device, kept: Any | None, producer: Any, t: torch.Tensor) -> Any:
    """The fingerprint stream on ``device`` (``kept`` or new), waiting for ``producer``'s queued work, with ``t``
    recorded on it so its memory is not reused before the fingerprint ran. Call inside :func:`device_scope`."""
    stream = kept if kept is not None else torch.cuda.Stream(device)
    stream.wait_stream(producer)
    # A wrapper subclass may refuse: safe, its parts are read within the scope while the caller holds it.
    with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
        t.record_stream(stream)
    return stream


class FingerprintStreams:
    """The streams a save's fingerprints run on, from a fingerprint thread of its own.

    :meth:`capture` (in the saving thread) notes its current stream per CUDA device. In the fingerprint thread,
    :meth:`scope` enters the tensor's device and a per-device side stream waiting on that; sums are read back inside
    the block, so the work is done when it ends. CPU: no-op; an uncaptured device uses its current stream.
    """

    def __init__(self, producers: dict[int, Any]) -> None:
        self._producers = producers
        self._side: dict[int, Any] = {}

    @classmethod
    def capture(cls, devices: Iterable[torch.device]) -> FingerprintStreams:
        """The calling (saving) thread's current streams of ``devices``, for fingerprints taken in another thread."""
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
