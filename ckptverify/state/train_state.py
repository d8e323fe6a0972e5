"""``TrainState``: the full state of a training job as one DCP ``Stateful``.

Model and optimizers (via ``get_state_dict``/``set_state_dict``: plain, DDP and FSDP2), schedulers,
``GradScaler``, counters, data position, random streams and user extras. Rank-local state is keyed ``rank{r}``
(DCP keeps one copy of equal keys). Every rank also saves a digest of each non-tensor field
(``digests.rank{r}.<field>``); :func:`ckptverify.checkpoint.load.load` recomputes them after loading, so a field a
``load_state_dict`` silently ignored is reported.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

from ckptverify.errors import CkptVerifyError, UsageError, reported_as_itself
from ckptverify.state.dataloader import check_loader, loader_state, restore_loader
from ckptverify.state.digest import state_digest
from ckptverify.state.distributed import rank_world
from ckptverify.state.rng import RNG_STATE_VERSION, RngState, capture_rng, rank_key, restore_rng

STATE_VERSION = 1


@dataclass
class Counters:
    """Progress counters of a training job. Mutate them in the loop; they are saved and restored exactly."""

    step: int = 0
    epoch: int = 0
    tokens_seen: int = 0
    samples_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Set every counter from ``sd``, or none: all are checked before any is set."""
        values = self.validated(sd)
        for name, value in values.items():
            setattr(self, name, value)

    def validated(self, sd: Any) -> dict[str, int]:
        """The counters in ``sd`` as ints; :class:`~ckptverify.errors.CkptVerifyError` unless each is an int (or a
        one-element integer tensor)."""
        if not isinstance(sd, Mapping):
            raise CkptVerifyError(f"counters in the checkpoint are a {type(sd).__name__}, not a mapping")
        out: dict[str, int] = {}
        for name in asdict(self):
            value = sd.get(name)
            if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point \
                    and not value.dtype.is_complex and value.dtype != torch.bool:
                value = int(value)
            if type(value) is not int:
                raise CkptVerifyError(f"counter {name!r} in the checkpoint is {value!r}, not an int")
            out[name] = value
        return out


#: Whether :func:`watch_optimizer_steps` installed its hook in this process.
_watching = False


