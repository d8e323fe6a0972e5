"""The one vocabulary of verify options and failure policies, for every API that saves, loads or checks.

**When a checkpoint is verified** (:class:`VerifyOptions`, taken as ``verify=`` by :func:`ckptverify.save`,
:func:`ckptverify.async_save`, :func:`ckptverify.load`, :meth:`ckptverify.Run.main` and every framework
integration; a bare string is its ``when``): ``when`` is ``"inline"``, ``"background"`` or ``"off"``, ``deep``
also rebuilds every tensor, ``on_failure`` is the failure policy below. The default is ``VerifyOptions()``
(``"inline"``) wherever verifying is the point of the call (``load``, the integrations). Two defaults differ,
on purpose: ``save``/``async_save`` default to ``"off"`` (a plain save, as DCP's, already digests every byte it
writes; re-reading it is asked for), and ``Run.main`` to ``"background"`` (a production job must not stall on
its saves). ``"off"`` is refused where every checkpoint is verified (the integrations), ``"background"`` where
the call needs the verdict before it returns (``load``).

**What a failed check does** (:data:`FAILURE_POLICIES`, one value set for every check): ``"warn"`` (say it: a
warning, and an event or a finding; the job goes on) or ``"raise"`` (an error on every rank). Each check names
its own knob, because each fails differently and a job may want them apart:

- ``VerifyOptions.on_failure``: a saved checkpoint fails its verification (default ``"warn"``: the checkpoint
  is stamped failed, and no resume picks it). Not consulted by a load: a checkpoint that fails its
  verification is never loaded.
- ``on_replica_mismatch`` (``Run.main``, :class:`~ckptverify.hardware.replica.ReplicaCheck`): replicas that must
  be identical differ during training, a hardware symptom (default ``"warn"``).
- ``on_restore_mismatch`` (``load``): the state as restored differs from what was saved (default ``"raise"``,
  the state put back as it was; ``"warn"`` keeps it as loaded, for diagnosis).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ckptverify.errors import UsageError

__all__ = ["FAILURE_POLICIES", "WHEN", "VerifyOptions", "failure_policy", "verify_options"]

#: When a saved checkpoint is verified: not at all, in the background (the save returns at once), or before the
#: save returns.
WHEN = ("off", "background", "inline")
#: What a failed check does (see the module docstring): say it and go on, or raise (on every rank).
FAILURE_POLICIES = ("warn", "raise")

When = Literal["off", "background", "inline"]
OnFailure = Literal["warn", "raise"]


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise UsageError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def failure_policy(name: str, value: Any) -> str:
    """``value`` when it is one of :data:`FAILURE_POLICIES`, else a :class:`~ckptverify.errors.UsageError`
    naming ``name``."""
    _one_of(name, value, FAILURE_POLICIES)
    return value


@dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    """How each saved checkpoint is verified once its save has committed, and what a failure does.

    Validated when it is built: a bad value is a :class:`~ckptverify.errors.UsageError` naming the field.
    Where an API takes ``verify=``, a bare string is the ``when`` of a ``VerifyOptions`` with the other fields
    at their defaults (``verify="background"`` is ``verify=VerifyOptions(when="background")``).
    """

    #: ``"inline"`` (verified before the save returns), ``"background"`` (queued for the process's background
    #: verifier; the save returns at once) or ``"off"`` (not verified after the save: ``ckptverify watch`` or the
    #: next resume verifies it).
    when: When = "inline"
    #: Also rebuild every tensor and compare its logical fingerprint with the one taken at save time.
    deep: bool = False
    #: ``"warn"`` (a warning and an event; training goes on) or ``"raise"`` (also an error on every rank: from
    #: the save itself when ``"inline"``, from the next save (or the wait at the end) when ``"background"``).
    on_failure: OnFailure = "warn"

    def __post_init__(self) -> None:
        _one_of("VerifyOptions.when", self.when, WHEN)
        if not isinstance(self.deep, bool):
            raise UsageError(f"VerifyOptions.deep must be True or False, got {self.deep!r}")
        failure_policy("VerifyOptions.on_failure", self.on_failure)

    def to_dict(self) -> dict[str, Any]:
        return {"when": self.when, "deep": self.deep, "on_failure": self.on_failure}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VerifyOptions:
        return cls(when=data.get("when", "inline"), deep=bool(data.get("deep", False)),
                   on_failure=data.get("on_failure", "warn"))


def verify_options(where: str, verify: VerifyOptions | str, *, when: tuple[str, ...] = WHEN) -> VerifyOptions:
    """``verify=`` as a :class:`VerifyOptions`: ``verify`` is one, or a ``when`` string. ``when``: the values
    ``where`` (the function, named in messages) accepts. Raises :class:`~ckptverify.errors.UsageError` naming
    ``verify`` for anything else."""
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
