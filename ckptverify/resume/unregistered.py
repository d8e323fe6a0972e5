"""What the user forgot: stateful objects in the training function that the ``TrainState`` does not hold.

At ``run.restore(state)`` the harness looks through the calling function's local variables (and, one level
down, the attributes of plain containers among them: a dataclass or namespace holding model, optimizer and
loader), and through the plain attributes of the registered model's modules, for objects whose state a
resume needs and that ``state`` does not register:

* ``torch.nn.Module``\\ s other than the model, its submodules and wrappers around it (an EMA copy);
* optimizers, LR schedulers, GradScalers (``torch.amp`` and ``torch.cuda.amp``), ``torch.Generator``\\ s;
* data loaders and samplers (a registered loader's own sampler and generator count as registered);
* anything else with callable ``state_dict`` and ``load_state_dict``.

Each is reported by variable name and type. An object that never feeds a traced value (an EMA, a GradScaler
whose power-of-two scale leaves every value bitwise equal) passes a resume check, yet a real resume loses it.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Unregistered", "find_unregistered", "missing_optimizer"]


@dataclass(frozen=True, slots=True)
class Unregistered:
    """One stateful object the ``TrainState`` does not hold: the variable that names it and what it is."""

    name: str
    kind: str
    type: str

    def describe(self) -> str:
        return f"{self.name} ({self.type}, {self.kind})"

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "kind": self.kind, "type": self.type}


def _kind(obj: Any) -> str | None:
    """What kind of stateful object ``obj`` is, or ``None`` when it carries no state a resume needs."""
    import torch
    from torch.utils.data import DataLoader, Sampler

    if isinstance(obj, type | types.ModuleType | types.FunctionType | types.MethodType):
        return None
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        return "LR scheduler"
    if type(obj).__name__ == "GradScaler":
        return "gradient scaler"
    if isinstance(obj, torch.Generator):
        return "random generator"
    if isinstance(obj, DataLoader) or type(obj).__name__.endswith("DataLoader"):
        return "data loader"
    if isinstance(obj, Sampler):
        return "sampler"
    if isinstance(obj, torch.Tensor):
        return None
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "stateful object"
    return None


def _registered(state: Any) -> tuple[set[int], list[Any]]:
    """Ids of everything ``state`` holds (with a loader's sampler and generator), and its modules."""
    import torch

    ids: set[int] = {id(state), id(torch.default_generator)}
    modules: list[Any] = []
    if state.model is not None:
        modules.append(state.model)
        ids.update(id(m) for m in state.model.modules())
    for obj in [*state.optimizers, *state.schedulers, state.scaler, *state.extras.values(),
                *state.rng.generators.values()]:
        if obj is not None:
            ids.add(id(obj))
    loader = state.dataloader
    if loader is not None:
        ids.add(id(loader))
        for attr in ("sampler", "batch_sampler", "generator"):
            part = getattr(loader, attr, None)
            if part is not None:
                ids.add(id(part))
                inner = getattr(part, "sampler", None)
                if inner is not None:
                    ids.add(id(inner))
    return ids, modules


def _wraps_registered(obj: Any, modules: list[Any]) -> bool:
    """Whether module ``obj`` contains the registered model (a DDP or compile wrapper around it)."""
    try:
        return any(m is r for m in obj.modules() for r in modules)
    except Exception:
        return False


def _container_attrs(obj: Any) -> Mapping[str, Any]:
    """Attributes of a plain container (a dataclass or namespace the user keeps training objects in)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
    if isinstance(obj, types.SimpleNamespace):
        return vars(obj)
    return {}


def find_unregistered(local_vars: Mapping[str, Any], state: Any) -> list[Unregistered]:
    """Stateful objects among ``local_vars`` (and in containers among them) that ``state`` does not hold."""
    ids, modules = _registered(state)
    seen: set[int] = set()
    out: list[Unregistered] = []

    def visit(name: str, obj: Any) -> None:
        if obj is None or id(obj) in ids or id(obj) in seen:
            return
        kind = _kind(obj)
        if kind is None:
            return
        if kind == "module" and _wraps_registered(obj, modules):
            return
        if type(obj).__name__ in ("Run", "TrainState"):
            return
        seen.add(id(obj))
        out.append(Unregistered(name, kind, type(obj).__name__))

    for name, obj in local_vars.items():
        if name.startswith("__") or name == "_":
            continue  # `_` is a value the function discarded
        if _kind(obj) is not None:
            visit(name, obj)
        else:
            for attr, value in _container_attrs(obj).items():
                visit(f"{name}.{attr}", value)
    # Reachable from what is registered: plain attributes of the model's modules (a generator a layer
    # draws its noise from, an EMA kept as an attribute rather than a submodule).
    if state.model is not None:
        for mod_name, module in state.model.named_modules():
            for attr, value in vars(module).items():
                if not attr.startswith("_") and not isinstance(value, bool | int | float | str):
                    visit(".".join(p for p in ("model", mod_name, attr) if p), value)
    return out


def missing_optimizer(state: Any) -> str | None:
    """A sentence when ``state`` has a model with trainable parameters but no optimizer, else ``None``."""
    if state.optimizers or state.model is None:
        return None
    if not any(p.requires_grad for p in state.model.parameters()):
        return None
    return ("no optimizer is registered in the TrainState: its moments and step counts are not saved, so a "
            "resumed run starts them from zero")
