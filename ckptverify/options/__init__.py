"""Options shared by every entry point that saves, loads or verifies: the one vocabulary of verify options and
failure policies.

:class:`VerifyOptions` is ``verify=`` of save, async_save, load, ``Run.main`` and the integrations (a bare string
is its ``when``). ``VerifyOptions()`` (``"inline"``) is the default where verifying is the point (``load``, the
integrations). Two defaults differ on purpose: ``save``/``async_save`` default to ``"off"`` (a save already digests
every byte it writes) and ``Run.main`` to ``"background"`` (a production job must not stall on saves). ``"off"`` is
refused by the integrations, ``"background"`` by ``load`` (it needs the verdict before returning).

Failure knobs, each ``"warn"`` or ``"raise"`` (:data:`FAILURE_POLICIES`, the one value set of every failure knob):
``VerifyOptions.on_failure`` (default warn: stamped failed, never resumed; a load never loads a failed checkpoint),
``on_replica_mismatch`` (``Run.main``, default warn) and ``on_restore_mismatch`` (``load``, default raise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ckptverify.errors import UsageError

__all__ = ["FAILURE_POLICIES", "WHEN", "VerifyOptions", "failure_policy", "verify_options"]

#: When a saved checkpoint is verified.
WHEN = ("off", "background", "inline")
#: What a failed check does (see the module docstring): say it and go on, or raise (on every rank).
FAILURE_POLICIES = ("warn", "raise")


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise UsageError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def failure_policy(name: str, value: Any) -> str:
    """``value`` if in :data:`FAILURE_POLICIES`, else :class:`~ckptverify.errors.UsageError` naming ``name``."""
    _one_of(name, value, FAILURE_POLICIES)
    return value


@dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    """How each saved checkpoint is verified once its save has committed, and what a failure does.

    Validated on construction (a bad value is a :class:`~ckptverify.errors.UsageError` naming the field). Where an
    API takes ``verify=``, a bare string means ``VerifyOptions(when=that)``.
    """

    #: ``"inline"`` (before the save returns), ``"background"`` (queued; the save returns at once) or ``"off"``
    #: (left to ``ckptverify watch`` or the next resume).
    when: Literal["off", "background", "inline"] = "inline"
    #: Also rebuild every tensor and compare its logical fingerprint with the one taken at save time.
    deep: bool = False
    #: ``"warn"`` (warning and event) or ``"raise"`` (error on every rank: from the save when ``"inline"``, from
    #: the next save or the final wait when ``"background"``).
    on_failure: Literal["warn", "raise"] = "warn"

    def __post_init__(self) -> None:
        _one_of("VerifyOptions.when", self.when, WHEN)
        if not isinstance(self.deep, bool):
            raise UsageError(f"VerifyOptions.deep must be True or False, got {self.deep!r}")
        failure_policy("VerifyOptions.on_failure", self.on_failure)


def verify_options(where: str, verify: VerifyOptions | str, *, when: tuple[str, ...] = WHEN) -> VerifyOptions:
    """``verify`` (a :class:`VerifyOptions` or a ``when`` string) as a :class:`VerifyOptions`; ``when``: the values
    ``where`` accepts. Raises :class:`~ckptverify.errors.UsageError` otherwise.
    """
    if isinstance(verify, str):
        _one_of(f"{where}: verify", verify, WHEN)
        options = VerifyOptions(when=verify)  # type: ignore[arg-type]
    elif isinstance(verify, VerifyOptions):
        options = verify
    else:
        raise UsageError(f"{where}: verify must be a VerifyOptions or one of {', '.join(map(repr, WHEN))}, "
                         f"got {type(verify).__name__} {verify!r}")
    if options.when not in when:
        raise UsageError(f"{where}: verify.when must be one of {', '.join(map(repr, when))}, got {options.when!r}")
    return options
