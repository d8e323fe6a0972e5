"""Capture and restore every random stream of a training process, in a form DCP can save.

A resume is exact only if *every* stream is restored: ``random``, numpy's global generator, torch CPU, this rank's
CUDA device, and named ``torch.Generator`` s. :func:`capture_rng` returns kinds ``python``, ``numpy``,
``torch_cpu``, ``cuda`` (this rank's device), ``cuda_device`` (``{"index", "uuid"}``, informational) and
``gen.{name}``; every leaf is a tensor or scalar, so DCP loads it in place. CUDA is captured only when
:func:`cuda_in_use` (else a CPU rank would create a context on GPU 0).

**CUDA streams are keyed by role, not index**: ``cuda`` is restored into the rank's current device whatever its
index (launchers differ), so a new node layout resumes exactly.

**Ranks.** DCP deduplicates equal keys across ranks, so :class:`RngState` saves this rank's streams under
``rank{r}``, plus ``world_size``. A different world size raises :class:`UsageError` unless re-seeding is allowed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from ckptverify.errors import UsageError
from ckptverify.state.distributed import rank_world

__all__ = ["RNG_STATE_VERSION", "RngState", "capture_rng", "cuda_in_use", "derive_seed", "rank_key", "reseed_rng",
           "restore_rng"]

#: Version of the :class:`RngState` state dict layout.
RNG_STATE_VERSION = 1

_PYTHON = "python"
_NUMPY = "numpy"
_TORCH_CPU = "torch_cpu"
_CUDA = "cuda"
_CUDA_DEVICE = "cuda_device"
_GEN_PREFIX = "gen."


def rank_key(rank: int) -> str:
    """The key under which one rank's state is saved: ``rank{rank}``."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise UsageError(f"rank must be a non-negative int, got {rank!r}")
    return f"rank{rank}"


# ------------------------------------------------------------------------------------------- capture


