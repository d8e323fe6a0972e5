"""Whether a metadata pickle may be read by the C unpickler, decided in one fast pass over the bytes.

The pure-Python unpickler is the reference; the C one is faster but safe, and equal to it, only on a subset.
Anything outside goes to the reference, so this pass may refuse freely: it never decides a finding.

The subset (all ``FileSystemWriter`` and Megatron output): protocol 2-5 with ``PROTO`` first; a small opcode set
(no ``PUT``: the C memo zero-fills to the largest index; no text opcodes, ``POP``/``DUP``, persistent ids, sets,
out-of-band buffers, ``LONG4``); every length and frame inside the data, no nested ``FRAME``; and **tuples that
cannot grow** (``hash`` of a tuple recurses in C without limit and costs its whole expansion, and dict keys are
hashed): a tuple is either handed at once to ``REDUCE``/``NEWOBJ``/``BUILD`` (whose stand-ins refuse nested or
long tuples), or a *literal* of at most 64 single-opcode values, at most one an unknown memo entry and none a
literal. Literals are checked by following ``MEMOIZE`` counts per run.
"""

from __future__ import annotations

import re

__all__ = ["MAX_LITERAL", "in_fast_subset"]

#: Most values in a tuple literal (a path in DCP's ``planner_data`` has one per level of the state dict).
MAX_LITERAL = 64

_BYTE = rb"[\x00-\xff]"


def _counted(ops: bytes) -> bytes:
    """An opcode in ``ops`` followed by a one-byte length and that many bytes."""
    lengths = b"|".join(re.escape(bytes([n])) + _BYTE + b"{%d}" % n for n in range(256))
    return b"[" + re.escape(ops) + b"](?:" + lengths + b")"


#: Opcodes making a new object (may be memoized): EMPTY_TUPLE EMPTY_LIST EMPTY_DICT LIST DICT NEWOBJ REDUCE
#: STACK_GLOBAL NONE NEWTRUE NEWFALSE, and the pushes below.
_FRESH = rb")\]}ld\x81R\x93N\x88\x89"
#: No MEMOIZE may follow these (it would give an existing object a second, unseen memo entry): MARK BUILD
#: SETITEMS SETITEM APPEND APPENDS.
_KEEP = rb"(buase"
_PUSHES = (
    rb"K" + _BYTE,  # BININT1
    rb"M" + _BYTE + b"{2}",  # BININT2
    rb"J" + _BYTE + b"{4}",  # BININT
    _counted(b"\x8cC\x8a"),  # SHORT_BINUNICODE SHORT_BINBYTES LONG1
    rb"G" + _BYTE + b"{8}",  # BINFLOAT
)
_GET = (rb"h" + _BYTE, rb"j" + _BYTE + b"{4}")  # BINGET LONG_BINGET
#: A run of opcodes that needs no look beyond its own bytes: every opcode of the subset but a tuple (and
#: FRAME, STOP, the long strings), a tuple only together with the opcode consuming it, MEMOIZE only after an
#: opcode that makes a new object.
#: One entry of a dict whose values are 1-tuples of their own key, a memo entry (DCP's ``planner_data`` of
#: a flat state dict: ``{fqn: (fqn,)}``).
_FLAT_ITEM = rb"h([\x00-\xff])h\1\x85\x94|j([\x00-\xff]{4})j\2\x85\x94"
_FLAT_ITEMS = re.compile(_FLAT_ITEM)
#: A MARK and :data:`_FLAT_ITEM` entries, one batch (split by a frame: entry by entry).
_FLAT = re.compile(rb"\((?:" + _FLAT_ITEM + rb")+")
_RUN = re.compile(b"(?:" + b"|".join((
    b"[" + _FRESH + b"]\x94?",
    rb"\((?!h(?P<a>[\x00-\xff])h(?P=a)\x85\x94|j(?P<b>[\x00-\xff]{4})j(?P=b)\x85\x94)",  # MARK, unless of a batch
    b"[" + _KEEP[1:] + b"]",
    *_GET,
    rb"[\x85\x86\x87t]\x94?(?:[R\x81]\x94?|b|\x85\x94?R\x94?)",
    *(p + rb"\x94?" for p in _PUSHES),
)) + b")*+")
#: One opcode of a run.
_OP = re.compile(b"|".join((b"[" + _FRESH + _KEEP + rb"\x85\x86\x87t\x94]", *_GET, *_PUSHES)))
#: Counts the MEMOIZE opcodes of a run (one empty match each).
_MEMOIZES = re.compile(b"(?:" + b"|".join((b"[" + _FRESH + _KEEP + rb"\x85\x86\x87t]", *_GET, *_PUSHES))
                       + b")*+\x94()")

