"""Fault injection for tests and fire drills: flip one bit of one tensor, on one rank, at one step.

:class:`BitFlip` describes the fault (kinds: ``grad`` before the optimizer step, after any all-reduce; ``param`` and
``optim`` state after it; ``activation``: a module's first forward output of the step); :class:`FaultInjector` plants
it through hooks. Trap: production runs only (``Run.main(fault=...)`` or ``CKPTVERIFY_FAULT``): a replay must never
inject one, or it would reproduce the fault."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ckptverify.errors import UsageError
from ckptverify.trace.sites import local_view

__all__ = ["KINDS", "BitFlip", "FaultInjector", "flip_bit_"]

KINDS = ("grad", "param", "optim", "activation")


@dataclass(frozen=True, kw_only=True)
class BitFlip:
    """Flip bit ``bit`` of element ``element`` (row-major, of the rank's local tensor) of the tensor named by
    ``kind``/``name`` on rank ``rank`` during 1-based step ``step``."""

    kind: str
    name: str
    step: int
    rank: int = 0
    element: int = 0
    bit: int = 0
    state_key: str = "exp_avg"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"fault kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.step < 1 or self.rank < 0 or self.element < 0 or not 0 <= self.bit < 64:
            raise UsageError(f"bad fault {self}: step >= 1, rank >= 0, element >= 0, 0 <= bit < 64")

    @property
    def site(self) -> str:
        """What the fault hits, in the trace's words (``grad:fc.weight``, ``optim:fc.weight.exp_avg``)."""
        return f"optim:{self.name}.{self.state_key}" if self.kind == "optim" else f"{self.kind}:{self.name}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BitFlip:
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as exc:
            raise UsageError(f"not a fault description: {text[:200]!r} ({exc})") from None


_INT_BY_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def flip_bit_(t: Any, element: int, bit: int) -> None:
    """Flip bit ``bit`` of element ``element`` of ``t`` in place, any dtype, through an integer view."""
    data = local_view(t).detach()
    if data.is_complex():
        data = torch.view_as_real(data)
    if not data.is_contiguous():
        raise UsageError("cannot flip a bit of a non-contiguous tensor in place")
    flat = data.reshape(-1)
    width = flat.element_size() * 8
    if element >= flat.numel():
        raise UsageError(f"element {element} is out of range: the tensor has {flat.numel()} elements")
    if bit >= width:
        raise UsageError(f"bit {bit} is out of range for a {width}-bit element")
    ints = flat.view(getattr(torch, _INT_BY_SIZE[flat.element_size()]))
    mask = 1 << bit
    if ints.dtype != torch.uint8 and bit == width - 1:
        mask = -(1 << bit)  # the sign bit, as the signed integer view spells it
    ints[element].bitwise_xor_(mask)


class FaultInjector:
    """Plants one :class:`BitFlip` through hooks; :meth:`detach` removes them. ``step_in_progress()`` gives the
    1-based step being computed; ``fired`` says whether it flipped; ``on_fire(flip)`` runs right after."""

    def __init__(self, flip: BitFlip, *, model: Any, optimizer: Any = None, rank: int = 0,
                 step_in_progress: Callable[[], int], on_fire: Callable[[BitFlip], None] | None = None) -> None:
        self.flip = flip
        self.rank = rank
        self.fired = False
        self._step = step_in_progress
        self._on_fire = on_fire
        self._handles: list[Any] = []
        module = getattr(model, "module", model)
        if flip.kind == "activation":
            target = dict(module.named_modules()).get(flip.name)
            if target is None:
                raise UsageError(f"no module named {flip.name!r} to inject a fault into")
            self._handles.append(target.register_forward_hook(self._activation_hook))
            return
        params = dict(module.named_parameters())
        if flip.name not in params:
            raise UsageError(f"no parameter named {flip.name!r} to inject a fault into")
        if optimizer is None:
            raise UsageError(f"a {flip.kind} fault needs the optimizer")
        self._param = params[flip.name]
        # A gradient before the optimizer step (after any all-reduce); parameters and optimizer state after it.
        register = optimizer.register_step_pre_hook if flip.kind == "grad" else optimizer.register_step_post_hook
        self._handles.append(register(self._step_hook))

    def _due(self) -> bool:
        return not self.fired and self.rank == self.flip.rank and self._step() == self.flip.step

    def _fire(self, t: Any) -> None:
        flip_bit_(t, self.flip.element, self.flip.bit)
        self.fired = True
        if self._on_fire is not None:
            self._on_fire(self.flip)

    def _step_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._due():
            return
        if self.flip.kind == "grad":
            target = self._param.grad
            if target is None:
                raise UsageError(f"parameter {self.flip.name!r} has no gradient at step {self.flip.step}")
        elif self.flip.kind == "param":
            target = self._param
        else:
            target = optimizer.state.get(self._param, {}).get(self.flip.state_key)
            if target is None or not hasattr(target, "dtype"):
                raise UsageError(f"optimizer state of {self.flip.name!r} has no tensor {self.flip.state_key!r}")
        self._fire(target)

    def _activation_hook(self, module: Any, args: Any, output: Any) -> Any:
        if not self._due() or not isinstance(output, torch.Tensor):
            return None
        out = output.clone()
        self._fire(out)
        return out

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
