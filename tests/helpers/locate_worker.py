"""Ranks for the locate tests on real ops: run the user's training script (``user_scripts/locate_ddp_train.py``)
under a small op logger and write each run's op log of one step as ``OpEvent`` records.

The logger is the minimum the analysis needs from the recorder, built on the public ``TorchDispatchMode``: every
op of the logged step with its key ``(step, phase, module, op, occurrence)``, execution index, fingerprints of
its tensor inputs (taken before the op runs, so before an in-place op writes them) and outputs (``None`` for an
``empty*`` output: uninitialized memory is not a value), and for a c10d collective its group and per-group
sequence number, with the output fingerprinted after the collective completed.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ckptverify.trace.category import host_digest
from ckptverify.trace.oplog import CommInfo, OpEvent

SCRIPT = Path(__file__).parents[1] / "user_scripts" / "locate_ddp_train.py"


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _digests(value: Any, uninitialized: set[int] = frozenset()) -> tuple[int | None, ...]:  # type: ignore[assignment]
    return tuple(None if _ptr(x) in uninitialized else host_digest(x) for x in _tensors(value))


class OpLogger(TorchDispatchMode):
    """Logs the ops of step ``step`` (steps count finished optimizer steps, from 1)."""

    def __init__(self, step: int, world: int, capture: tuple | None = None, capture_path: str | None = None) -> None:
        super().__init__()
        self.capture = capture
        self.capture_path = capture_path
        self.step = step
        self.world = world
        self.current = 1
        self.in_optimizer = False
        self.backward_seen = False
        # The step starts at its first module call: the ops before it rebuild the batches the DataLoader workers
        # send, in the order they arrive (prefetching), which is not the step's computation.
        self.started = False
        self.modules: list[str] = []
        self.names: dict[int, str] = {}
        self.events: list[OpEvent] = []
        self.occ: dict[tuple[str, str, str], int] = {}
        self.seq: dict[tuple[int, ...], int] = {}
        # Storages an empty* op made and no op has written yet: reading them is reading uninitialized memory
        # (nn.Linear's uniform_ on its torch.empty weight), an artifact, not a value.
        self.uninitialized: set[int] = set()

    # -- module and phase tracking, through global hooks
    def pre(self, module: torch.nn.Module, args: Any) -> None:
        self.started = self.started or self.current == self.step
        if not self.modules and id(module) not in self.names:
            self.names.update({id(m): n for n, m in module.named_modules()})
        self.modules.append(self.names.get(id(module), type(module).__name__))

    def post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if self.modules:
            self.modules.pop()

    def opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.in_optimizer = True

    def opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.in_optimizer = False
        self.backward_seen = False
        self.current += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.current != self.step or not self.started:
            return func(*args, **kwargs)
        if self.in_optimizer:
            phase = "optimizer"
        elif torch._C._current_graph_task_id() >= 0:
            phase = "backward"
            self.backward_seen = True
        elif self.modules or not self.backward_seen:
            phase = "forward"
        else:
            phase = "other"  # after the backward and outside any module: clipping, the loss scaler
        module = self.modules[-1] if self.modules and phase == "forward" else ""
        # An out= argument is only written: what it held before is not an input.
        outs = {a.name for a in func._schema.arguments if a.kwarg_only and a.alias_info is not None
                and a.alias_info.is_write}
        inputs = _digests((args, {k: v for k, v in kwargs.items() if k not in outs}), self.uninitialized)
        key = (phase, module, str(func))
        if self.capture is not None and (self.step, *key, self.occ.get(key, 0)) == tuple(self.capture):
            # As OpWindow.capture does: the op's arguments, detached and on the host, before it runs.
            host = tree_map(lambda x: x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
            torch.save({"op": str(func), "args": tuple(host[0]), "kwargs": dict(host[1])}, self.capture_path)
        out = func(*args, **kwargs)
        written = [a for a, arg in zip(args, func._schema.arguments, strict=False)
                   if arg.alias_info is not None and arg.alias_info.is_write]
        written += [v for k, v in kwargs.items() if any(a.name == k and a.alias_info is not None
                                                        and a.alias_info.is_write for a in func._schema.arguments)]
        for t in _tensors(written):
            self.uninitialized.discard(_ptr(t))
        name = str(func)
        comm = None
        if func.namespace == "c10d":
            group = tuple(range(self.world))
            seq = self.seq.get(group, 0)
            self.seq[group] = seq + 1
            if isinstance(out, tuple) and len(out) == 2 and hasattr(out[1], "wait"):
                out[1].wait()  # the output is fingerprinted at completion
            comm = CommInfo(collective=func._schema.name.split("::")[1], group=group, seq=seq)
            outputs = _digests(out[0] if isinstance(out, tuple) else out)
        elif "empty" in func._schema.name:
            outputs = tuple(None for _ in _tensors(out))
            self.uninitialized.update(_ptr(t) for t in _tensors(out))
        else:
            outputs = _digests(out, self.uninitialized)  # a view of uninitialized memory is not a value either
        key = (phase, module, name)
        occurrence = self.occ.get(key, 0)
        self.occ[key] = occurrence + 1
        self.events.append(OpEvent(step=self.step, phase=phase, module=module, op=name, occurrence=occurrence,
                                   index=len(self.events), inputs=inputs, outputs=outputs, comm=comm))
        return out


def _load_script() -> Any:
    # Imported by name from its folder, so the DataLoader workers can unpickle its Dataset.
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module(SCRIPT.stem)


def run_logged(rank: int, world: int, out_dir: str, plant: str, runs: int, step: int,
               capture: tuple | None = None) -> None:
    """In one rank: ``runs`` runs of the user's script for ``step`` steps, each rebuilt from its seed, logging
    step ``step``; writes ``rank<r>.pkl`` (a list of ``runs`` op logs). ``capture``: ``(rank, key)`` of one op
    whose inputs that rank saves to ``capture.pt``."""
    if plant:
        os.environ["LOCATE_PLANT"] = plant
    # A rank started by torchrun forks its DataLoader workers (the platform default); a spawned rank would
    # spawn them, each importing torch again.
    multiprocessing.set_start_method("fork", force=True)
    script = _load_script()
    logs = []
    for _ in range(runs):
        mine = capture is not None and capture[0] == rank
        logger = OpLogger(step, world, capture=capture[1] if mine else None,
                          capture_path=os.path.join(out_dir, "capture.pt"))
        handles = [
            register_module_forward_pre_hook(logger.pre),
            register_module_forward_hook(logger.post),
            register_optimizer_step_pre_hook(logger.opt_pre),
            register_optimizer_step_post_hook(logger.opt_post),
        ]
        try:
            with logger:
                script.train(step)
        finally:
            for h in handles:
                h.remove()
        logs.append(logger.events)
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(logs, f)