def _python_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    return {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": 0.0 if gauss_next is None else float(gauss_next), "has_gauss_next": gauss_next is not None}


def _numpy_state() -> dict[str, Any]:
    st = np.random.get_state()
    if not isinstance(st, tuple):
        raise UsageError(f"numpy's global generator uses {st.get('bit_generator')!r}; only the legacy MT19937 "
                         "state is supported")
    name, keys, pos, has_gauss, cached = st
    return {"bit_generator": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _check_generators(generators: Mapping[str, torch.Generator] | None) -> dict[str, torch.Generator]:
    if generators is None:
        return {}
    if not isinstance(generators, Mapping):
        raise UsageError(f"generators must be a mapping of name -> torch.Generator, got {type(generators).__name__}")
    out: dict[str, torch.Generator] = {}
    for name, gen in generators.items():
        if not isinstance(name, str) or not name:
            raise UsageError(f"generator names must be non-empty strings, got {name!r}")
        if not isinstance(gen, torch.Generator):
            raise UsageError(f"generator {name!r} is a {type(gen).__name__}, not a torch.Generator")
        out[name] = gen
    return out


def cuda_in_use() -> bool:
    """Whether this rank uses CUDA: initialised, and its current device holds tensors. Not ``is_available()`` (a CPU
    rank would create a context on GPU 0), nor ``is_initialized()`` alone (``dcp.save`` initialises CUDA, so the
    captured kinds would change after the first save)."""
    return bool(torch.cuda.is_initialized()) and torch.cuda.memory_allocated(torch.cuda.current_device()) > 0


def capture_rng(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Every random stream's current state (layout: module docstring), plus ``generators`` as ``gen.{name}``. Tensors
    are copies. CUDA is read only if :func:`cuda_in_use`, and only the current device."""
    gens = _check_generators(generators)
    state: dict[str, Any] = {_PYTHON: _python_state(), _NUMPY: _numpy_state(),
                             _TORCH_CPU: torch.get_rng_state().clone()}
    if cuda_in_use():
        index = torch.cuda.current_device()
        state[_CUDA] = torch.cuda.get_rng_state(index).clone()
        # The UUID names the physical device; the index may be remapped.
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        state[_CUDA_DEVICE] = {"index": int(index), "uuid": "" if uuid is None else str(uuid)}
    for name, gen in gens.items():
        state[f"{_GEN_PREFIX}{name}"] = {"device": str(gen.device), "state": gen.get_state().clone()}
    return state


# ------------------------------------------------------------------------------------------- restore


def _vector(value: Any, kind: str, like: torch.Tensor | None = None) -> torch.Tensor:
    """``value`` on the CPU, refused unless a 1-D tensor (with ``like``: a uint8 byte state as long as ``like``)."""
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or (like is not None and value.dtype != torch.uint8):
        got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else f"a {type(value).__name__}")
        raise UsageError(f"RNG state {kind!r} must be a 1-D {'' if like is None else 'uint8 '}tensor, got {got}")
    if like is not None and value.numel() != like.numel():
        raise UsageError(f"RNG state {kind!r} has {value.numel()} bytes, torch expects {like.numel()}")
    return value.detach().cpu().contiguous()


def _field(state: Mapping[str, Any], kind: str, name: str) -> Any:
    if not isinstance(state, Mapping) or name not in state:
        raise UsageError(f"RNG state {kind!r} has no field {name!r}")
    return state[name]


def _restore_python(st: Mapping[str, Any]) -> None:
    internal = _vector(_field(st, _PYTHON, "state"), "python.state")
    gauss = None
    if bool(_field(st, _PYTHON, "has_gauss_next")):
        gauss = float(_field(st, _PYTHON, "gauss_next"))
    try:
        random.setstate((int(_field(st, _PYTHON, "version")), tuple(int(x) for x in internal.tolist()), gauss))
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError(f"RNG state 'python' is not a valid random.getstate(): {exc}") from exc


def _restore_numpy(st: Mapping[str, Any]) -> None:
    arr = _vector(_field(st, _NUMPY, "keys"), "numpy.keys").numpy()
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise UsageError("RNG state 'numpy.keys' holds values outside uint32")
    try:
        np.random.set_state((str(_field(st, _NUMPY, "bit_generator")), arr.astype(np.uint32),
                             int(_field(st, _NUMPY, "pos")), int(_field(st, _NUMPY, "has_gauss")),
                             float(_field(st, _NUMPY, "cached_gaussian"))))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"RNG state 'numpy' is not a valid numpy MT19937 state: {exc}") from exc


def _set_state(setter: Any, tensor: torch.Tensor, kind: str) -> None:
    try:
        setter(tensor)
    except RuntimeError as exc:
        raise UsageError(f"RNG state {kind!r} was refused by torch: {exc}") from exc


def restore_rng(state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Put back every stream :func:`capture_rng` captured, exactly. ``generators`` must name the same generators (same
    device types). ``cuda`` goes into the current device (initialising CUDA if needed). Anything unrestorable raises
    :class:`~ckptverify.errors.UsageError` with every stream as it was."""
    if not isinstance(state, Mapping):
        raise UsageError(f"RNG state must be a mapping, got {type(state).__name__}")
    gens = _check_generators(generators)

    unknown = [k for k in state if k not in (_PYTHON, _NUMPY, _TORCH_CPU, _CUDA, _CUDA_DEVICE)
               and not str(k).startswith(_GEN_PREFIX)]
    if unknown:
        raise UsageError(f"unknown RNG state kinds: {sorted(map(str, unknown))}")
    missing = [k for k in (_PYTHON, _NUMPY, _TORCH_CPU) if k not in state]
    if missing:
        raise UsageError(f"RNG state lacks {missing}")

    saved_gens = {k[len(_GEN_PREFIX) :] for k in state if k.startswith(_GEN_PREFIX)}
    if saved_gens != set(gens):
        raise UsageError(f"RNG state holds generators {sorted(saved_gens)} but {sorted(gens)} were given to restore "
                         "into")
    if _CUDA_DEVICE in state:
        ident = state[_CUDA_DEVICE]
        if (not isinstance(ident, Mapping) or isinstance(ident.get("index"), bool)
                or not isinstance(ident.get("index"), int) or not isinstance(ident.get("uuid"), str)):
            raise UsageError(f"RNG state 'cuda_device' must be {{'index': int, 'uuid': str}}, got {ident!r}")
    cuda_index = None
    if _CUDA in state:
        if not torch.cuda.is_available():
            raise UsageError("RNG state holds a CUDA generator but CUDA is not available here; resume on a CUDA "
                             "device (the rank's CUDA stream cannot be carried over otherwise)")
        cuda_index = torch.cuda.current_device()  # initialises CUDA: the capturing rank used it; restored into it

    # Validate everything that can be validated before changing any stream.
    cpu = _vector(state[_TORCH_CPU], _TORCH_CPU, torch.get_rng_state())
    cuda = None if cuda_index is None else _vector(state[_CUDA], _CUDA, torch.cuda.get_rng_state(cuda_index))
    gen_states: dict[str, torch.Tensor] = {}
    for name, gen in gens.items():
        kind = f"{_GEN_PREFIX}{name}"
        device = str(_field(state[kind], kind, "device"))
        if torch.device(device).type != gen.device.type:
            raise UsageError(f"generator {name!r} was captured on {device} but the given one is on {gen.device}")
        gen_states[name] = _vector(_field(state[kind], kind, "state"), kind, gen.get_state())

    # What only setting it can check (a Python or numpy state's own rules): a refusal puts back the streams set.
    def set_cuda(s: torch.Tensor) -> None:
        torch.cuda.set_rng_state(s, device=cuda_index)

    undo = [(random.setstate, random.getstate()), (np.random.set_state, np.random.get_state()),
            (torch.set_rng_state, torch.get_rng_state()), *((g.set_state, g.get_state()) for g in gens.values())]
    if cuda is not None:
        undo.append((set_cuda, torch.cuda.get_rng_state(cuda_index)))
    try:
        _restore_python(state[_PYTHON])
        _restore_numpy(state[_NUMPY])
        _set_state(torch.set_rng_state, cpu, _TORCH_CPU)
        if cuda is not None:
            _set_state(set_cuda, cuda, _CUDA)
        for name, t in gen_states.items():
            _set_state(gens[name].set_state, t, f"{_GEN_PREFIX}{name}")
    except BaseException:
        for setter, before in undo:
            setter(before)
        raise


# ------------------------------------------------------------------------------------------- re-seed


def derive_seed(seed: int, rank: int, kind: str) -> int:
    """A 63-bit seed for one stream from base seed, rank and kind (kinds get unrelated seeds: a named generator never
    replays the global stream)."""
    return xxhash.xxh3_64_intdigest(f"{int(seed)}:{int(rank)}:{kind}".encode()) & ((1 << 63) - 1)


def reseed_rng(seed: int, rank: int, generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Seed every stream deterministically from ``seed`` and ``rank`` (see :func:`derive_seed`)."""
    gens = _check_generators(generators)
    random.seed(derive_seed(seed, rank, _PYTHON))
    np.random.seed(derive_seed(seed, rank, _NUMPY) & 0xFFFFFFFF)
    torch.manual_seed(derive_seed(seed, rank, _TORCH_CPU))  # also seeds every CUDA device, identically
    if cuda_in_use():
        # The rank's own device; without CUDA initialised, the queued manual_seed applies (no context for a CPU rank).
        torch.cuda.manual_seed(derive_seed(seed, rank, _CUDA))
    for name, gen in gens.items():
        gen.manual_seed(derive_seed(seed, rank, f"{_GEN_PREFIX}{name}"))


# ------------------------------------------------------------------------------------------- Stateful


class RngState:
    """This rank's random streams as a DCP ``Stateful``.

    ``state_dict()`` is ``{"version": 1, "world_size": W, "rank{r}": capture_rng(generators)}``, so DCP keeps every
    rank's copy. On a different world size, loading raises :class:`UsageError`, or with ``allow_reseed=True``
    re-seeds from ``seed`` and rank (:func:`reseed_rng`) and appends to :attr:`warnings`. Growing worlds need DCP's
    ``allow_partial_load=True``; the world-size check still runs. ``rank``/``world_size`` default to the process group.
    """

    def __init__(self, generators: Mapping[str, torch.Generator] | None = None, *, rank: int | None = None,
                 world_size: int | None = None, allow_reseed: bool = False, seed: int = 0) -> None:
        default_rank, default_world = rank_world()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise UsageError(f"world_size must be a positive int, got {self.world_size!r}")
        rank_key(self.rank)  # validates
        if self.rank >= self.world_size:
            raise UsageError(f"rank {self.rank} is out of range for world size {self.world_size}")
        self.generators = _check_generators(generators)
        self.allow_reseed = bool(allow_reseed)
        self.seed = int(seed)
        #: Messages about anything that made the restore inexact (a re-seed after a world size change).
        self.warnings: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return {"version": RNG_STATE_VERSION, "world_size": self.world_size,
                rank_key(self.rank): capture_rng(self.generators)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise UsageError(f"RNG state dict must be a mapping, got {type(state_dict).__name__}")
        version = state_dict.get("version")
        if isinstance(version, bool) or version != RNG_STATE_VERSION:
            raise UsageError(f"RNG state dict version {version!r} is not supported (readable: {RNG_STATE_VERSION})")
        saved_world = state_dict.get("world_size")
        if isinstance(saved_world, bool) or not isinstance(saved_world, int):
            raise UsageError(f"RNG state dict has no valid world_size (got {saved_world!r})")
        if saved_world != self.world_size:
            if not self.allow_reseed:
                raise UsageError(f"RNG state was saved by {saved_world} rank(s) but this job has {self.world_size}; "
                                 "per-rank random streams cannot be carried over exactly. Pass allow_reseed=True to "
                                 "re-seed from a seed and the rank (the resumed run will then not be bitwise "
                                 "identical to an uninterrupted one).")
            reseed_rng(self.seed, self.rank, self.generators)
            self.warnings.append(f"world size changed from {saved_world} to {self.world_size}: RNG streams of rank "
                                 f"{self.rank} were re-seeded from seed {self.seed} and the rank, not restored; the "
                                 "resumed run is not bitwise identical to an uninterrupted one")
            return
        key = rank_key(self.rank)
        if key not in state_dict:
            raise UsageError(f"RNG state dict has no entry {key!r} for this rank (keys: {sorted(state_dict)})")
        restore_rng(state_dict[key], self.generators)