_TUPLES = frozenset(b"\x85\x86\x87t")
_ARITY = {0x85: 1, 0x86: 2, 0x87: 3}
_CALLS = frozenset(b"R\x81")
#: Opcodes that push one plain value (not a container, not a memo entry).
_SCALARS = frozenset(b"KMJN\x88\x89\x8cC\x8aG")
_GETS = frozenset(b"hj")
#: Opcodes with a 4- or 8-byte length, read outside the regular expressions: opcode -> size of the length.
_LONG = {ord("X"): 4, ord("B"): 4, 0x8D: 8, 0x8E: 8}
_MEMOIZE, _MARK, _TUPLE1, _REDUCE, _BUILD, _FRAME, _STOP = 0x94, ord("("), 0x85, ord("R"), ord("b"), 0x95, ord(".")
#: Longest run re-read opcode by opcode for a literal's values (beyond: left to the reference).
_MAX_RESCAN = 1 << 20

# What the pass expects next: any token; a tuple's consumer (after the tuple, after its MEMOIZE); the
# REDUCE of a tuple wrapped in a 1-tuple (after that 1-tuple, after its MEMOIZE); any token or a MEMOIZE
# (after a call or a class consumed a tuple).
_ANY, _TUPLE, _TUPLE_MEMO, _WRAPPED, _WRAPPED_MEMO, _CALLED = range(6)


def in_fast_subset(data: bytes) -> bool:
    """True if the C unpickler reads ``data`` exactly as the reference does (given the metadata stand-ins), without
    unbounded allocation, recursion or hashing. Linear in ``len(data)``."""
    if len(data) < 3 or data[0] != 0x80 or not 2 <= data[1] <= 5:
        return False
    return _Pass(data).run()


