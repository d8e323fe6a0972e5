"""One budgeted allowlist unpickler: every restricted unpickler of the package is a configuration of it.

A pickle is a program: each global it names is imported and called. A configuration is an allowlist
``(module, name) -> stand-in`` (nothing outside it is imported; nothing in it is the real object), what each
stand-in does when called or ``BUILD``-ed (shared ones derive from :class:`FrozenGlobal`), a :class:`Budget`
with :class:`Limits` and its message. :class:`ReferenceUnpickler` (pure Python) applies every bound
per opcode and follows the C unpickler where it is more lenient. :class:`FastUnpickler` (C, no per-opcode hooks)
is used only on pickles a byte pass admitted (``pickle_subset.in_fast_subset``). Every refusal is a
:class:`~ckptverify.errors.BadPickle` (a global outside the allowlist: :class:`~ckptverify.errors.UnsafeGlobal`).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptverify.errors import BadPickle, UnsafeGlobal
from ckptverify.safeparse.dtypes import DTYPE_ITEMSIZE

__all__ = ["DTYPE_GLOBALS", "Allowlisted", "Budget", "DTypeGlobal", "FastUnpickler", "FrozenGlobal", "Limits",
           "ReferenceUnpickler", "callable_global", "refuse_build", "refusing"]


@dataclass(frozen=True)
class Limits:
    """The bounds of one configuration."""

    #: Work charges allowed per byte of pickle, and in addition to that (:meth:`work`).
    work_per_byte: int = 0
    work_base: int = 0
    #: Deepest nesting of a tuple that is hashed (and, where a configuration walks its result, of the result).
    max_depth: int = 64
    #: Most values a hashed tuple (a dict key, a set member) may expand to; 0: no tuple may be hashed at all.
    max_key_nodes: int = 1024
    #: How far past the entries made a memo index may reach (the C unpickler zero-fills to twice the index).
    memo_slack: int = 0

    def work(self, size: int) -> int:
        """The work budget of a pickle of ``size`` bytes."""
        return self.work_per_byte * size + self.work_base


class Budget:
    """The work one parse may still do (``left``) and what it learned about tuples it hashed. Hot paths charge inline
    (``left -= n``, then :meth:`charge` ``(0)`` if negative, which raises :class:`BadPickle` ``(exceeded)``)."""

    __slots__ = ("exceeded", "left", "limits", "tuples")

    def __init__(self, limit: int, exceeded: str, limits: Limits = Limits()) -> None:
        self.left = limit
        self.limits = limits
        self.exceeded = exceeded
        #: id -> (values it expands to, nesting height, the tuple itself: kept so the id is not reused).
        self.tuples: dict[int, tuple[int, int, tuple[Any, ...]]] = {}

    def charge(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise BadPickle(self.exceeded)

    def check_hashable(self, value: tuple[Any, ...], flat: type | None = None, what: str = "the pickle") -> None:
        """Refuse, before hashing, a tuple (not a ``flat`` one: a scalar-only tuple type, counted, not walked) whose
        hash would recurse past :attr:`Limits.max_depth` or visit more than :attr:`Limits.max_key_nodes` values
        (``hash`` recurses in C without limit). Each tuple is examined once per parse."""
        if self.limits.max_key_nodes == 0:
            raise BadPickle(f"{what} uses a tuple as a dict key or set member")
        _tuple_nodes(value, self.tuples, 0, self.limits, flat)


def _tuple_nodes(t: tuple[Any, ...], memo: dict[int, tuple[int, int, tuple[Any, ...]]], depth: int, limits: Limits,
                 flat: type | None) -> int:
    known = memo.get(id(t))
    max_depth = limits.max_depth
    if known is not None:
        if depth + known[1] > max_depth:
            raise BadPickle(f"a hashed tuple nests deeper than {max_depth} levels")
        return known[0]
    if depth >= max_depth:
        raise BadPickle(f"a hashed tuple nests deeper than {max_depth} levels")
    nodes, height = 1, 1
    for x in t:
        if isinstance(x, tuple):
            if type(x) is flat:
                nodes += 1 + len(x)
            else:
                nodes += _tuple_nodes(x, memo, depth + 1, limits, flat)
                height = max(height, memo[id(x)][1] + 1)
        else:
            nodes += 1
        if nodes > limits.max_key_nodes:
            raise BadPickle(f"a hashed tuple (a dict key or set member) holds more than {limits.max_key_nodes} values")
    memo[id(t)] = (nodes, height, t)
    return nodes


@contextmanager
def refusing() -> Iterator[None]:
    """Any failure of a read of untrusted bytes, within, as a :class:`BadPickle`: a finding, never a traceback."""
    try:
        yield
    except (BadPickle, UnsafeGlobal):
        raise
    except MemoryError:
        raise BadPickle("the pickle asks for more memory than is available") from None
    except RecursionError:
        raise BadPickle("the pickle nests too deeply") from None
    except Exception as exc:
        raise BadPickle(f"not a readable pickle: {type(exc).__name__}: {exc}"[:300]) from None


def refuse_build(self: Any, state: Any) -> None:
    """``__setstate__`` of a checked record (a frozen slots dataclass would take a ``BUILD``, rewriting the record
    after its check): refused."""
    raise BadPickle(f"the pickle modifies a {type(self).__name__}")


class FrozenGlobal:
    """A stand-in for a global (function, dtype, storage type, enum) that no pickle can change (``BUILD``, the only
    opcode that sets state, is refused), so shared stand-ins stay as made. Not callable; see
    :func:`callable_global`."""

    __slots__ = ("_label",)

    def __init__(self, label: str) -> None:
        self._label = label

    def __setstate__(self, state: Any) -> None:
        raise BadPickle(f"the pickle modifies the global {self._label}")

    def __call__(self, *args: Any) -> Any:
        raise BadPickle(f"{self._label} is not callable")


def callable_global(label: str, call: Callable[..., Any]) -> FrozenGlobal:
    """A :class:`FrozenGlobal` whose call is ``call`` (one Python call per ``REDUCE``)."""
    cls = type("_CallableGlobal", (FrozenGlobal,), {"__slots__": (), "__call__": staticmethod(call)})
    return cls(label)


class DTypeGlobal(FrozenGlobal):
    """A torch dtype global; not callable, like ``torch.float32``."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return self._label[len("torch."):]


