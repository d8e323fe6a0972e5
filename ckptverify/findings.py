"""The one vocabulary every check speaks: findings, and the report that collects them.

A :class:`Finding` says what was checked (``check``), where (:class:`Location`), what was expected,
what was found, and how bad it is (:class:`Severity`). Checks return findings; front ends (rich text,
JSON) only render them. A :class:`Report` gathers the findings of one command together with the list of
checks that ran and how much each covered, so "passed" always says what was actually examined.

The JSON form (``Report.to_dict``) is a stable, versioned schema documented in ``docs/json-schema.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Version of the JSON report schema. Bump on any incompatible change and document it.
REPORT_SCHEMA = "ckptverify/report"
REPORT_SCHEMA_VERSION = 1


class Severity(enum.StrEnum):
    """How bad a finding is. ``ERROR`` fails the command (exit 1); the others never do."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return {"error": 2, "warning": 1, "info": 0}[self.value]


@dataclass(frozen=True, slots=True, kw_only=True)
class Location:
    """Where a finding applies. Every field is optional; set those that narrow the place down.

    Byte and element ranges are half-open ``[start, end)``. ``byte_range`` is relative to the start of
    ``file`` (not of the item). ``element_range`` counts elements of the chunk in row-major order;
    ``global_index_first``/``global_index_last`` give the coordinates of the first and last affected
    element in the global tensor.
    """

    file: str | None = None
    byte_range: tuple[int, int] | None = None
    fqn: str | None = None
    chunk_offsets: tuple[int, ...] | None = None
    chunk_sizes: tuple[int, ...] | None = None
    record: str | None = None
    element_range: tuple[int, int] | None = None
    global_index_first: tuple[int, ...] | None = None
    global_index_last: tuple[int, ...] | None = None
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__slots__:  # type: ignore[attr-defined]
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Location:
        kwargs: dict[str, Any] = {}
        for name in cls.__slots__:  # type: ignore[attr-defined]
            if name in data and data[name] is not None:
                value = data[name]
                kwargs[name] = tuple(value) if isinstance(value, list) else value
        return cls(**kwargs)

    def describe(self) -> str:
        """One short human line, most specific parts first."""
        parts: list[str] = []
        if self.fqn is not None:
            fqn = self.fqn
            if self.chunk_offsets is not None:
                fqn += f" chunk@{list(self.chunk_offsets)}"
            parts.append(fqn)
        if self.element_range is not None:
            start, end = self.element_range
            parts.append(f"elements [{start}, {end})")
        if self.global_index_first is not None:
            text = f"global {list(self.global_index_first)}"
            if self.global_index_last is not None and self.global_index_last != self.global_index_first:
                text += f"..{list(self.global_index_last)}"
            parts.append(text)
        if self.record is not None:
            parts.append(f"record {self.record}")
        if self.file is not None:
            text = self.file
            if self.byte_range is not None:
                text += f" bytes [{self.byte_range[0]}, {self.byte_range[1]})"
            parts.append(text)
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        return " · ".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One conclusion of one check.

    ``check`` is a stable, documented identifier (e.g. ``zip-crc``); ``message`` is for people.
    ``expected``/``actual`` hold JSON-serialisable values when the check compared something.
    """

    check: str
    severity: Severity
    message: str
    location: Location = field(default_factory=Location)
    expected: Any = None
    actual: Any = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "check": self.check,
            "severity": self.severity.value,
            "message": self.message,
            "location": self.location.to_dict(),
        }
        if self.expected is not None:
            out["expected"] = self.expected
        if self.actual is not None:
            out["actual"] = self.actual
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(
            check=data["check"],
            severity=Severity(data["severity"]),
            message=data["message"],
            location=Location.from_dict(data.get("location", {})),
            expected=data.get("expected"),
            actual=data.get("actual"),
        )


def error(check: str, message: str, **kw: Any) -> Finding:
    return Finding(check=check, severity=Severity.ERROR, message=message, **kw)


def warning(check: str, message: str, **kw: Any) -> Finding:
    return Finding(check=check, severity=Severity.WARNING, message=message, **kw)


def info(check: str, message: str, **kw: Any) -> Finding:
    return Finding(check=check, severity=Severity.INFO, message=message, **kw)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckCoverage:
    """What one check examined: ``count`` objects of kind ``unit`` (e.g. 412 "zip records")."""

    check: str
    count: int
    unit: str

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "count": self.count, "unit": self.unit}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckCoverage:
        return cls(check=data["check"], count=int(data["count"]), unit=data["unit"])


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """The outcome of one command: findings plus what was covered.

    ``exit_code`` follows the project-wide rule: 0 when no finding is an error, 1 otherwise.
    (2, "could not run", is raised as :class:`~ckptverify.errors.CkptVerifyError` instead.)
    """

    command: str
    target: str
    findings: tuple[Finding, ...]
    coverage: tuple[CheckCoverage, ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.WARNING]

    @property
    def passed(self) -> bool:
        return not self.errors

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def summary(self) -> dict[str, int]:
        """Findings per severity, counting those a capped report left out (see ``omitted_by_severity``)."""
        counts = {s.value: 0 for s in Severity}
        for f in self.findings:
            omitted = f.actual.get("omitted_by_severity") if isinstance(f.actual, dict) else None
            if isinstance(omitted, dict):
                for severity, n in omitted.items():
                    counts[severity] = counts.get(severity, 0) + int(n)
            else:
                counts[f.severity.value] += 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        from ckptverify._version import __version__

        return {
            "schema": REPORT_SCHEMA,
            "schema_version": REPORT_SCHEMA_VERSION,
            "tool": {"name": "ckptverify", "version": __version__},
            "command": self.command,
            "target": self.target,
            "passed": self.passed,
            "exit_code": self.exit_code,
            "summary": self.summary(),
            "coverage": [c.to_dict() for c in self.coverage],
            "findings": [f.to_dict() for f in sort_findings(self.findings)],
            "stats": dict(self.stats),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """The report :meth:`to_dict` gave (``passed``, ``exit_code`` and ``summary`` follow from the findings)."""
        return cls(command=data["command"], target=data["target"],
                   findings=tuple(Finding.from_dict(f) for f in data.get("findings", ())),
                   coverage=tuple(CheckCoverage.from_dict(c) for c in data.get("coverage", ())),
                   stats=dict(data.get("stats") or {}))


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Most severe first; within a severity keep the order the checks produced (stable sort)."""
    return sorted(findings, key=lambda f: -f.severity.rank)