class _Pass:
    def __init__(self, data: bytes) -> None:
        self.data = data
        #: MEMOIZE opcodes counted so far, and runs (start, end) whose MEMOIZEs are still to be counted.
        self.memos = 0
        self.uncounted: list[tuple[int, int]] = []
        #: Memo entries holding a tuple literal, and entries known to hold a plain value.
        self.literal_memos: set[int] = set()
        self.plain_memos: set[int] = set()

    def run(self) -> bool:
        data, n = self.data, len(self.data)
        pos, end, framed, state = 2, n, False, _ANY
        literal = False  # the pending tuple may stand as a literal (if no consumer follows)
        pending_memo = -1  # the memo index that tuple got (when a MEMOIZE followed it)
        while True:
            if framed and pos == end:
                framed, end = False, n
            if state == _ANY and pos < end:
                start = pos
                pos = _RUN.match(data, pos, end).end()  # type: ignore[union-attr]
                if pos > start:
                    self.uncounted.append((start, pos))
                if framed and pos == end:
                    continue
            if pos >= end:
                return False  # the pickle ends without STOP, or an opcode runs past its frame
            op = data[pos]
            if op == _FRAME:
                if framed or pos + 9 > n:
                    return False
                size = int.from_bytes(data[pos + 1:pos + 9], "little")
                if size > n - pos - 9:
                    return False
                pos += 9
                framed, end = True, pos + size
                continue
            if state == _ANY:
                if op == _STOP:
                    return True
                if op == _MARK:
                    batch = _FLAT.match(data, pos, end)
                    if batch is None or not self.flat_literals(pos + 1, batch.end()):
                        return False
                    pos = batch.end()
                    continue
                if op in _TUPLES:
                    literal = self.literal_values(pos, op)
                    state = _TUPLE
                    pos += 1
                    continue
                width = _LONG.get(op)
                if width is None or pos + 1 + width > end:
                    return False
                pos += 1 + width + int.from_bytes(data[pos + 1:pos + 1 + width], "little")
                if pos > end:
                    return False
                continue
            # After a tuple, outside the regular expression (a literal, or a tuple and its consumer split
            # by a frame boundary): one opcode at a time.
            if op == _MEMOIZE and state in (_TUPLE, _WRAPPED):
                if state == _TUPLE:
                    self.flush()
                    pending_memo = self.memos
                self.memos += 1
                state += 1
            elif op == _BUILD and state in (_TUPLE, _TUPLE_MEMO):
                state = _ANY
            elif op in _CALLS and state in (_TUPLE, _TUPLE_MEMO):
                state = _CALLED
            elif op == _TUPLE1 and state in (_TUPLE, _TUPLE_MEMO):
                state = _WRAPPED
            elif op == _REDUCE and state in (_WRAPPED, _WRAPPED_MEMO):
                state = _CALLED
            elif op == _MEMOIZE and state == _CALLED:
                self.memos += 1
                state = _ANY
            elif state == _CALLED or (state in (_TUPLE, _TUPLE_MEMO) and literal):
                if state == _TUPLE_MEMO:
                    self.literal_memos.add(pending_memo)
                state = _ANY  # read what follows as any other opcode
                continue
            else:
                return False
            pos += 1

    def flush(self) -> None:
        """Count the MEMOIZEs of the runs not counted yet."""
        for start, stop in self.uncounted:
            self.memos += len(_MEMOIZES.findall(self.data, start, stop))
        self.uncounted.clear()

    def flat_literals(self, start: int, stop: int) -> bool:
        """Entries ``key: (key,)`` in ``[start, stop)``: each 1-tuple a literal of one earlier non-literal memo entry.
        """
        self.flush()
        first = self.memos
        literals = self.literal_memos
        items = _FLAT_ITEMS.findall(self.data, start, stop)
        for short, long in items:
            index = short[0] if short else int.from_bytes(long, "little")
            if index >= first or index in literals:
                return False
        self.memos += len(items)
        literals.update(range(first, self.memos))
        return True

    def literal_values(self, stop: int, op: int) -> bool:
        """Whether the tuple opcode at ``stop`` makes a literal (see the module docstring)."""
        runs = self.uncounted
        last = runs[-1] if runs and runs[-1][1] == stop else (stop, stop)
        if stop - last[0] > _MAX_RESCAN:
            self.flush()
            return False
        if last[1] > last[0]:
            runs.pop()
        self.flush()
        start = last[0]
        memos = self.memos
        values: list[tuple[int, int]] = []  # (opcode, memo index or -1) of the values since the last MARK
        marked = False
        previous = -1
        data = self.data
        for m in _OP.finditer(data, start, stop):
            code = data[m.start()]
            if code == _MEMOIZE:
                if previous in _SCALARS:
                    self.plain_memos.add(memos)
                memos += 1
            elif code == _MARK:
                values, marked = [], True
            elif code in _GETS:
                values.append((code, int.from_bytes(data[m.start() + 1:m.end()], "little")))
            else:
                values.append((code, -1))
            previous = code
        self.memos = memos
        arity = _ARITY.get(op)
        if arity is None:
            if not marked:
                return False
        elif len(values) < arity:
            return False
        else:
            values = values[-arity:]
        if len(values) > MAX_LITERAL:
            return False
        unknown = 0
        for code, index in values:
            if code in _SCALARS:
                continue
            if code not in _GETS or index in self.literal_memos:
                return False
            if index not in self.plain_memos:
                unknown += 1
        return unknown <= 1

