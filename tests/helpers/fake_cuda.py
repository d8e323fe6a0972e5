"""A simulated CUDA runtime for tests of the logic that decides which CUDA device state is read or written."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

#: torch.cuda calls that read or change a device (or create a context): none may happen in a CPU-only rank.
TOUCHING = ("current_device", "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
            "get_device_properties", "init", "set_device", "manual_seed", "_lazy_init")


class FakeCuda:
    """``n`` visible devices, each with its own 16-byte generator state; ``current`` is the rank's device; a
    device call initialises the fake runtime, as the real one does. Every call is recorded in ``calls``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, n: int, current: int = 0, node: str = "a",
                 initialized: bool = True, holds_tensors: bool = True) -> None:
        self.states = {i: torch.full((16,), 16 * i + len(node), dtype=torch.uint8) for i in range(n)}
        self.n, self.current, self.node, self.initialized = n, current, node, initialized
        #: Whether the rank's tensors are on its device (False: CUDA initialised by a library, as DCP's writer does).
        self.holds_tensors = holds_tensors
        self.calls: list[str] = []
        patch: dict[str, Callable[..., Any]] = {
            "is_available": lambda: True,
            "is_initialized": lambda: self.initialized,
            "device_count": lambda: self.n,
            "current_device": self._current_device,
            "get_rng_state": lambda device="cuda": self.states[self._index(device)].clone(),
            "set_rng_state": lambda new_state, device="cuda": self.states.__setitem__(self._index(device),
                                                                                     new_state.clone()),
            "get_rng_state_all": lambda: [self.states[i].clone() for i in range(self.n)],
            "set_rng_state_all": lambda states: None,
            "get_device_properties": lambda i: SimpleNamespace(uuid=f"GPU-{self.node}-{self._index(i)}"),
            "init": self._init,
            "_lazy_init": self._init,
            "set_device": lambda i: setattr(self, "current", self._index(i)),
            "manual_seed": lambda seed: None,
            "manual_seed_all": lambda seed: None,
            "memory_allocated": lambda device=None: (1 << 20) if self.holds_tensors else 0,
        }
        for name, fn in patch.items():
            monkeypatch.setattr(torch.cuda, name, self._recorded(name, fn))

    def _recorded(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return fn(*args, **kwargs)

        return call

    def _init(self) -> None:
        self.initialized = True

    def _current_device(self) -> int:
        self._init()
        return self.current

    def _index(self, device: Any) -> int:
        self._init()
        if isinstance(device, int):
            return device
        d = torch.device(device)
        return self.current if d.index is None else d.index

    def touched(self) -> list[str]:
        return [c for c in self.calls if c in TOUCHING]