def merge_coverage(parts: Sequence[CheckCoverage]) -> tuple[CheckCoverage, ...]:
    """Add up coverage entries that share a check name and unit, keeping first-seen order."""
    totals: dict[tuple[str, str], int] = {}
    for c in parts:
        totals[(c.check, c.unit)] = totals.get((c.check, c.unit), 0) + c.count
    return tuple(CheckCoverage(check=k[0], count=v, unit=k[1]) for k, v in totals.items())


def merge_reports(command: str, target: str, reports: Sequence[Report],
                  first: Sequence[Finding] = ()) -> Report:
    """One report of a check shared out in parts, each over its own files (the first part also checked the whole
    checkpoint): ``first``, then every part's findings once each (a finding of the whole checkpoint can come
    from more than one part), coverage added up, and the first part's stats with ``bytes`` and ``files`` summed
    over the parts."""
    import json

    findings: list[Finding] = list(first)
    seen: set[str] = set()
    for report in reports:
        for f in report.findings:
            key = json.dumps(f.to_dict(), sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                findings.append(f)
    stats = dict(reports[0].stats) if reports else {}
    stats["bytes"] = sum(int(r.stats.get("bytes") or 0) for r in reports)
    stats["files"] = sum(int(r.stats.get("files") or 0) for r in reports)
    return Report(command=command, target=target, findings=tuple(findings),
                  coverage=merge_coverage([c for r in reports for c in r.coverage]), stats=stats)