#: Every dtype global a pickle may name -> its stand-in (one per process: none can be changed).
DTYPE_GLOBALS: dict[tuple[str, str], DTypeGlobal] = {("torch", n): DTypeGlobal(f"torch.{n}") for n in DTYPE_ITEMSIZE}


class Allowlisted:
    """What both unpicklers resolve alike: globals through the allowlist (``self._allowed``), persistent ids
    refused (unless a configuration reads them)."""

    _allowed: dict[tuple[str, str], Any]

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            return self.unknown_global(module, name)

    def unknown_global(self, module: str, name: str) -> Any:
        """A global outside the allowlist: refused (a configuration may resolve it to an inert placeholder)."""
        raise UnsafeGlobal(f"{module}.{name}"[:300])

    def persistent_load(self, pid: Any) -> Any:
        raise BadPickle("the pickle uses a persistent id")


class FastUnpickler(Allowlisted, pickle.Unpickler):
    """The C unpickler through an allowlist; only for pickles a pass over the bytes has admitted."""

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed


class ReferenceUnpickler(Allowlisted, pickle._Unpickler):  # type: ignore[name-defined]
    """The pure-Python unpickler through an allowlist, with a dict memo (the C one zero-fills its memo array to any
    ``LONG_BINPUT`` index: a 10-byte pickle can touch gigabytes).

    Where it is more lenient than the C unpickler it follows the C one or refuses, so both read every admitted
    pickle alike. Configurations subclass it and set the class attributes; each gets its own dispatch table.
    """

    #: Opcodes the configuration never expects: refused with :attr:`refused_opcodes_reason`.
    refused_opcodes: ClassVar[tuple[bytes, ...]] = ()
    refused_opcodes_reason: ClassVar[str] = "an opcode this reader does not expect"
    #: A tuple subclass known to hold scalars only (counted, not walked, when hashed).
    flat_tuple: ClassVar[type | None] = None
    #: What messages call the pickle.
    what: ClassVar[str] = "the pickle"
    dispatch: ClassVar[dict[int, Any]]

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], budget: Budget) -> None:
        self._stream = io.BytesIO(data)
        self._size = len(data)
        super().__init__(self._stream)
        self._allowed = allowed
        self._budget = budget

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.dispatch = _dispatch(cls)

    def _hashable(self, value: Any) -> None:
        if isinstance(value, tuple) and type(value) is not self.flat_tuple:  # the rest hash in constant time
            self._budget.check_hashable(value, self.flat_tuple, self.what)

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        setstate = getattr(inst, "__setstate__", None)
        if setstate is not None:
            setstate(state)
            return
        # As the C unpickler: without __setstate__, a None state and an empty slot state are no-ops.
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        if state is not None:
            raise BadPickle("BUILD on a value that is not an allowlisted dataclass")
        if slots is not None:
            if not isinstance(slots, dict):
                raise BadPickle("slot state is not a dictionary")
            if slots:
                raise BadPickle("BUILD sets attributes of a value that is not an allowlisted dataclass")

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self._new("NEWOBJ", self.stack.pop(), args, {})

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self._new("NEWOBJ_EX", self.stack.pop(), args, kwargs)

    def _new(self, op: str, cls: Any, args: Any, kwargs: Any) -> None:
        if not isinstance(cls, type):
            raise BadPickle(f"{op} of a value that is not a class")
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise BadPickle(f"{op} arguments are not a tuple" + (" and a dict" if op == "NEWOBJ_EX" else ""))
        self.append(cls.__new__(cls, *args, **kwargs))

    def load_reduce(self) -> None:
        args = self.stack.pop()
        if not isinstance(args, tuple):
            raise BadPickle("REDUCE arguments are not a tuple")
        self.stack[-1] = self.stack[-1](*args)

    def load_appends(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if not items:
            return  # the C unpickler appends nothing, to anything
        extend = getattr(target, "extend", None)
        if extend is not None:
            extend(items)
        else:
            for item in items:
                target.append(item)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._hashable(key)
        self.stack[-1][key] = value

    def load_setitems(self) -> None:
        pairs = self._keyed(self.pop_mark(), "SETITEMS")
        target = self.stack[-1]
        for key, value in pairs:
            target[key] = value

    def load_dict(self) -> None:
        value = dict(self._keyed(self.pop_mark(), "DICT"))  # before self.append: pop_mark rebinds it
        self.append(value)

    def load_additems(self) -> None:
        items = self._hashables(self.pop_mark())
        target = self.stack[-1]
        if not items:
            return  # as the C unpickler
        if isinstance(target, set):
            target.update(items)
        else:
            add = target.add
            for item in items:
                add(item)

    def load_frozenset(self) -> None:
        value = frozenset(self._hashables(self.pop_mark()))
        self.append(value)

    def load_frame(self) -> None:
        # The Python unpickler accepts a frame that claims more bytes than remain; the C one does not.
        size = int.from_bytes(self.read(8), "little")
        if size > self._size - self._stream.tell():
            raise BadPickle("pickle data was truncated (a frame runs past the end)")
        self._unframer.load_frame(size)

    def _memo_put(self, index: int) -> None:
        # A pickler numbers memo entries in order; the C unpickler allocates (and zero-fills) index * 2 slots.
        if index < 0 or index > len(self.memo) + self._budget.limits.memo_slack:
            raise BadPickle(f"memo index {index} is beyond the {len(self.memo)} objects memoized so far")
        self.memo[index] = self.stack[-1]

    def load_put(self) -> None:
        self._memo_put(int(self.readline()[:-1]))

    def load_binput(self) -> None:
        self._memo_put(self.read(1)[0])

    def load_long_binput(self) -> None:
        self._memo_put(int.from_bytes(self.read(4), "little"))

    def _refuse_opcode(self) -> None:
        raise BadPickle(self.refused_opcodes_reason)

    def _keyed(self, items: list[Any], what: str) -> zip[tuple[Any, Any]]:
        """``items`` as (key, value) pairs, each key refused before it is hashed if its hash would be unbounded."""
        if len(items) % 2:
            raise BadPickle(f"odd number of items for {what}")
        return zip(self._hashables(items[::2]), items[1::2], strict=True)

    def _hashables(self, items: list[Any]) -> list[Any]:
        hashable = self._hashable
        for item in items:
            hashable(item)
        return items


def _dispatch(cls: type[ReferenceUnpickler]) -> dict[int, Any]:
    """The dispatch table of a configuration: pickle's, each opcode read by ``cls``'s method of the name pickle's
    has (so its overrides), and the configuration's refused opcodes."""
    table = {op: getattr(cls, fn.__name__) for op, fn in pickle._Unpickler.dispatch.items()}  # type: ignore[attr-defined]
    for op in cls.refused_opcodes:
        table[op[0]] = cls._refuse_opcode
    return table


ReferenceUnpickler.dispatch = _dispatch(ReferenceUnpickler)
