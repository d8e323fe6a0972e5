"""The result of verifying one saved checkpoint (:class:`Verification`), as the background verifier, the
verifier process and a save's ``on_verified`` callback see it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ckptverify.verifier.stamper import Outcome

__all__ = ["Verification", "from_outcome", "from_stamp"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Verification:
    """The result of verifying one saved checkpoint.

    ``verdict``: ``passed``, ``failed`` (both stamped beside the checkpoint unless ``stamped`` is false: then
    ``reason`` says why the stamp could not be written, and the verdict stands all the same), or ``unverified``
    (no verdict: ``reason`` says why; nothing stamped). ``summary``: findings per severity. ``first_error``: the
    first error as ``check: message``. ``bytes_checked``: bytes of the checkpoint's files read and checked.
    ``throttled_s``: of ``seconds``, those a background verification spent waiting for an idle core
    (:mod:`~ckptverify.verifier.throttle`).
    """

    path: str
    step: int | None
    verdict: str
    summary: dict[str, int] = field(default_factory=dict)
    first_error: str | None = None
    seconds: float = 0.0
    bytes_checked: int = 0
    deep: bool = False
    stamped: bool = False
    reason: str | None = None
    throttled_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verification:
        return cls(**data)

    def describe(self) -> str:
        """One line for people: what was verified and the verdict."""
        where = f"{self.path}" + (f" (step {self.step})" if self.step is not None else "")
        if self.verdict == "passed":
            return f"{where} passed verification ({self.bytes_checked} bytes checked in {self.seconds:.2f} s)"
        if self.verdict == "failed":
            return (f"{where} failed verification after it was saved: {self.summary.get('error', 0)} error(s); "
                    f"first: {self.first_error}" + ("" if self.stamped else f" ({self.reason})"))
        return f"{where} was not verified: {self.reason}"


def from_outcome(path: str, step: int | None, deep: bool, outcome: Outcome) -> Verification:
    """The :class:`Verification` of a :func:`~ckptverify.verifier.stamper.verify_and_stamp` outcome."""
    report = outcome.report
    if report is None:
        return Verification(path=path, step=step, verdict="unverified", deep=deep,
                            reason=outcome.reason or outcome.event)
    first = report.errors[0] if report.errors else None
    return Verification(
        path=path, step=step, verdict="passed" if report.passed else "failed", summary=report.summary(),
        first_error=None if first is None else f"{first.check}: {first.message}",
        seconds=round(outcome.seconds, 6), bytes_checked=int(report.stats.get("bytes") or 0),
        deep=bool(report.stats.get("deep")), stamped=outcome.stamped, reason=outcome.reason,
        throttled_s=outcome.throttled_s)


def from_stamp(path: str, step: int | None, data: dict[str, Any]) -> Verification:
    """The :class:`Verification` a current stamp records (someone else verified the checkpoint)."""
    errors = data.get("errors") or []
    first = errors[0] if errors and isinstance(errors[0], dict) else None
    return Verification(
        path=path, step=step, verdict="passed" if data.get("passed") else "failed",
        summary=dict(data.get("summary") or {}),
        first_error=None if first is None else f"{first.get('check')}: {first.get('message')}",
        seconds=float(data.get("seconds") or 0.0), bytes_checked=int(data.get("bytes_checked") or 0),
        deep=bool(data.get("deep")), stamped=True, throttled_s=_seconds(data.get("throttled_s")))


def _seconds(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