def _local(grad: Any) -> Any:
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _note_consumed(optimizer: Any, args: Any, kwargs: Any) -> None:
    """After any optimizer step: each parameter notes which gradient, at which version, the step consumed."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None:
                local = _local(g)
                p._ckptverify_consumed = (weakref.ref(local), local._version)


def watch_optimizer_steps() -> None:
    """Install (once per process) a post-step hook so :func:`pending_gradients` can tell accumulated gradients from
    those a step consumed (loops that zero gradients at the next step save with stale ``.grad``: nothing lost)."""
    global _watching
    if not _watching:
        register_optimizer_step_post_hook(_note_consumed)
        _watching = True


def pending_gradients(model: Any, *, limit: int = 5) -> tuple[list[str], int]:
    """Parameters of ``model`` (module or list) whose nonzero ``.grad`` no optimizer step consumed: accumulated
    gradients a checkpoint does not save. Returns up to ``limit`` names and the count. Per rank, no collective. Only
    parameters a step was seen to update are judged (so a save before the first step is not warned about); FSDP2's
    unsharded gradients with sync off are not seen."""
    modules = model if isinstance(model, list | tuple) else [model]
    # Named as checkpoints and traces name them: without DDP's "module." prefix.
    modules = [m.module if isinstance(m, DistributedDataParallel) else m for m in modules]
    names: list[str] = []
    count = 0
    seen: set[int] = set()
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            continue
        for name, p in module.named_parameters():
            g = p.grad
            if g is None or id(p) in seen:
                continue
            seen.add(id(p))
            local = _local(g)
            consumed = getattr(p, "_ckptverify_consumed", None)
            if consumed is None:
                continue  # no step seen for it: a step's gradients cannot be told from pending ones
            if consumed[0]() is local and consumed[1] == local._version:
                continue  # the gradient the last optimizer step used, unchanged since
            if local.numel() and bool(torch.any(local.detach() != 0)):
                count += 1
                if len(names) < limit:
                    names.append(name)
    return names, count


def pending_gradients_warning(model: Any, where: str) -> str | None:
    """The warning for accumulated gradients in ``model`` at a save to ``where``, else ``None``."""
    names, count = pending_gradients(model)
    if not count:
        return None
    shown = ", ".join(names) + (", ..." if count > len(names) else "")
    return (f"{where} is saved while {count} parameter(s) hold accumulated gradients ({shown}): a checkpoint does "
            "not save gradients, so a run resumed from it starts this optimizer step from zero gradients and "
            "differs. Save at optimizer-step boundaries (after optimizer.step() and zero_grad()); with "
            "ckptverify.Run, take each step's micro-batches together: run.steps(loader, micro_batches=K).")


def _as_list(obj: Any) -> list[Any]:
    if obj is None:
        return []
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return list(obj)
    return [obj]


class TrainState:
    """Everything a bitwise-exact resume needs, as one DCP ``Stateful``.

    Args:
        model: plain, DDP or FSDP2.
        optimizer: one or a list (over ``model``'s parameters).
        scheduler: one or a list of LR schedulers.
        scaler: a ``torch.amp.GradScaler``.
        dataloader: a ``StatefulDataLoader``, or a ``DataLoader`` driven by a
            :class:`~ckptverify.state.sampler.ResumableSampler`.
        generators: named ``torch.Generator``\\ s the job draws from.
        extras: objects with ``state_dict()``/``load_state_dict()``, saved under their names.
        counters: progress counters (a fresh :class:`Counters` by default).
        allow_reseed: on a world size change, re-seed random streams instead of refusing (not bitwise; warned).
    """

    def __init__(self, *, model: torch.nn.Module | None = None, optimizer: Any = None, scheduler: Any = None,
                 scaler: Any = None, dataloader: Any = None,
                 generators: Mapping[str, torch.Generator] | None = None,
                 extras: Mapping[str, Any] | None = None, counters: Counters | None = None,
                 allow_reseed: bool = False, seed: int = 0) -> None:
        self.model = model
        self.optimizers = _as_list(optimizer)
        watch_optimizer_steps()  # so that a save can tell accumulated gradients from consumed ones
        if self.optimizers and model is None:
            raise UsageError("an optimizer needs its model: pass model= as well")
        self.schedulers = _as_list(scheduler)
        self.scaler = scaler
        self.dataloader = dataloader
        if dataloader is not None:
            check_loader(dataloader)  # here, in plain runs too: not at the first save
        self.extras = dict(extras or {})
        for name, obj in self.extras.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise UsageError(f"extra {name!r} has no state_dict()/load_state_dict()")
        self.counters = counters if counters is not None else Counters()
        self.rank, self.world_size = rank_world()
        self.rng = RngState(generators, rank=self.rank, world_size=self.world_size, allow_reseed=allow_reseed,
                            seed=seed)
        #: Digests of each non-tensor field as saved (filled by ``load_state_dict``).
        self.saved_digests: dict[str, str] = {}
        #: World size of the checkpoint about to be loaded (set by :func:`ckptverify.checkpoint.load.load`).
        self.saved_world_size: int | None = None
        self._restored_rng: dict[str, Any] | None = None
        #: Fields whose state the last load did not restore on purpose (e.g. re-seeded RNG).
        self.warnings: list[str] = self.rng.warnings

    # ------------------------------------------------------------------ what is saved

    def model_optim_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and optimizers' state dicts as saved (``get_state_dict``: fully qualified names, live tensors);
        two empty dicts without a model."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.model is None:
            return {}, {}
        return get_state_dict(self.model, self.optimizers)

    def fields(self, rng: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The non-model fields as they are now (digested for the restore check); random streams captured first, since
        reading other state may draw from them."""
        rng = capture_rng(self.rng.generators) if rng is None else rng
        out: dict[str, Any] = {"counters": self.counters.state_dict()}
        for i, sched in enumerate(self.schedulers):
            out[f"scheduler.{i}"] = sched.state_dict()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        if self.dataloader is not None:
            out["data"] = self.loader_state()
        for kind, value in rng.items():
            out[f"rng.{kind}"] = value
        for name, obj in self.extras.items():
            out[f"extras.{name}"] = obj.state_dict()
        return out

    def digests(self, fields: Mapping[str, Any] | None = None) -> dict[str, str]:
        """The digest of each field (of ``fields`` as :meth:`fields` gave them, default: as they are now)."""
        return {name: state_digest(value) for name, value in (self.fields() if fields is None else fields).items()}

    def state_dict(self) -> dict[str, Any]:
        rng = capture_rng(self.rng.generators)  # first: reading other state may draw from the streams
        fields = self.fields(rng)
        digests = self.digests(fields)
        model_sd, optim_sd = self.model_optim_state()
        me = rank_key(self.rank)
        sd: dict[str, Any] = {"version": STATE_VERSION, "world_size": self.world_size}
        if self.model is not None:
            sd["model"] = model_sd
        if self.optimizers:
            sd["optim"] = optim_sd
        if self.schedulers:
            sd["scheduler"] = {str(i): fields[f"scheduler.{i}"] for i in range(len(self.schedulers))}
        if self.scaler is not None:
            sd["scaler"] = fields["scaler"]
        sd["counters"] = fields["counters"]
        sd["rng"] = {"version": RNG_STATE_VERSION, "world_size": self.world_size, me: rng}
        data_key, digest_key = me, me
        if self.resharding:
            # Another world size: RNG cannot be mapped (RngState refuses or re-seeds); the data position is resharded
            # from rank 0's (all ranks consume alike).
            sd["rng"] = {k: v for k, v in sd["rng"].items() if k in ("version", "world_size")}
            data_key = rank_key(0)
            digest_key = me if self.rank < (self.saved_world_size or 0) else None
        if self.dataloader is not None:
            sd["data"] = {data_key: fields["data"]}
        if self.extras:
            sd["extras"] = {name: fields[f"extras.{name}"] for name in self.extras}
        if digest_key is not None:
            sd["digests"] = {digest_key: digests}
        return sd

    def loader_state(self) -> dict[str, Any]:
        """The data loader's position as saved; every random stream is left as it was (a loader's ``state_dict`` may
        start an iterator, drawing a seed)."""
        before = capture_rng(self.rng.generators)
        try:
            return loader_state(self.dataloader)
        finally:
            restore_rng(before, self.rng.generators)

    def reapply_rng(self) -> None:
        """Put back the random streams as the last load restored them. A resumed run draws a new ``DataLoader``
        iterator's base seed after loading; call this right after creating that iterator so the next draws match the
        uninterrupted run."""
        if self._restored_rng is None:
            raise UsageError("reapply_rng() needs a state restored by ckptverify.load()")
        restore_rng(self._restored_rng, self.rng.generators)

    @property
    def resharding(self) -> bool:
        """Whether the checkpoint being loaded was saved with another world size."""
        return self.saved_world_size is not None and self.saved_world_size != self.world_size

    # ------------------------------------------------------------------ restoring

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore every field from ``sd``, or none: everything is checked first, then applied (model and optimizer
        last); on failure the applied fields are put back and :class:`~ckptverify.errors.CkptVerifyError` (or the
        explaining :class:`~ckptverify.errors.UsageError`) is raised, the state unchanged."""
        plan = self._check(sd)
        undo = self.fields_restore_point()
        try:
            self._apply(sd, plan)
        except BaseException as exc:
            undo()
            if reported_as_itself(exc) or not isinstance(exc, Exception):
                raise
            raise CkptVerifyError(f"restoring the train state failed ({type(exc).__name__}: {exc}); "
                                  "nothing was changed") from exc

    def _check(self, sd: Any) -> dict[str, Any]:
        """Everything checkable in ``sd`` without changing state; returns what applying needs."""
        if not isinstance(sd, Mapping):
            raise CkptVerifyError(f"a train state must be a mapping, got {type(sd).__name__}")
        if sd.get("version") != STATE_VERSION:
            raise CkptVerifyError(f"train state version {sd.get('version')!r} is not supported")

        def mapping(value: Any, what: str) -> Mapping[str, Any]:
            if not isinstance(value, Mapping):
                raise CkptVerifyError(f"{what} in the checkpoint is a {type(value).__name__}, not a mapping")
            return value

        if self.model is not None:
            mapping(sd.get("model"), "the model state")
        if self.optimizers:
            mapping(sd.get("optim"), "the optimizer state")
        if self.schedulers:
            scheds = mapping(sd.get("scheduler"), "the scheduler state")
            for i in range(len(self.schedulers)):
                mapping(scheds.get(str(i)), f"scheduler {i}'s state")
        if self.scaler is not None:
            mapping(sd.get("scaler"), "the scaler state")
        counters = self.counters.validated(sd.get("counters"))
        mapping(sd.get("rng"), "the RNG state")
        loader = None
        if self.dataloader is not None:
            data = mapping(sd.get("data"), "the data loader state")
            me = rank_key(self.rank)
            if not data:
                raise CkptVerifyError("the checkpoint holds no data loader state")
            loader = mapping(data[me] if me in data else next(iter(data.values())), "the data loader state")
        if self.extras:
            extras = mapping(sd.get("extras"), "the extras")
            for name in self.extras:
                if name not in extras:
                    raise CkptVerifyError(f"the checkpoint holds no state for extra {name!r}")
        digests = mapping(sd.get("digests", {}), "the saved field digests")
        mine = mapping(digests.get(rank_key(self.rank), {}), "this rank's saved field digests")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in mine.items()):
            raise CkptVerifyError("this rank's saved field digests are not all strings")
        return {"counters": counters, "loader": loader, "digests": dict(mine)}

    def fields_restore_point(self) -> Any:
        """Capture :meth:`fields` (and what a load records beside them) as they are now; return a function putting
        each part back independently. Model and optimizer are not covered."""
        rng = capture_rng(self.rng.generators)
        fields = copy.deepcopy(self.fields(rng))
        kept = dict(self.saved_digests), self._restored_rng, list(self.warnings)

        def undo() -> None:
            steps: list[Any] = [lambda: self.counters.load_state_dict(fields["counters"])]
            steps += [lambda i=i, s=s: s.load_state_dict(fields[f"scheduler.{i}"])
                      for i, s in enumerate(self.schedulers)]
            if self.scaler is not None:
                steps.append(lambda: self.scaler.load_state_dict(fields["scaler"]))
            if self.dataloader is not None:
                steps.append(lambda: restore_loader(self.dataloader, fields["data"]))
            steps += [lambda n=n, o=o: o.load_state_dict(fields[f"extras.{n}"]) for n, o in self.extras.items()]
            steps.append(lambda: restore_rng(rng, self.rng.generators))  # last: the others may draw
            for step in steps:  # put back as much as possible; the caller re-raises the failure
                with contextlib.suppress(Exception):
                    step()
            self.saved_digests, self._restored_rng, self.warnings[:] = kept

        return undo

    def _apply(self, sd: Mapping[str, Any], plan: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self.counters.load_state_dict(plan["counters"])
        for i, sched in enumerate(self.schedulers):
            sched.load_state_dict(sd["scheduler"][str(i)])
        if self.scaler is not None:
            self.scaler.load_state_dict(sd["scaler"])
        self.rng.load_state_dict(sd["rng"])
        restored_rng = capture_rng(self.rng.generators)
        for name, obj in self.extras.items():
            obj.load_state_dict(sd["extras"][name])
        if self.dataloader is not None:
            restore_loader(self.dataloader, plan["loader"])
            restore_rng(restored_rng, self.rng.generators)  # restoring a loader must not move a stream
        if self.model is not None:
            # Last: its keys and shapes come from this model's own state dict, so copying cannot fail halfway.
            set_state_dict(self.model, self.optimizers, model_state_dict=sd["model"],
                           optim_state_dict=sd.get("optim", {}))
        self._restored_rng = restored_rng
        self.saved_digests = plan["digests"]
        if self.resharding:
            # Rank-local fields legitimately differ after resharding; everything else must still match.
            self.saved_digests = {k: v for k, v in self.saved_digests.items()
                                  if not (k.startswith("rng.") or k == "data")}
            self.warnings.append(f"world size changed from {self.saved_world_size} to {self.world_size}: the data "
                                 "position was resharded; the resumed run is exact only if the global sample "
                                 "order and every other state are")
