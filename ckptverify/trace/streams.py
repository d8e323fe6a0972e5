"""Digests of every random stream, twice a step, at the cost of seeing whether they moved.

A state-level trace records each random stream when a step starts and when it ends. Capturing a stream the way a
checkpoint does (:func:`ckptverify.state.rng.capture_rng`) costs tens of microseconds for numpy's and python's
Mersenne Twisters (the state is copied into new objects), and digesting it more; most steps draw from neither.
:class:`StreamDigests` gives, for each stream, exactly ``state_digest(capture_rng(generators)[kind])``, but
captures and digests a stream again only when it moved. Whether it moved is read in place:

- numpy's global generator: the 2500 bytes of its MT19937 state (key and position), through numpy's own
  ``BitGenerator.ctypes.state_address``. A draw that only hands out the Gaussian cached by the previous one
  moves nothing there, so while a Gaussian is cached (``has_gauss``) the stream is captured every time;
- python's :mod:`random`: the Mersenne Twister words and position inside the ``random.Random`` object (CPython
  lays them out right after the object header), checked once against ``random.getstate()``; where the check
  fails (another Python implementation or layout), ``random.getstate()`` is compared instead. ``gauss_next``
  is a plain attribute;
- torch's generators: their state bytes (``get_rng_state()``: a copy of a few kilobytes, cheap).
"""

from __future__ import annotations

import ctypes
import random
import sys
from collections.abc import Mapping
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
            if self._decode(bytes(raw)) == random.getstate()[1]:
                self._raw = raw

    @staticmethod
    def _decode(raw: bytes) -> tuple[int, ...]:
        index = int.from_bytes(raw[:4], "little", signed=True)
        words = memoryview(raw[4:]).cast("I")
        return (*words.tolist(), index)

    def key(self) -> Any:
        gauss = getattr(self.obj, "gauss_next", None)
        if self._raw is not None:
            return xxhash.xxh3_64_intdigest(self._raw), gauss
        return random.getstate()


class _NumpyStream:
    """Change key of numpy's legacy global generator (``np.random.*``)."""

    def __init__(self) -> None:
        self.rs = np.random.get_state.__self__  # type: ignore[attr-defined]
        self._bg: Any = None
        self._raw: Any = None
        self._bind()

    def _bind(self) -> None:
        self._raw = None
        bg = getattr(self.rs, "_bit_generator", None)
        self._bg = bg
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
    """``{kind: 32 hex digits}`` of every random stream of this process, equal to
    ``state_digest(capture_rng(generators)[kind])`` for each kind but ``cuda_device`` (a device's identity, not
    a stream), recomputed only for the streams that moved. CUDA is read only once this process uses it.
    """

    def __init__(self, generators: Mapping[str, Any] | None = None) -> None:
        self.generators = dict(generators or {})
        self._python = _PythonStream()
        self._numpy = _NumpyStream()
        self._keys: dict[str, Any] = {}
        self._digests: dict[str, str] = {}
        self._numpy_gauss = False

    def current(self) -> dict[str, str]:
        """Every stream's digest now (the kinds and order of :func:`~ckptverify.state.rng.capture_rng`)."""
        out: dict[str, str] = {}
        key = self._python.key()
        if key != self._keys.get("python") or "python" not in self._digests:
            self._keys["python"] = key
            self._digests["python"] = state_digest(_python_state())
        out["python"] = self._digests["python"]

        key = self._numpy.key(self._numpy_gauss)
        if key is None or key != self._keys.get("numpy") or "numpy" not in self._digests:
            value = _numpy_state()
            self._numpy_gauss = bool(value["has_gauss"])
            self._keys["numpy"] = key
            self._digests["numpy"] = state_digest(value)
        out["numpy"] = self._digests["numpy"]

        out["torch_cpu"] = _byte_state_digest(torch.get_rng_state())
        if cuda_in_use():
            # The rank's own device's stream, as capture_rng saves it; which physical device that is
            # (``cuda_device``) is not a random stream, and may differ between runs that are equal.
            out["cuda"] = self._tensor("cuda", torch.cuda.get_rng_state(torch.cuda.current_device()))
        for name, gen in self.generators.items():
            kind = f"gen.{name}"
            st = gen.get_state()
            k = (str(gen.device), xxhash.xxh3_64_intdigest(st.numpy()))
            if k != self._keys.get(kind) or kind not in self._digests:
                self._keys[kind] = k
                self._digests[kind] = state_digest({"device": str(gen.device), "state": st})
            out[kind] = self._digests[kind]
        return out

    def _tensor(self, kind: str, t: Any) -> str:
        if t.device.type == "cpu" and t.dtype == torch.uint8 and t.dim() == 1:
            return _byte_state_digest(t)
        k = xxhash.xxh3_64_intdigest(t.numpy())
        if k != self._keys.get(kind) or kind not in self._digests:
            self._keys[kind] = k
            self._digests[kind] = state_digest(t)
        return self._digests[kind]


_BYTE_STATE_HEAD = b"T" + len(b"torch.uint8").to_bytes(4, "little") + b"torch.uint8" + (1).to_bytes(4, "little")


def _byte_state_digest(t: torch.Tensor) -> str:
    """``state_digest(t)`` of a 1-D uint8 host tensor (a generator's state), without the general walk."""
    h = xxhash.xxh3_128(_BYTE_STATE_HEAD + t.shape[0].to_bytes(8, "little", signed=True))
    if t.shape[0]:
        h.update(t.numpy())
    return h.hexdigest()
