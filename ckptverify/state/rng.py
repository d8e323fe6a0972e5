"""Capture and restore every random stream of a training process, in a form DCP can save.

A resumed run draws the same random numbers as an uninterrupted one only if *every* generator it draws from
is restored: python's :mod:`random`, numpy's global generator, torch's CPU generator, each CUDA device's
generator, and any explicit ``torch.Generator`` (a ``DataLoader``'s ``generator``, a dropout generator).
:func:`capture_rng` returns their states as one dict of *kinds*::

    python        {"version", "state" (int64 tensor, 625), "gauss_next", "has_gauss_next"}
    numpy         {"bit_generator", "keys" (int64 tensor, 624), "pos", "has_gauss", "cached_gaussian"}
    torch_cpu     uint8 tensor (torch.get_rng_state())
    cuda.{i}      uint8 tensor, one per visible CUDA device (only when CUDA is available)
    gen.{name}    {"device": str, "state": uint8 tensor}, one per named generator

Every leaf is a tensor, an int, a float, a bool or a string, so the dict goes through
``torch.distributed.checkpoint`` as is, and tensors are loaded in place into a template of the same shape.
:func:`restore_rng` puts a captured dict back; :func:`rng_fingerprints` digests each kind (xxh3-128 of a
canonical byte serialization) so saved and restored states can be compared without drawing from them.

**Ranks.** DCP silently deduplicates items that several ranks save under the same key, so rank-local state
must be keyed by rank. :class:`RngState` is a DCP ``Stateful`` whose ``state_dict()`` holds only this rank's
streams under ``rank{r}`` (see :func:`rank_key`) and the world size under ``world_size`` (equal on all ranks,
so deduplicating it is harmless). Loading with a different world size raises :class:`WorldSizeChangedError`
unless re-seeding was allowed.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from ckptverify.errors import UsageError, WorldSizeChangedError
from ckptverify.state.distributed import rank_world

__all__ = [
    "RNG_STATE_VERSION",
    "RngState",
    "WorldSizeChangedError",
    "capture_rng",
    "derive_seed",
    "rank_key",
    "reseed_rng",
    "restore_rng",
    "rng_fingerprints",
]

#: Version of the :class:`RngState` state dict layout.
RNG_STATE_VERSION = 1

_PYTHON = "python"
_NUMPY = "numpy"
_TORCH_CPU = "torch_cpu"
_CUDA_PREFIX = "cuda."
_GEN_PREFIX = "gen."


def rank_key(rank: int) -> str:
    """The key under which one rank's state is saved: ``rank{rank}``."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise UsageError(f"rank must be a non-negative int, got {rank!r}")
    return f"rank{rank}"


# ------------------------------------------------------------------------------------------- capture


def _python_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    return {
        "version": int(version),
        "state": torch.tensor(internal, dtype=torch.int64),
        "gauss_next": 0.0 if gauss_next is None else float(gauss_next),
        "has_gauss_next": gauss_next is not None,
    }


