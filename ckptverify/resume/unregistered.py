"""What the user forgot: stateful objects in the training function that the ``TrainState`` does not hold.

At ``run.restore(state)`` the caller's locals (one level into plain containers) and the plain attributes of the
model's modules are searched for modules, optimizers, schedulers, scalers, generators, loaders, samplers or anything
with ``state_dict``/``load_state_dict`` that ``state`` does not register. Trap: an object that feeds no traced value
(an EMA, a power-of-two GradScaler) passes a step-by-step comparison yet a real resume loses it, so
:func:`held_state` fingerprints what the function holds outside the ``TrainState`` at the end of each run and
:func:`compare_held` names what differs."""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Mapping
from typing import Any

from ckptverify.trace.sites import local_view

__all__ = ["compare_held", "find_unregistered", "held_state", "missing_optimizer",
           "registered_bindings", "replaced_objects"]


def _kind(obj: Any) -> str | None:
    """What kind of stateful object ``obj`` is, or ``None`` when it carries no state a resume needs."""
    import torch
    from torch.utils.data import DataLoader, Sampler

    if isinstance(obj, type | types.ModuleType | types.FunctionType | types.MethodType | torch.Tensor):
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
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "stateful object"
    return None


def _fields(state: Any) -> dict[int, str]:
    """The ``TrainState`` field of each object ``state`` is given: ``{id: "model" | "optimizer" | ...}``."""
    fields: dict[int, str] = {}
    for field, objs in (("model", [state.model]), ("optimizer", state.optimizers), ("scheduler", state.schedulers),
                        ("dataloader", [state.dataloader]), ("scaler", [state.scaler])):
        fields.update((id(obj), field) for obj in objs if obj is not None)
    for key, obj in state.extras.items():
        fields.setdefault(id(obj), f"extras[{key!r}]")
    return fields


def _registered(state: Any) -> set[int]:
    """Ids of everything ``state`` holds (with its modules, generators and a loader's sampler)."""
    import torch

    ids = {id(state), id(torch.default_generator), *_fields(state), *map(id, state.rng.generators.values())}
    if state.model is not None:
        ids.update(id(m) for m in state.model.modules())
    loader = state.dataloader
    if loader is not None:
        dataset = getattr(loader, "dataset", None)
        if dataset is not None and any(c.__name__ == "StatefulDataLoader" and c.__module__.startswith("torchdata.")
                                       for c in type(loader).__mro__):
            # StatefulDataLoader saves its dataset's state (per worker, where the moving copy lives).
            ids.add(id(dataset))
        for attr in ("sampler", "batch_sampler", "generator"):
            part = getattr(loader, attr, None)
            if part is not None:
                ids.add(id(part))
                inner = getattr(part, "sampler", None)
                if inner is not None:
                    ids.add(id(inner))
    return ids


def _wraps_registered(obj: Any, model: Any) -> bool:
    """Whether module ``obj`` contains the registered ``model`` (a DDP or compile wrapper around it)."""
    try:
        return model is not None and any(m is model for m in obj.modules())
    except Exception:
        return False


