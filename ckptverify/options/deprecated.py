"""Keywords renamed in this release keep working for one more, with a warning that names what replaces them."""

from __future__ import annotations

import warnings
from typing import Any

from ckptverify.errors import CkptVerifyDeprecationWarning

__all__ = ["no_other_keywords", "renamed", "take_renamed"]


def renamed(where: str, old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``where`` was called with the keyword ``old``, which ``new`` replaces.

    A :class:`~ckptverify.errors.CkptVerifyDeprecationWarning` (a ``DeprecationWarning``), pointing at the caller of
    the function that calls this one with the default ``stacklevel``."""
    warnings.warn(f"{where}: {old}= is deprecated and will be removed in the next release; use {new} instead",
                  CkptVerifyDeprecationWarning, stacklevel=stacklevel)


def take_renamed(where: str, kwargs: dict[str, Any], names: dict[str, str], *,
                 stacklevel: int = 4) -> dict[str, Any]:
    """Take the renamed keywords out of ``kwargs`` (a function's ``**kwargs``), warning for each one given.

    ``names`` maps each old keyword to the text that names its replacement. Returns ``{old: value}`` for those
    given; ``kwargs`` is left with the rest."""
    taken = {old: kwargs.pop(old) for old in list(kwargs) if old in names}
    for old in taken:
        renamed(where, old, names[old], stacklevel=stacklevel)
    return taken


def no_other_keywords(where: str, kwargs: dict[str, Any]) -> None:
    """Refuse what is left in a function's ``**kwargs`` (kept there for renamed keywords only) as Python refuses
    an unknown keyword: a ``TypeError`` naming it."""
    if kwargs:
        raise TypeError(f"{where} got an unexpected keyword argument {sorted(kwargs)[0]!r}")
