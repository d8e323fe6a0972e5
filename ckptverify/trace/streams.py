"""Digests of every random stream, twice a step, paid only for streams that moved.

Capturing a stream as a checkpoint does costs tens of microseconds (numpy's and python's Mersenne Twisters are
copied), and most steps draw from neither. :class:`StreamDigests` gives exactly
``state_digest(capture_rng(generators)[kind])`` but re-digests only when a cheap in-place key changed: numpy's
MT19937 state bytes (captured every time while a Gaussian is cached: drawing it moves nothing); python's MT words
read from the object (layout verified once against ``random.getstate()``, else ``getstate()`` itself); torch's state
bytes."""

from __future__ import annotations

import ctypes
import random
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from ckptverify.state.digest import state_digest
from ckptverify.state.rng import _numpy_state, _python_state, cuda_in_use

__all__ = ["StreamDigests"]

_MT_BYTES = 624 * 4 + 4  # key[624] and the position, 32-bit each


class _PythonStream:
    """Change key of python's global ``random`` stream."""

    def __init__(self) -> None:
        self.obj = random.getstate.__self__  # type: ignore[attr-defined]
        self._raw: Any = None
        if sys.implementation.name == "cpython" and sys.getsizeof(self.obj) >= 16 + _MT_BYTES:
            # PyObject_HEAD (reference count, type: 16 bytes), then `int index; uint32_t state[624]`.
            raw = (ctypes.c_char * _MT_BYTES).from_address(id(self.obj) + 16)
            data = bytes(raw)
            if (*memoryview(data[4:]).cast("I").tolist(), int.from_bytes(data[:4], "little", signed=True)) \
                    == random.getstate()[1]:
                self._raw = raw

    def key(self) -> Any:
        gauss = getattr(self.obj, "gauss_next", None)
        if self._raw is not None:
            return xxhash.xxh3_64_intdigest(self._raw), gauss
        return random.getstate()


class _NumpyStream:
    """Change key of numpy's legacy global generator (``np.random.*``)."""

    def __init__(self) -> None:
        self.rs = np.random.get_state.__self__  # type: ignore[attr-defined]
        self._bind()

    def _bind(self) -> None:
        self._raw: Any = None
        self._bg = bg = getattr(self.rs, "_bit_generator", None)
        if bg is None or type(bg).__name__ != "MT19937":
            return
        raw = (ctypes.c_char * _MT_BYTES).from_address(bg.ctypes.state_address)
        st = self.rs.get_state()
        data = bytes(raw)
        if data[:-4] == st[1].astype("<u4").tobytes() and int.from_bytes(data[-4:], "little", signed=True) == st[2]:
            self._raw = raw

    def key(self, gauss_cached: bool) -> Any:
        if getattr(self.rs, "_bit_generator", None) is not self._bg:
            self._bind()
        if self._raw is None or gauss_cached:
            return None  # no cheap key: capture
        return xxhash.xxh3_64_intdigest(self._raw)


class StreamDigests:
    """``{kind: digest}`` of every random stream of this process, equal to
    ``state_digest(capture_rng(generators)[kind])`` but for ``cuda_device`` (an identity, not a stream); CUDA is read
    only once this process uses it."""

    def __init__(self, generators: Mapping[str, Any] | None = None) -> None:
        self.generators = dict(generators or {})
        self._python = _PythonStream()
        self._numpy = _NumpyStream()
        self._keys: dict[str, Any] = {}
        self._digests: dict[str, str] = {}
        self._numpy_gauss = False

    def current(self) -> dict[str, str]:
        """Every stream's digest now (the kinds and order of :func:`~ckptverify.state.rng.capture_rng`)."""
        out = {"python": self._cached("python", self._python.key(), lambda: state_digest(_python_state())),
               "numpy": self._cached("numpy", self._numpy.key(self._numpy_gauss), self._numpy_digest),
               "torch_cpu": _byte_state_digest(torch.get_rng_state())}
        if cuda_in_use():
            # ``cuda_device`` is left out: it is no stream, and may differ between equal runs.
            out["cuda"] = _byte_state_digest(torch.cuda.get_rng_state(torch.cuda.current_device()))
        for name, gen in self.generators.items():
            st, device = gen.get_state(), str(gen.device)
            out[f"gen.{name}"] = self._cached(f"gen.{name}", (device, xxhash.xxh3_64_intdigest(st.numpy())),
                                              lambda d=device, s=st: state_digest({"device": d, "state": s}))
        return out

    def _cached(self, kind: str, key: Any, make: Callable[[], str]) -> str:
        """``kind``'s digest, remade by ``make`` when its change key moved (``None``: no cheap key, always remade)."""
        if key is None or key != self._keys.get(kind) or kind not in self._digests:
            self._keys[kind] = key
            self._digests[kind] = make()
        return self._digests[kind]

    def _numpy_digest(self) -> str:
        value = _numpy_state()
        self._numpy_gauss = bool(value["has_gauss"])
        return state_digest(value)


_BYTE_STATE_HEAD = b"T" + len(b"torch.uint8").to_bytes(4, "little") + b"torch.uint8" + (1).to_bytes(4, "little")


def _byte_state_digest(t: torch.Tensor) -> str:
    """``state_digest(t)`` of a 1-D uint8 host tensor (a generator state), without the general walk."""
    h = xxhash.xxh3_128(_BYTE_STATE_HEAD + t.shape[0].to_bytes(8, "little", signed=True))
    if t.shape[0]:
        h.update(t.numpy())
    return h.hexdigest()