def _container_attrs(obj: Any) -> Mapping[str, Any]:
    """Attributes of a plain container (a dataclass or namespace the user keeps training objects in)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
    if isinstance(obj, types.SimpleNamespace):
        return vars(obj)
    return {}


def find_unregistered(local_vars: Mapping[str, Any], state: Any) -> list[dict[str, str]]:
    """Stateful objects among ``local_vars`` (and in containers among them) that ``state`` does not hold, as
    ``{"name", "kind", "type"}``: the variable that names each and what it is."""
    ids = _registered(state)
    seen: set[int] = set()
    out: list[dict[str, str]] = []

    def visit(name: str, obj: Any) -> None:
        if obj is None or id(obj) in ids or id(obj) in seen:
            return
        kind = _kind(obj)
        if kind is None or type(obj).__name__ in ("Run", "TrainState") or (
                kind == "module" and _wraps_registered(obj, state.model)):
            return
        seen.add(id(obj))
        out.append({"name": name, "kind": kind, "type": type(obj).__name__})

    for name, obj in local_vars.items():
        if name.startswith("__") or name == "_":
            continue  # `_` is a value the function discarded
        if _kind(obj) is not None:
            visit(name, obj)
        else:
            for attr, value in _container_attrs(obj).items():
                visit(f"{name}.{attr}", value)
    # Plain attributes of the model's modules (a layer's noise generator, an EMA kept as an attribute).
    for path, value in _module_attrs(state.model, "model"):
        if not isinstance(value, bool | int | float | str):
            visit(path, value)
    return out


def _module_attrs(model: Any, prefix: str) -> list[tuple[str, Any]]:
    """``(prefix.<module>.<attribute>, value)`` of each public plain attribute of ``model``'s modules (none for
    ``None``)."""
    return [] if model is None else [(".".join(p for p in (prefix, mod_name, attr) if p), value)
                                     for mod_name, module in model.named_modules()
                                     for attr, value in vars(module).items() if not attr.startswith("_")]


def registered_bindings(local_vars: Mapping[str, Any], state: Any) -> dict[str, tuple[int, str, str]]:
    """Locals naming an object ``state`` registers: ``{name: (id, TrainState field, type)}``, taken at
    ``run.restore`` so :func:`replaced_objects` can tell a name was later rebound."""
    fields = _fields(state)
    return {name: (id(obj), fields[id(obj)], type(obj).__name__) for name, obj in local_vars.items()
            if not name.startswith("_") and id(obj) in fields}


def replaced_objects(bindings: Mapping[str, tuple[int, str, str]], local_vars: Mapping[str, Any], state: Any
                     ) -> list[dict[str, str]]:
    """Variables that named a registered object at ``run.restore`` and now name another object of a stateful kind
    ``state`` does not hold (rebuilt after the restore: the loop uses the new one, checkpoints the old)."""
    ids = _registered(state)
    out: list[dict[str, str]] = []
    for name, (oid, field, type_name) in bindings.items():
        now = local_vars.get(name)
        # _kind None: the name was reused for something else, not a rebuilt object.
        if now is None or id(now) == oid or id(now) in ids or _kind(now) is None:
            continue
        out.append({"name": name, "field": field, "type": type(now).__name__, "registered_type": type_name})
    return out


def missing_optimizer(state: Any) -> str | None:
    """A sentence when ``state`` has a model with trainable parameters but no optimizer, else ``None``."""
    if state.optimizers or state.model is None or not any(p.requires_grad for p in state.model.parameters()):
        return None
    return ("no optimizer is registered in the TrainState: its moments and step counts are not saved, so a "
            "resumed run starts them from zero")


HELD_DEPTH = 4
#: Items walked per container; values fingerprinted per rank.
HELD_ITEMS = 10_000
HELD_ENTRIES = 20_000
#: Objects looked at per rank (a library object's attributes can be a large graph).
HELD_VISITS = 200_000
#: Packages whose objects are never walked as plain objects: their attributes are internals, not job state.
_OPAQUE = ("torch", "numpy", "builtins", "ckptverify.resume", "ckptverify.state", "ckptverify.trace")


def _storage_key(t: Any) -> tuple[str, int | None, int] | None:
    """Where ``t``'s memory lives (a ``DTensor``: its local shard), or ``None`` when it has none to compare."""
    t = local_view(t)
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:  # no storage (meta, sparse, a tensor subclass without one)
        return None
    return (t.device.type, t.device.index, ptr) if ptr else None


def _covered_storages(state: Any) -> set[tuple[str, int | None, int]]:
    """The memory of every tensor ``state`` saves: a held tensor there is an alias of registered state."""
    import torch

    tensors: list[Any] = []
    if state.model is not None:
        tensors += [*state.model.parameters(), *state.model.buffers()]
        tensors += [p.grad for p in state.model.parameters() if p.grad is not None]
    for opt in state.optimizers:
        for per_param in getattr(opt, "state", {}).values():
            if isinstance(per_param, Mapping):
                tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    for extra in state.extras.values():
        if isinstance(extra, torch.nn.Module):
            tensors += [*extra.parameters(), *extra.buffers()]
        else:
            tensors += [v for v in getattr(extra, "__dict__", {}).values() if isinstance(v, torch.Tensor)]
    keys = {_storage_key(t) for t in tensors}
    keys.discard(None)
    return keys  # type: ignore[return-value]


def _plain(obj: Any) -> bool:
    """Whether ``obj`` is a plain object of the job whose attributes may hold state, not library internals."""
    from torch.utils.data import Dataset

    if isinstance(obj, type | types.ModuleType | types.FunctionType | types.MethodType | Dataset):
        return False
    if dataclasses.is_dataclass(obj) or isinstance(obj, types.SimpleNamespace):
        return True
    module = type(obj).__module__ or ""
    if module == "builtins" or module.split(".")[0] in sys.stdlib_module_names:
        return False
    return hasattr(obj, "__dict__") and not any(module == p or module.startswith(p + ".") for p in _OPAQUE)


