"""``TrainState``: the full state of a training job as one DCP ``Stateful``.

Holds the model and optimizer(s) (through ``get_state_dict``/``set_state_dict``, so plain, DDP and FSDP2
models work and optimizer state is keyed by FQN), LR scheduler(s), a ``GradScaler``, counters, the data
loader's position, every random stream, and any user ``Stateful`` extras. Rank-local state (random
streams, data position, state digests) is stored under ``rank{r}`` keys, because DCP silently keeps only one
copy of items several ranks save under the same key.

Besides the state itself, every rank stores a digest of each non-tensor field as it was at save time
(``digests.rank{r}.<field>``); after a load, :func:`ckptverify.restore.load` recomputes them from the restored
objects, so a field that a ``load_state_dict`` silently ignored is reported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ckptverify._distributed import rank_world
from ckptverify.errors import UsageError
from ckptverify.state.dataloader import loader_state, restore_loader
from ckptverify.state.digest import state_digest
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
        for name in asdict(self):
            value = sd.get(name)
            if isinstance(value, torch.Tensor):
                value = int(value)
            if type(value) is not int:
                raise UsageError(f"counter {name!r} in the checkpoint is {value!r}, not an int")
            setattr(self, name, value)


def _as_list(obj: Any) -> list[Any]:
    if obj is None:
        return []
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return list(obj)
    return [obj]


class TrainState:
    """Everything a bitwise-exact resume needs, as one DCP ``Stateful``.

    Args:
        model: the model (plain, DDP or FSDP2).
        optimizer: an optimizer or a list of them (all over ``model``'s parameters).
        scheduler: an LR scheduler or a list of them.
        scaler: a ``torch.amp.GradScaler``.
        dataloader: a torchdata ``StatefulDataLoader``, or a ``DataLoader`` driven by a
            :class:`~ckptverify.state.sampler.ResumableSampler`.
        generators: named ``torch.Generator``\\ s the job draws from (a DataLoader's ``generator``, ...).
        extras: user objects with ``state_dict()``/``load_state_dict()``, saved under their names.
        counters: progress counters (a fresh :class:`Counters` by default).
        allow_reseed: on a world size change, re-seed random streams from ``seed`` and the rank instead of
            refusing (the resumed run is then not bitwise identical; a warning says so).
    """

    def __init__(self, *, model: torch.nn.Module | None = None, optimizer: Any = None, scheduler: Any = None,
                 scaler: Any = None, dataloader: Any = None,
                 generators: Mapping[str, torch.Generator] | None = None,
                 extras: Mapping[str, Any] | None = None, counters: Counters | None = None,
                 allow_reseed: bool = False, seed: int = 0) -> None:
        self.model = model
        self.optimizers = _as_list(optimizer)
        if self.optimizers and model is None:
            raise UsageError("an optimizer needs its model: pass model= as well")
        self.schedulers = _as_list(scheduler)
        self.scaler = scaler
        self.dataloader = dataloader
        if dataloader is not None:
            from ckptverify.state.dataloader import check_loader

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
        #: World size of the checkpoint about to be loaded (set by :func:`ckptverify.restore.load`).
        self.saved_world_size: int | None = None
        self._restored_rng: dict[str, Any] | None = None
        #: Fields whose state the last load did not restore on purpose (e.g. re-seeded RNG).
        self.warnings: list[str] = self.rng.warnings

    # ------------------------------------------------------------------ what is saved

    def _model_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.model is None:
            return {}, {}
        return get_state_dict(self.model, self.optimizers)

    def fields(self, rng: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The non-tensor-model fields, as they are now (the ones digested for the restore check).

        Random streams are captured first: reading other state (a loader's ``state_dict`` may start an
        iterator) can draw from them.
        """
        rng = capture_rng(self.rng.generators) if rng is None else rng
        out: dict[str, Any] = {"counters": self.counters.state_dict()}
        for i, sched in enumerate(self.schedulers):
            out[f"scheduler.{i}"] = sched.state_dict()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        if self.dataloader is not None:
            out["data"] = self._loader_state()
        for kind, value in rng.items():
            out[f"rng.{kind}"] = value
        for name, obj in self.extras.items():
            out[f"extras.{name}"] = obj.state_dict()
        return out

    def digests(self, rng: Mapping[str, Any] | None = None) -> dict[str, str]:
        return {name: state_digest(value) for name, value in self.fields(rng).items()}

    def state_dict(self) -> dict[str, Any]:
        rng = capture_rng(self.rng.generators)  # first: reading other state may draw from the streams
        digests = self.digests(rng)
        model_sd, optim_sd = self._model_optim()
        me = rank_key(self.rank)
        sd: dict[str, Any] = {"version": STATE_VERSION, "world_size": self.world_size}
        if self.model is not None:
            sd["model"] = model_sd
        if self.optimizers:
            sd["optim"] = optim_sd
        if self.schedulers:
            sd["scheduler"] = {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        sd["counters"] = self.counters.state_dict()
        sd["rng"] = {"version": RNG_STATE_VERSION, "world_size": self.world_size, me: rng}
        data_key, digest_key = me, me
        if self.resharding:
            # Loading a checkpoint of another world size: this rank's keys may not exist. RNG streams
            # cannot be mapped (RngState refuses or re-seeds on the saved world size alone); the data
            # position is resharded from rank 0's (all ranks consume at the same rate).
            sd["rng"] = {k: v for k, v in sd["rng"].items() if k in ("version", "world_size")}
            data_key = rank_key(0)
            digest_key = me if self.rank < (self.saved_world_size or 0) else None
        if self.dataloader is not None:
            sd["data"] = {data_key: self._loader_state()}
        if self.extras:
            sd["extras"] = {name: obj.state_dict() for name, obj in self.extras.items()}
        if digest_key is not None:
            sd["digests"] = {digest_key: digests}
        return sd

    def _loader_state(self) -> dict[str, Any]:
        # A loader's state_dict may start an iterator, which draws a base seed from the global generator:
        # reading the position must not move any random stream.
        before = capture_rng(self.rng.generators)
        try:
            return loader_state(self.dataloader)
        finally:
            restore_rng(before, self.rng.generators)

    def reapply_rng(self) -> None:
        """Put back the random streams as they were restored by the last load.

        Creating a ``DataLoader`` iterator draws a base seed from the global generator (or the loader's
        ``generator``). An uninterrupted run drew it when the epoch began, before the checkpoint; a resumed
        run draws it again after loading. Call this right after creating the resumed iterator (the resume
        harness does) so the next draws are the uninterrupted run's.
        """
        if self._restored_rng is None:
            raise UsageError("reapply_rng() needs a state restored by ckptverify.load()")
        restore_rng(self._restored_rng, self.rng.generators)

    @property
    def resharding(self) -> bool:
        """Whether the checkpoint being loaded was saved with another world size."""
        return self.saved_world_size is not None and self.saved_world_size != self.world_size

    # ------------------------------------------------------------------ restoring

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if sd.get("version") != STATE_VERSION:
            raise UsageError(f"train state version {sd.get('version')!r} is not supported")
        me = rank_key(self.rank)
        if self.model is not None:
            set_state_dict(self.model, self.optimizers, model_state_dict=sd["model"],
                           optim_state_dict=sd.get("optim", {}))
        for i, sched in enumerate(self.schedulers):
            sched.load_state_dict(sd["scheduler"][str(i)])
        if self.scaler is not None:
            self.scaler.load_state_dict(sd["scaler"])
        self.counters.load_state_dict(sd["counters"])
        self.rng.load_state_dict(sd["rng"])
        self._restored_rng = capture_rng(self.rng.generators)
        if self.dataloader is not None:
            data = sd["data"]
            restore_loader(self.dataloader, data.get(me) if me in data else next(iter(data.values())))
        for name, obj in self.extras.items():
            obj.load_state_dict(sd["extras"][name])
        digests = sd.get("digests", {})
        self.saved_digests = dict(digests.get(me, {})) if isinstance(digests, Mapping) else {}
        if self.resharding:
            # Rank-local fields legitimately differ after resharding; everything else must still match.
            self.saved_digests = {k: v for k, v in self.saved_digests.items()
                                  if not (k.startswith("rng.") or k == "data")}
            self.warnings.append(f"world size changed from {self.saved_world_size} to {self.world_size}: the data "
                                 "position was resharded; the resumed run is exact only if the global sample "
                                 "order and every other state are")
