"""Site names of a trace row, and the model as its names see it.

A site is what one cell digests (``grad.<fqn>``, ``module.<name>.fwd#k``, ...). Names are the canonical FQNs
``get_state_dict`` uses (wrapper components dropped), so sites line up whatever wraps the model (DDP,
``torch.compile``, activation checkpointing, FSDP1)."""

from __future__ import annotations

from typing import Any

#: The name the root module goes by in site names.
ROOT_MODULE = "(root)"

#: Wrapper components ``get_state_dict`` leaves out of FQNs; module and gradient names drop them too.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})

#: Order of the non-tensor fields of a TrainState in a row, by kind.
_FIELD_ORDER = {"scheduler": 0, "rng": 1, "data": 2, "counter": 3, "extra": 4}

def canonical_name(name: str) -> str:
    """``name`` without wrapper components (``_orig_mod``, ``_checkpoint_wrapped_module``, ...)."""
    return ".".join(part for part in name.split(".") if part and part not in _WRAPPER_PARTS)


def module_site(module: str, direction: str, occurrence: int) -> str:
    """Site name of a module's input (``in``), output (``fwd``) or input gradient (``bwd``) at one occurrence."""
    return f"module.{module or ROOT_MODULE}.{direction}#{occurrence}"


def _unwrap(model: Any) -> Any:
    """The user's module inside DDP / ``torch.compile`` wrappers (whose names get_state_dict leaves out)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
            model = model._orig_mod
        else:
            return model


def is_dtensor(t: Any) -> bool:
    from ckptverify.fingerprint.subclass import dtensor_type

    dtype = dtensor_type()
    return dtype is not None and isinstance(t, dtype)


def local_view(t: Any) -> Any:
    """This rank's shard of a DTensor (``to_local()``), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def non_persistent_buffers(model: Any) -> list[tuple[str, Any]]:
    """``(canonical name, tensor)`` of each ``persistent=False`` buffer of ``model`` (no checkpoint holds them)."""
    out = []
    for mod_name, module in _unwrap(model).named_modules():
        for name in sorted(getattr(module, "_non_persistent_buffers_set", ())):
            buf = module._buffers.get(name)
            if buf is not None:
                out.append((canonical_name(f"{mod_name}.{name}" if mod_name else name), buf))
    return out


_FIELD_KINDS = {"counters": "counter", "scaler": "optim", "data": "data", "scheduler": "scheduler", "rng": "rng"}


def _field_kind(name: str) -> str:
    """The site kind of a TrainState field's cell (``scheduler.0``, ``extras.ema``, ...)."""
    return _FIELD_KINDS.get(name) or _FIELD_KINDS.get(name.split(".", 1)[0], "extra")