def held_state(local_vars: Mapping[str, Any], state: Any) -> dict[str, Any]:
    """Fingerprints of values among ``local_vars`` that ``state`` does not save, for comparing runs.

    Walks tensors, containers and plain objects of the job, unregistered modules, the ``state_dict()`` of
    unregistered optimizers/schedulers/scalers and generators, bounded by
    ``HELD_DEPTH``/``HELD_ITEMS``/``HELD_VISITS`` (``truncated`` when cut). Skips what ``state`` holds, aliases of
    its memory, loaders, samplers and datasets. No copy is kept. Returns ``{"entries": {path: {"var", "value"}},
    "truncated", "skipped"}``."""
    import torch

    from ckptverify.fingerprint import tensor_fingerprint

    ids = _registered(state)
    covered = _covered_storages(state)
    entries: dict[str, dict[str, str]] = {}
    skipped: list[str] = []
    seen: set[int] = set()
    truncated = False

    def put(path: str, var: str, value: str) -> None:
        nonlocal truncated
        if len(entries) >= HELD_ENTRIES:
            truncated = True
            return
        entries[path] = {"var": var, "value": value}

    def tensor(path: str, var: str, t: Any) -> None:
        if _storage_key(t) in covered:
            return  # registered state under another name
        try:
            # A DTensor's local shard, so no rank waits.
            fp = tensor_fingerprint(local_view(t).detach())
            put(path, var, f"{fp.dtype}{list(fp.shape)}:{fp.value}")
        except Exception:
            skipped.append(path)

    def scalars(path: str, var: str, obj: Any, depth: int) -> None:
        """A ``state_dict()``: tensors and scalars both are state."""
        if isinstance(obj, torch.Tensor):
            tensor(path, var, obj)
        elif obj is None or isinstance(obj, bool | int | float | str):
            put(path, var, f"{type(obj).__name__}:{obj!r}")
        elif depth < HELD_DEPTH and isinstance(obj, Mapping | list | tuple):
            for suffix, item in items(obj):
                scalars(path + suffix, var, item, depth + 1)

    def items(obj: Any) -> list[tuple[str, Any]]:
        nonlocal truncated
        if isinstance(obj, Mapping):
            out = [(f"[{k!r}]", obj[k]) for k in list(obj)[:HELD_ITEMS]]
            n = len(obj)
        elif isinstance(obj, list | tuple):
            out = [(f"[{i}]", v) for i, v in enumerate(obj[:HELD_ITEMS])]
            n = len(obj)
        elif _plain(obj):
            attrs = _container_attrs(obj) or vars(obj)
            out = [(f".{k}", v) for k, v in list(attrs.items())[:HELD_ITEMS] if not k.startswith("__")]
            n = len(attrs)
        else:
            return []
        truncated = truncated or n > HELD_ITEMS
        return out

    def visit(path: str, var: str, obj: Any, depth: int) -> None:
        if obj is None or isinstance(obj, bool | int | float | complex | str | bytes) or id(obj) in ids:
            return
        nonlocal truncated
        if id(obj) in seen:
            return  # the first name reaching an object names it
        if len(seen) >= HELD_VISITS:
            truncated = True
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensor(path, var, obj)
            return
        kind = _kind(obj)
        if kind == "module":
            for name, t in [*obj.named_parameters(), *obj.named_buffers()]:
                tensor(f"{path}.{name}", var, t)
            for attr_path, value in _module_attrs(obj, path) if depth < HELD_DEPTH else ():
                visit(attr_path, var, value, depth + 1)
        elif kind in ("optimizer", "LR scheduler", "gradient scaler"):
            try:
                sd = obj.state_dict()
            except Exception:
                skipped.append(path)
                return
            scalars(f"{path}.state_dict()", var, sd, 0)
        elif kind == "random generator":
            tensor(f"{path}.get_state()", var, obj.get_state())
        elif kind in (None, "stateful object") and depth < HELD_DEPTH:
            for suffix, value in items(obj):
                visit(path + suffix, var, value, depth + 1)

    for name, obj in local_vars.items():
        if name.startswith("__") or name == "_" or type(obj).__name__ in ("Run", "TrainState"):
            continue
        visit(name, name, obj, 0)
    # A checkpoint holds the model's parameters and buffers, not its modules' plain attributes.
    for path, value in _module_attrs(state.model, "model"):
        if not isinstance(value, torch.nn.Module):
            visit(path, path, value, 1)  # named by the attribute: "model" alone would name nothing
    return {"entries": entries, "truncated": truncated, "skipped": skipped}


def compare_held(a: Mapping[int, Mapping[str, Any]], b: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Variables held in both runs whose values differ at the end, one per variable and rank, with the first
    differing path. A variable only one run holds is no difference (a value set only on a fresh start is not state
    the job keeps updating); a path only one run has within a shared variable is."""
    out: list[dict[str, Any]] = []
    for rank in sorted(set(a) & set(b)):
        ea, eb = a[rank].get("entries") or {}, b[rank].get("entries") or {}
        both = {e["var"] for e in ea.values()} & {e["var"] for e in eb.values()}
        differing: dict[str, dict[str, Any]] = {}
        for path in [*ea, *(p for p in eb if p not in ea)]:
            x, y = ea.get(path) or {}, eb.get(path) or {}
            var = x.get("var") or y.get("var")
            if var in both and var not in differing and x.get("value") != y.get("value"):
                differing[var] = {"var": var, "path": path, "rank": rank, "a": x.get("value"), "b": y.get("value")}
        out.extend(differing.values())
    return out
