"""Reading JSON from untrusted bytes: bounded size and depth, finite numbers, unique keys, exact integers.

:func:`loads` refuses ``NaN``/infinities/overflowing numbers (they raise ``OverflowError`` when made integers),
nesting past ``max_depth`` (so callers may recurse), repeated keys (the last would silently win) and documents
over ``max_bytes``, all as :class:`JSONError` (a ``ValueError``). :func:`exact_int` takes only a true ``int``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ckptverify.errors import JSONError

__all__ = ["MAX_DEPTH", "exact_int", "loads"]

#: Deepest nesting of arrays and objects accepted (every JSON file the tool reads nests a few levels).
MAX_DEPTH = 64
#: Largest JSON document read by default.
MAX_BYTES = 64 << 20


def _refuse_constant(name: str) -> Any:
    raise JSONError(f"{name} is not a JSON number this tool accepts")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONError(f"the number {text[:40]} does not fit in a float")
    return value


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONError(f"the key {key[:80]!r} appears twice in one object")
            seen.add(key)
    return out


def loads(data: bytes | str, *, max_bytes: int = MAX_BYTES,
          max_depth: int = MAX_DEPTH, nonfinite: bool = False) -> Any:
    """Parse ``data`` (UTF-8/16/32 bytes, or text); raise :class:`JSONError` for anything refused. ``nonfinite``:
    accept ``NaN``/infinities (a framework's side file); callers must not make them integers."""
    if len(data) > max_bytes:
        raise JSONError(f"the JSON is {len(data)} bytes, more than the {max_bytes} this tool reads")
    try:
        if nonfinite:
            value = json.loads(data, object_pairs_hook=_unique)
        else:
            value = json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float,
                               object_pairs_hook=_unique)
    except JSONError:
        raise
    except RecursionError:
        raise JSONError(f"the JSON nests deeper than {max_depth} levels") from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        raise JSONError(f"not valid JSON: {exc}"[:300]) from None
    _check_depth(value, max_depth)
    return value


def _check_depth(value: Any, max_depth: int) -> None:
    # Iterative: the point is to bound what a recursive walk of the value may meet.
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth >= max_depth:
            raise JSONError(f"the JSON nests deeper than {max_depth} levels")
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def exact_int(value: Any, what: str, *, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    """``value`` if an ``int`` (not ``bool``/``float``) in ``[lo, hi]``; else :class:`JSONError` naming ``what``."""
    if type(value) is not int:
        raise JSONError(f"{what} is {type(value).__name__} {_short(value)}, not an integer")
    if not lo <= value <= hi:
        raise JSONError(f"{what} is {_short(value)}, outside [{lo}, {hi}]")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