def _numpy_state() -> dict[str, Any]:
    st = np.random.get_state()
    if not isinstance(st, tuple):
        raise UsageError(
            f"numpy's global generator uses {st.get('bit_generator')!r}; only the legacy MT19937 state is supported"
        )
    name, keys, pos, has_gauss, cached = st
    return {
        "bit_generator": str(name),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


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


def capture_rng(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """The current state of every random stream of this process (see the module docstring for the layout).

    ``generators`` names explicit ``torch.Generator`` objects to capture as well (``gen.{name}``). The
    returned tensors are copies: drawing afterwards does not change them.
    """
    gens = _check_generators(generators)
    state: dict[str, Any] = {
        _PYTHON: _python_state(),
        _NUMPY: _numpy_state(),
        _TORCH_CPU: torch.get_rng_state().clone(),
    }
    if torch.cuda.is_available():
        for i, t in enumerate(torch.cuda.get_rng_state_all()):
            state[f"{_CUDA_PREFIX}{i}"] = t.clone()
    for name, gen in gens.items():
        state[f"{_GEN_PREFIX}{name}"] = {"device": str(gen.device), "state": gen.get_state().clone()}
    return state


# ------------------------------------------------------------------------------------------- restore


def _byte_state(value: Any, kind: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise UsageError(f"RNG state {kind!r} must be a 1-D uint8 tensor, got {_describe(value)}")
    return value.detach().cpu().contiguous()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _field(state: Mapping[str, Any], kind: str, name: str) -> Any:
    if not isinstance(state, Mapping) or name not in state:
        raise UsageError(f"RNG state {kind!r} has no field {name!r}")
    return state[name]


def _restore_python(st: Mapping[str, Any]) -> None:
    internal = _field(st, _PYTHON, "state")
    if not isinstance(internal, torch.Tensor) or internal.dim() != 1:
        raise UsageError(f"RNG state 'python.state' must be a 1-D tensor, got {_describe(internal)}")
    gauss = None
    if bool(_field(st, _PYTHON, "has_gauss_next")):
        gauss = float(_field(st, _PYTHON, "gauss_next"))
    try:
        random.setstate((int(_field(st, _PYTHON, "version")), tuple(int(x) for x in internal.tolist()), gauss))
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError(f"RNG state 'python' is not a valid random.getstate(): {exc}") from exc


def _restore_numpy(st: Mapping[str, Any]) -> None:
    keys = _field(st, _NUMPY, "keys")
    if not isinstance(keys, torch.Tensor) or keys.dim() != 1:
        raise UsageError(f"RNG state 'numpy.keys' must be a 1-D tensor, got {_describe(keys)}")
    arr = keys.detach().cpu().numpy()
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise UsageError("RNG state 'numpy.keys' holds values outside uint32")
    try:
        np.random.set_state(
            (
                str(_field(st, _NUMPY, "bit_generator")),
                arr.astype(np.uint32),
                int(_field(st, _NUMPY, "pos")),
                int(_field(st, _NUMPY, "has_gauss")),
                float(_field(st, _NUMPY, "cached_gaussian")),
            )
        )
    except (TypeError, ValueError) as exc:
        raise UsageError(f"RNG state 'numpy' is not a valid numpy MT19937 state: {exc}") from exc


def _set_state(setter: Any, tensor: torch.Tensor, kind: str) -> None:
    try:
        setter(tensor)
    except RuntimeError as exc:
        raise UsageError(f"RNG state {kind!r} was refused by torch: {exc}") from exc


def restore_rng(state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Put back every stream captured by :func:`capture_rng`, exactly.

    ``generators`` must name the same generators as at capture time (each on the same device type); the
    CUDA devices visible now must be the ones captured. Anything else raises
    :class:`~ckptverify.errors.UsageError`, so no stream is silently left unrestored.
    """
    if not isinstance(state, Mapping):
        raise UsageError(f"RNG state must be a mapping, got {type(state).__name__}")
    gens = _check_generators(generators)

    unknown = [
        k
        for k in state
        if k not in (_PYTHON, _NUMPY, _TORCH_CPU) and not str(k).startswith((_CUDA_PREFIX, _GEN_PREFIX))
    ]
    if unknown:
        raise UsageError(f"unknown RNG state kinds: {sorted(map(str, unknown))}")
    missing = [k for k in (_PYTHON, _NUMPY, _TORCH_CPU) if k not in state]
    if missing:
        raise UsageError(f"RNG state lacks {missing}")

    saved_gens = {k[len(_GEN_PREFIX) :] for k in state if k.startswith(_GEN_PREFIX)}
    if saved_gens != set(gens):
        raise UsageError(
            f"RNG state holds generators {sorted(saved_gens)} but {sorted(gens)} were given to restore into"
        )
    saved_cuda = sorted(k for k in state if k.startswith(_CUDA_PREFIX))
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected_cuda = [f"{_CUDA_PREFIX}{i}" for i in range(n_cuda)]
    if sorted(saved_cuda) != sorted(expected_cuda):
        raise UsageError(
            f"RNG state holds {len(saved_cuda)} CUDA generator(s) but {n_cuda} CUDA device(s) are visible; "
            "restore on the same devices it was captured on"
        )

    # Validate everything that can be validated before changing any stream.
    cpu = _byte_state(state[_TORCH_CPU], _TORCH_CPU)
    if cpu.numel() != torch.get_rng_state().numel():
        raise UsageError(
            f"RNG state 'torch_cpu' has {cpu.numel()} bytes, torch expects {torch.get_rng_state().numel()}"
        )
    cuda = {k: _byte_state(state[k], k) for k in saved_cuda}
    gen_states: dict[str, torch.Tensor] = {}
    for name, gen in gens.items():
        kind = f"{_GEN_PREFIX}{name}"
        device = str(_field(state[kind], kind, "device"))
        if torch.device(device).type != gen.device.type:
            raise UsageError(f"generator {name!r} was captured on {device} but the given one is on {gen.device}")
        gen_states[name] = _byte_state(_field(state[kind], kind, "state"), kind)
        if gen_states[name].numel() != gen.get_state().numel():
            raise UsageError(
                f"RNG state {kind!r} has {gen_states[name].numel()} bytes, the generator expects "
                f"{gen.get_state().numel()}"
            )

    _restore_python(state[_PYTHON])
    _restore_numpy(state[_NUMPY])
    _set_state(torch.set_rng_state, cpu, _TORCH_CPU)
    for kind, t in cuda.items():
        index = int(kind[len(_CUDA_PREFIX) :])
        _set_state(lambda s, i=index: torch.cuda.set_rng_state(s, device=i), t, kind)
    for name, t in gen_states.items():
        _set_state(gens[name].set_state, t, f"{_GEN_PREFIX}{name}")


# ------------------------------------------------------------------------------------------- re-seed


def derive_seed(seed: int, rank: int, kind: str) -> int:
    """A 63-bit seed for one stream, derived from the base seed, the rank and the stream's kind.

    Distinct kinds get unrelated seeds, so a named generator never replays the global torch stream.
    """
    return xxhash.xxh3_64_intdigest(f"{int(seed)}:{int(rank)}:{kind}".encode()) & ((1 << 63) - 1)


def reseed_rng(seed: int, rank: int, generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Seed every stream deterministically from ``seed`` and ``rank`` (see :func:`derive_seed`)."""
    gens = _check_generators(generators)
    random.seed(derive_seed(seed, rank, _PYTHON))
    np.random.seed(derive_seed(seed, rank, _NUMPY) & 0xFFFFFFFF)
    torch.manual_seed(derive_seed(seed, rank, _TORCH_CPU))  # also seeds every CUDA device, identically
    if torch.cuda.is_available():
        torch.cuda.init()
        for i in range(torch.cuda.device_count()):
            torch.cuda.default_generators[i].manual_seed(derive_seed(seed, rank, f"{_CUDA_PREFIX}{i}"))
    for name, gen in gens.items():
        gen.manual_seed(derive_seed(seed, rank, f"{_GEN_PREFIX}{name}"))


# ------------------------------------------------------------------------------------------- fingerprints


def _canonical(obj: Any, out: bytearray) -> None:
    """Append an unambiguous, type-tagged byte encoding of ``obj``."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        dtype = str(t.dtype).encode()
        out += b"T" + struct.pack("<I", len(dtype)) + dtype + struct.pack("<I", t.dim())
        out += b"".join(struct.pack("<q", s) for s in t.shape)
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out += struct.pack("<Q", len(raw)) + raw
    elif isinstance(obj, bool):
        out += b"B" + (b"\x01" if obj else b"\x00")
    elif isinstance(obj, int):
        raw = str(obj).encode()
        out += b"I" + struct.pack("<I", len(raw)) + raw
    elif isinstance(obj, float):
        out += b"F" + struct.pack("<d", obj)
    elif isinstance(obj, str):
        raw = obj.encode()
        out += b"S" + struct.pack("<Q", len(raw)) + raw
    elif isinstance(obj, bytes):
        out += b"Y" + struct.pack("<Q", len(obj)) + obj
    elif obj is None:
        out += b"N"
    elif isinstance(obj, Mapping):
        out += b"D" + struct.pack("<Q", len(obj))
        for key in sorted(obj, key=str):
            _canonical(str(key), out)
            _canonical(obj[key], out)
    elif isinstance(obj, list | tuple):
        out += b"L" + struct.pack("<Q", len(obj))
        for item in obj:
            _canonical(item, out)
    else:
        raise UsageError(f"cannot fingerprint a {type(obj).__name__} in an RNG state")


def rng_fingerprints(state: Mapping[str, Any]) -> dict[str, str]:
    """A stable hex digest (xxh3-128 of a canonical serialization) for each kind in a captured state.

    Equal digests mean equal states; the digest depends only on the values (not on tensor strides, devices
    or dict order), so a state captured before saving and one loaded from a checkpoint compare directly.
    """
    if not isinstance(state, Mapping):
        raise UsageError(f"RNG state must be a mapping, got {type(state).__name__}")
    out: dict[str, str] = {}
    for kind in sorted(state, key=str):
        buf = bytearray()
        _canonical(state[kind], buf)
        out[str(kind)] = xxhash.xxh3_128_hexdigest(bytes(buf))
    return out


# ------------------------------------------------------------------------------------------- Stateful


class RngState:
    """This rank's random streams as a DCP ``Stateful``.

    ``state_dict()`` is ``{"version": 1, "world_size": W, "rank{r}": capture_rng(generators)}``: only this
    rank's streams, under a rank-specific key, so that DCP keeps every rank's copy and each rank loads its
    own. Load it with ``dcp.load({"rng": rng_state}, ...)`` (DCP calls ``state_dict()`` for the template and
    then :meth:`load_state_dict`).

    With a different world size, the saved streams cannot be mapped to the new ranks: loading raises
    :class:`WorldSizeChangedError`, or, with ``allow_reseed=True``, re-seeds every stream from ``seed`` and
    the rank (:func:`reseed_rng`) and appends a message to :attr:`warnings`. When the world grows, ranks
    without a saved key need DCP's partial load (``DefaultLoadPlanner(allow_partial_load=True)``) to get as
    far as :meth:`load_state_dict`; the world-size check then still runs, because ``world_size`` is saved by
    every rank.

    ``rank`` and ``world_size`` default to the initialized process group (else 0 and 1).
    """

    def __init__(
        self,
        generators: Mapping[str, torch.Generator] | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        allow_reseed: bool = False,
        seed: int = 0,
    ) -> None:
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
        #: Digests of the streams last restored by :meth:`load_state_dict` (empty after a re-seed).
        self.restored_fingerprints: dict[str, str] = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": RNG_STATE_VERSION,
            "world_size": self.world_size,
            rank_key(self.rank): capture_rng(self.generators),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise UsageError(f"RNG state dict must be a mapping, got {type(state_dict).__name__}")
        version = state_dict.get("version")
        if version != RNG_STATE_VERSION:
            raise UsageError(f"RNG state dict version {version!r} is not supported (expected {RNG_STATE_VERSION})")
        saved_world = state_dict.get("world_size")
        if isinstance(saved_world, bool) or not isinstance(saved_world, int):
            raise UsageError(f"RNG state dict has no valid world_size (got {saved_world!r})")
        if saved_world != self.world_size:
            if not self.allow_reseed:
                raise WorldSizeChangedError(
                    f"RNG state was saved by {saved_world} rank(s) but this job has {self.world_size}; per-rank "
                    "random streams cannot be carried over exactly. Pass allow_reseed=True to re-seed from a seed "
                    "and the rank (the resumed run will then not be bitwise identical to an uninterrupted one)."
                )
            reseed_rng(self.seed, self.rank, self.generators)
            self.restored_fingerprints = {}
            self.warnings.append(
                f"world size changed from {saved_world} to {self.world_size}: RNG streams of rank {self.rank} were "
                f"re-seeded from seed {self.seed} and the rank, not restored; the resumed run is not bitwise "
                "identical to an uninterrupted one"
            )
            return
        key = rank_key(self.rank)
        if key not in state_dict:
            raise UsageError(f"RNG state dict has no entry {key!r} for this rank (keys: {sorted(state_dict)})")
        restore_rng(state_dict[key], self.generators)
        self.restored_fingerprints = rng_fingerprints(state_dict[key])
