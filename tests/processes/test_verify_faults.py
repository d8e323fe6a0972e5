"""The fault matrix: every checkpoint layout x every fault, against ``ckptverify verify``.

Each clean checkpoint must pass (library, command line, JSON, and after being moved elsewhere); each
injected fault must fail with the expected check and point at the place that was damaged. Combinations
that cannot apply are skipped with the reason in the test id.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import ckpt_factory
from helpers import faults as inj
from helpers.preloaded_children import PreloadedServer

from ckptverify.audit.verify import verify_checkpoint
from ckptverify.cli import main as cli_main
from ckptverify.findings import Finding, Report

LAYOUTS = ckpt_factory.LAYOUTS
ZIP_LAYOUTS = frozenset(ckpt_factory.ZIP_LAYOUTS)

LOCATION_KEYS = {
    "file", "byte_range", "fqn", "chunk_offsets", "chunk_sizes", "record", "element_range",
    "global_index_first", "global_index_last", "rank",
}


# --------------------------------------------------------------------------------------------------------
# helpers


def describe(report: Report) -> str:
    lines = [f"exit {report.exit_code}, {len(report.findings)} finding(s):"]
    for f in report.findings:
        lines.append(f"  {f.severity.value:7} {f.check:22} {f.location.describe()} :: {f.message}")
    return "\n".join(lines)


def cli(*args: str) -> Any:
    return CliRunner().invoke(cli_main, ["verify", *args], catch_exceptions=False)


def matching(report: Report, checks: Iterable[str], severity: str = "error",
             where: Callable[[Finding], bool] = lambda f: True) -> list[Finding]:
    checks = set(checks)
    return [f for f in report.findings if f.check in checks and f.severity.value == severity and where(f)]


def contains(rng: tuple[int, int] | None, value: int) -> bool:
    return rng is not None and rng[0] <= value < rng[1]


def overlaps(a: tuple[int, int] | None, b: tuple[int, int]) -> bool:
    return a is not None and a[0] < b[1] and b[0] < a[1]


def global_index(item: inj.Item, element: int) -> tuple[int, ...]:
    sizes = item.chunk_sizes or ()
    coords: list[int] = []
    rest = element
    for size in reversed(sizes):
        coords.append(rest % size)
        rest //= size
    offsets = item.chunk_offsets or ()
    return tuple(o + c for o, c in zip(offsets, reversed(coords), strict=True))


def assert_report_schema(data: dict[str, Any]) -> None:
    """The JSON report has the documented shape."""
    for key in ("schema", "schema_version", "command", "target", "passed", "exit_code", "summary", "coverage",
                "findings", "stats"):
        assert key in data, f"JSON report lacks {key!r}"
    assert data["schema"] == "ckptverify/report"
    assert data["schema_version"] == 1
    assert data["command"] == "verify"
    assert isinstance(data["passed"], bool)
    assert data["exit_code"] in (0, 1)
    assert data["passed"] == (data["exit_code"] == 0)
    assert set(data["summary"]) == {"error", "warning", "info"}
    assert all(isinstance(v, int) for v in data["summary"].values())
    assert isinstance(data["stats"], dict)
    for cov in data["coverage"]:
        assert set(cov) == {"check", "count", "unit"}
        assert isinstance(cov["check"], str) and isinstance(cov["count"], int) and isinstance(cov["unit"], str)
    counts = {"error": 0, "warning": 0, "info": 0}
    for f in data["findings"]:
        assert {"check", "severity", "message", "location"} <= set(f)
        assert set(f) <= {"check", "severity", "message", "location", "expected", "actual"}
        assert f["severity"] in counts
        counts[f["severity"]] += 1
        assert isinstance(f["check"], str) and isinstance(f["message"], str)
        loc = f["location"]
        assert set(loc) <= LOCATION_KEYS, set(loc) - LOCATION_KEYS
        for key in ("byte_range", "element_range"):
            if key in loc:
                start, end = loc[key]
                assert isinstance(start, int) and isinstance(end, int) and 0 <= start <= end
    assert counts == data["summary"]
    assert data["passed"] == (counts["error"] == 0)


def run_both(path: Path) -> tuple[Report, dict[str, Any]]:
    """Verify through the library and through ``ckptverify verify --json``; the two must agree."""
    report = verify_checkpoint(path)
    result = cli(str(path), "--json", "--no-progress")
    data = json.loads(result.stdout)
    assert_report_schema(data)
    assert result.exit_code == report.exit_code == data["exit_code"]
    assert sorted(f["check"] for f in data["findings"]) == sorted(f.check for f in report.findings)
    return report, data


# --------------------------------------------------------------------------------------------------------
# the clean checkpoints are ordinary DCP checkpoints, and pass


@pytest.mark.parametrize("layout", ["single", "threads", "per_item", "fsdp2"])
def test_factory_checkpoints_load_with_dcp(layout: str, ckpt_store: Any) -> None:
    expected = ckpt_factory.single_process_state_dict()
    loaded = ckpt_factory.load_back(ckpt_store.source(layout))
    for key, tensor in expected["model"].items():
        assert torch.equal(loaded["model"][key], tensor), key
    for key, tensor in expected["extra"].items():
        assert loaded["extra"][key].dtype == tensor.dtype
        assert torch.equal(loaded["extra"][key], tensor), key
    assert loaded["step"] == 7 and loaded["blob"] == expected["blob"]
    assert loaded["config"] == expected["config"]


def test_factory_layouts_have_the_promised_files(ckpt_store: Any) -> None:
    names = {lay: sorted(os.listdir(ckpt_store.source(lay))) for lay in LAYOUTS if lay != "safetensors"}
    assert names["single"] == [".metadata", "__0_0.distcp"]
    assert len([n for n in names["threads"] if n.endswith(".distcp")]) == 3
    per_item = inj.items(ckpt_store.source("per_item"))
    assert len({it.file for it in per_item}) == len(per_item) > 30
    assert names["fsdp2"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert names["nocoll"] == ["__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp"]
    dtypes = {str(it.dtype) for it in inj.items(ckpt_store.source("single")) if it.kind == "tensor"}
    assert {"torch.float32", "torch.bfloat16", "torch.int64", "torch.bool"} <= dtypes
    big = max(inj.tensor_zip_items(ckpt_store.source("fsdp2")), key=lambda it: it.length)
    assert inj.payload_record(inj.zip_records(ckpt_store.source("fsdp2"), big)).data_len > 64 * 1024
    sharded = [it for it in inj.items(ckpt_store.source("fsdp2")) if it.fqn == "model.0.weight"]
    assert sorted(it.chunk_offsets for it in sharded) == [(0, 0), (192, 0)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clean_checkpoint_passes(layout: str, fresh_ckpt: Any, tmp_path: Path) -> None:
    path = fresh_ckpt(layout)
    report, data = run_both(path)
    assert report.exit_code == 0, describe(report)
    assert not report.errors
    assert data["passed"] is True and data["summary"]["error"] == 0
    warned = {f.check for f in report.warnings}
    if layout == "safetensors":
        assert "content-uncheckable" in warned, describe(report)
    assert warned <= {"content-uncheckable"}, describe(report)
    if layout in ZIP_LAYOUTS:
        crc = [c for c in report.coverage if c.check == "zip-crc"]
        assert crc and crc[0].count > len(inj.tensor_zip_items(path)), report.coverage

    moved = tmp_path / "moved" / "somewhere-else"
    moved.parent.mkdir()
    shutil.move(path, moved)
    again = verify_checkpoint(moved)
    assert again.exit_code == 0, describe(again)


def test_cli_process_exit_codes(fresh_ckpt: Any, tmp_path: Path) -> None:
    """A real process: 0 clean, 1 corrupt, 2 missing path or bad arguments."""
    path = fresh_ckpt("single")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ckptverify", "verify", *args],
                              capture_output=True, text=True, timeout=120)

    clean = run(str(path), "--json", "--no-progress")
    assert clean.returncode == 0, clean.stderr
    assert_report_schema(json.loads(clean.stdout))
    fault = inj.flip_in_tensor_payload(path)
    bad = run(str(path), "--json", "--no-progress", "--jobs", "2")
    assert bad.returncode == 1, bad.stderr
    data = json.loads(bad.stdout)
    assert_report_schema(data)
    hits = [f for f in data["findings"] if f["check"] == "zip-crc" and f["location"].get("fqn") == fault.fqn]
    assert hits, data["findings"]
    assert run(str(tmp_path / "nonexistent")).returncode == 2
    assert run(str(path), "--jobs", "0").returncode == 2


def test_cli_missing_path_exits_2(tmp_path: Path) -> None:
    result = cli("/nonexistent/ckptverify-test-path", "--no-progress")
    assert result.exit_code == 2
    result = cli(str(tmp_path / "nope"), "--json", "--no-progress")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["exit_code"] == 2


# --------------------------------------------------------------------------------------------------------
# the injectors change exactly what they say


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("layout", ["single", "fsdp2"])
@pytest.mark.parametrize("injector", [
    "flip_in_tensor_payload", "flip_in_bytes_item", "zip-local", "zip-central", "zip-eocd", "zip-eocd64",
    "zero_page",
])
def test_injector_changes_only_the_described_bytes(layout: str, injector: str, fresh_ckpt: Any) -> None:
    path = fresh_ckpt(layout)
    before = _snapshot(path)
    zip_field = injector.removeprefix("zip-")
    fault = inj.flip_in_zip_header(path, zip_field) if zip_field != injector else getattr(inj, injector)(path)
    after = _snapshot(path)
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {fault.file}
    old, new = before[fault.file], after[fault.file]
    assert len(old) == len(new)
    diff = [i for i in range(len(old)) if old[i] != new[i]]
    assert fault.byte_range is not None
    assert diff[0] >= fault.byte_range[0] and diff[-1] < fault.byte_range[1]
    if fault.bit is not None:
        assert diff == [fault.byte_offset]
        assert old[fault.byte_offset] ^ new[fault.byte_offset] == 1 << fault.bit
        inj.flip_bit(path, fault.file, fault.byte_offset, fault.bit)
        assert _snapshot(path) == before


def test_payload_flip_hits_the_named_element(fresh_ckpt: Any) -> None:
    """The flipped element, read back through plain torch, differs in exactly the described bit."""
    path = fresh_ckpt("single")
    before = ckpt_factory.load_back(path)["extra"]["i64"].clone()
    fault = inj.flip_in_tensor_payload(path, fqn="extra.i64", element=41, bit=5)
    after = ckpt_factory.load_back(path)["extra"]["i64"]  # DCP does not check the CRC: loads silently
    changed = (before != after).nonzero().flatten().tolist()
    assert changed == [41] and fault.element == 41
    assert int(before[41]) ^ int(after[41]) == 1 << 5


def test_a_report_comes_back_whole_from_its_json(fresh_ckpt: Any) -> None:
    """What a verifier process sends (``Report.to_dict`` as JSON) rebuilds the report it was made from."""
    path = fresh_ckpt("single")
    inj.flip_in_tensor_payload(path, fqn="extra.i64", element=41, bit=5)
    report = verify_checkpoint(path)
    assert not report.passed and report.coverage and report.stats["bytes"] > 0
    again = Report.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.to_dict() == report.to_dict()
    assert (again.passed, again.errors[0], again.summary()) == (report.passed, report.errors[0], report.summary())


# --------------------------------------------------------------------------------------------------------
# the fault matrix


@dataclass(frozen=True)
class Case:
    inject: Callable[[Path, Path], inj.Fault]
    check: Callable[[Report, inj.Fault, Path], None]
    skip: Callable[[str], str | None] = lambda layout: None


def _zip_only(layout: str) -> str | None:
    return None if layout in ZIP_LAYOUTS else "tensors-not-in-torch-save-zips"


def _expect(checks: Iterable[str], severity: str = "error", exit_code: int = 1,
            where: Callable[[Finding, inj.Fault], bool] = lambda f, fault: True,
            ) -> Callable[[Report, inj.Fault, Path], None]:
    checks = tuple(checks)

    def check(report: Report, fault: inj.Fault, path: Path) -> None:
        assert report.exit_code == exit_code, f"fault {fault.to_dict()}\n{describe(report)}"
        hits = matching(report, checks, severity, lambda f: where(f, fault))
        assert hits, f"no {severity} finding of {checks} at the fault {fault.to_dict()}\n{describe(report)}"

    return check


def _at_payload(f: Finding, fault: inj.Fault) -> bool:
    loc = f.location
    return (
        loc.fqn == fault.fqn
        and loc.chunk_offsets == fault.chunk_offsets
        and loc.file == fault.file
        and fault.byte_range is not None
        and overlaps(loc.byte_range, fault.byte_range)
        and (loc.record is None or loc.record == fault.record)
        and fault.element_range is not None
        and overlaps(loc.element_range, fault.element_range)
    )


def _payload_check(report: Report, fault: inj.Fault, path: Path) -> None:
    _expect(["zip-crc"], where=_at_payload)(report, fault, path)
    hit = matching(report, ["zip-crc"], where=lambda f: _at_payload(f, fault))[0]
    assert hit.location.record is not None and hit.location.record.endswith("data/0"), hit
    assert contains(hit.location.byte_range, fault.byte_offset), hit  # type: ignore[arg-type]
    if fault.element is not None:
        assert contains(hit.location.element_range, fault.element), hit
    item = next(it for it in inj.items(path) if it.fqn == fault.fqn and it.chunk_offsets == fault.chunk_offsets)
    if hit.location.global_index_first is not None and fault.element is not None:
        g = global_index(item, fault.element)
        assert hit.location.global_index_first <= g <= (hit.location.global_index_last or g), hit


def _at_file(f: Finding, fault: inj.Fault) -> bool:
    return f.location.file == fault.file


def _at_byte(f: Finding, fault: inj.Fault) -> bool:
    loc = f.location
    return (
        loc.file == fault.file
        and (loc.byte_range is None or contains(loc.byte_range, fault.byte_offset))  # type: ignore[arg-type]
        and (loc.fqn is None or loc.fqn == fault.fqn)
    )


def _in_item(f: Finding, fault: inj.Fault) -> bool:
    """In the damaged item. A cross-checked field (e.g. a CRC held both in the central directory and in
    the data descriptor) may be reported where the disagreement shows, not at the flipped copy."""
    loc = f.location
    start = fault.details["item_offset"]
    item = (start, start + fault.details["item_length"])
    inside = loc.byte_range is None or (item[0] <= loc.byte_range[0] and loc.byte_range[1] <= item[1])
    return loc.file == fault.file and (loc.fqn is None or loc.fqn == fault.fqn) and inside


def _at_fqn(f: Finding, fault: inj.Fault) -> bool:
    return f.location.fqn == fault.fqn


def _swap_skip(layout: str) -> str | None:
    if layout == "nocoll":
        return "equal-layout-files-swap-undetectable-without-manifest"
    if layout != "per_item":
        return "no-equal-size-distcp-files"
    return None


def _same_nbytes_pair(path: Path) -> tuple[str, str]:
    """Two one-tensor files of equal size and equal payload bytes, with different dtype and shape."""
    by_file: dict[str, list[inj.Item]] = {}
    for it in inj.items(path):
        by_file.setdefault(it.file, []).append(it)
    for a, b, differ in inj.same_size_pairs(path):
        ia, ib = by_file[a], by_file[b]
        if not differ or len(ia) != 1 or len(ib) != 1 or ia[0].kind != "tensor" or ib[0].kind != "tensor":
            continue
        na = inj.payload_record(inj.zip_records(path, ia[0])).data_len
        nb = inj.payload_record(inj.zip_records(path, ib[0])).data_len
        if na == nb and ia[0].dtype != ib[0].dtype:
            return a, b
    raise AssertionError("factory should produce two same-size, same-payload-size tensor files")


def _swap_check(report: Report, fault: inj.Fault, path: Path) -> None:
    assert fault.details["items_differ"]
    assert report.exit_code == 1, f"swap {fault.files} not detected\n{describe(report)}"
    assert any(f.location.file in (fault.files or ()) for f in report.errors), describe(report)


def _swap_same_nbytes_check(report: Report, fault: inj.Fault, path: Path) -> None:
    _swap_check(report, fault, path)
    hits = [f for f in report.errors if f.check == "tensor-record" and f.location.file in (fault.files or ())]
    assert hits, describe(report)


def _malicious(via: str, nested: bool = False) -> Case:
    def inject(path: Path, tmp: Path) -> inj.Fault:
        return inj.malicious_metadata(path, tmp / f"CANARY-{via}", via=via, nested=nested)

    def check(report: Report, fault: inj.Fault, path: Path) -> None:
        canary = Path(fault.details["canary"])
        assert not canary.exists(), "the metadata pickle was executed"
        assert report.exit_code == 1, describe(report)
        name = fault.details["global"]
        hits = [f for f in report.errors if f.check == "metadata-unsafe"
                and (f.actual == name or name in f.message) and f.location.file == fault.file]
        assert hits, f"expected metadata-unsafe naming {name}\n{describe(report)}"
        result = cli(str(path), "--json", "--no-progress")
        assert result.exit_code == 1 and not canary.exists()
        done = _command_line_processes().cli("verify", str(path), "--no-progress", timeout=120)
        assert not done.timed_out, "the command line did not finish"
        assert not canary.exists(), "the metadata pickle was executed by the command line"

    return Case(inject, check)


_servers: list[PreloadedServer] = []


def _command_line_processes() -> PreloadedServer:
    """Where the malicious-metadata cases run ``python -m ckptverify verify``: a child process forked from a server
    that imported the command line once (started on first use, ended with the module), not a fresh interpreter
    each (:mod:`helpers.preloaded_children`). ``test_cli_process_exit_codes`` keeps fresh interpreters."""
    if not _servers:
        _servers.append(PreloadedServer(("ckptverify.cli", "ckptverify.audit.verify")))
    return _servers[0]


@pytest.fixture(scope="module", autouse=True)
def _end_the_command_line_server() -> Iterator[None]:
    yield
    while _servers:
        _servers.pop().close()


def _md_edit(edit: Callable[[Any, Path], str], index: int = 0) -> Callable[[Path, Path], inj.Fault]:
    def inject(path: Path, tmp: Path) -> inj.Fault:
        fault = inj.edit_metadata(path, lambda md: edit(md, path), index=index)
        fault.fqn = fault.details["edit"].split(":", 1)[0]
        return fault

    return inject


def _drop_storage(md: Any, path: Path) -> str:
    index = max((i for i in md.storage_data if i.index is not None),
                key=lambda i: (md.storage_data[i].length, i.fqn))
    del md.storage_data[index]
    return f"{index.fqn}: storage entry removed"


def _overlap(md: Any, path: Path) -> str:
    keys = sorted((i for i in md.storage_data if i.index is None), key=lambda i: i.fqn)
    a, b = keys[0], keys[1]
    md.storage_data[b] = dataclasses.replace(md.storage_data[a])
    return f"{b.fqn}: now stored at the same bytes as {a.fqn}"


def _dtype(md: Any, path: Path) -> str:
    fqn = "model.0.weight"
    md.state_dict_metadata[fqn].properties.dtype = torch.int32
    return f"{fqn}: dtype float32 -> int32 in the metadata"


def _grow(md: Any, path: Path) -> str:
    fqn = "model.0.bias"
    meta = md.state_dict_metadata[fqn]
    meta.size = torch.Size([meta.size[0] + 1])
    return f"{fqn}: global size grown by one"


def _drop_chunk(md: Any, path: Path) -> str:
    fqn = "model.0.weight"
    meta = md.state_dict_metadata[fqn]
    gone = meta.chunks.pop()
    for index in [i for i in md.storage_data if i.fqn == fqn and tuple(i.offset) == tuple(gone.offsets)]:
        del md.storage_data[index]
    return f"{fqn}: chunk {list(gone.offsets)} removed"


def _truncate_metadata(path: Path, tmp: Path) -> inj.Fault:
    name = inj.metadata_files(path)[0].name
    return inj.truncate(path, name, (path / name).stat().st_size // 2)


def _delete_rank_metadata(path: Path, tmp: Path) -> inj.Fault:
    (path / "__1.metadata").unlink()
    return inj.Fault(kind="delete-rank-metadata", file="__1.metadata", fqn="model.0.weight")


CASES: dict[str, Case] = {
    "payload-flip": Case(lambda p, t: inj.flip_in_tensor_payload(p), _payload_check, _zip_only),
    "payload-flip-bf16": Case(lambda p, t: inj.flip_in_tensor_payload(p, "extra.bf16", element=100, bit=15),
                              _payload_check, _zip_only),
    "payload-flip-bool": Case(lambda p, t: inj.flip_in_tensor_payload(p, "extra.mask", element=32, bit=0),
                              _payload_check, _zip_only),
    "payload-flip-int64": Case(lambda p, t: inj.flip_in_tensor_payload(p, "extra.i64", element=0, bit=63),
                               _payload_check, _zip_only),
    "payload-flip-scalar": Case(
        lambda p, t: inj.flip_in_tensor_payload(p, "optim.state.0.weight.step", element=0, bit=0),
        _payload_check, _zip_only),
    "bytes-item-flip": Case(lambda p, t: inj.flip_in_bytes_item(p), _expect(["zip-crc"], where=_at_byte)),
    "zip-local": Case(lambda p, t: inj.flip_in_zip_header(p, "local"),
                      _expect(["zip-structure", "zip-crc"], where=_in_item)),
    "zip-central": Case(lambda p, t: inj.flip_in_zip_header(p, "central"),
                        _expect(["zip-structure", "zip-crc"], where=_in_item)),
    "zip-eocd": Case(lambda p, t: inj.flip_in_zip_header(p, "eocd"),
                     _expect(["zip-structure"], where=_in_item)),
    "zip-eocd64": Case(lambda p, t: inj.flip_in_zip_header(p, "eocd64"),
                       _expect(["zip-structure"], where=_in_item)),
    "truncate": Case(lambda p, t: inj.truncate(p), _expect(["item-bounds", "blob-structure"], where=_at_file)),
    "delete-file": Case(lambda p, t: inj.delete_file(p), _expect(["file-missing"], where=_at_file)),
    "extra-file": Case(lambda p, t: inj.add_extra_file(p),
                       _expect(["file-unreferenced"], "warning", 0, where=_at_file)),
    "append-bytes": Case(
        lambda p, t: inj.append_bytes(p),
        _expect(["bytes-unreferenced"], "warning", 0,
                where=lambda f, fault: _at_file(f, fault) and overlaps(f.location.byte_range, fault.byte_range))),
    "zero-page": Case(lambda p, t: inj.zero_page(p),
                      _expect(["zip-crc"], where=_at_payload), _zip_only),
    "delete-metadata": Case(lambda p, t: inj.delete_metadata(p), _expect(["metadata-missing"])),
    "truncate-metadata": Case(_truncate_metadata, _expect(["metadata-unreadable"], where=_at_file)),
    "malicious-open": _malicious("open"),
    "malicious-system": _malicious("system"),
    "malicious-eval": _malicious("eval"),
    "malicious-nested": _malicious("open", nested=True),
    "swap-files": Case(lambda p, t: inj.swap_same_size_files(p), _swap_check, _swap_skip),
    "swap-files-same-nbytes": Case(lambda p, t: inj.swap_same_size_files(p, pair=_same_nbytes_pair(p)),
                                   _swap_same_nbytes_check, _swap_skip),
    "md-drop-storage-entry": Case(_md_edit(_drop_storage), _expect(["item-missing"], where=_at_fqn)),
    "md-overlapping-items": Case(_md_edit(_overlap), _expect(["item-overlap"])),
    "md-wrong-dtype": Case(_md_edit(_dtype), _expect(["tensor-record"], where=_at_fqn), _zip_only),
    "md-grown-tensor": Case(_md_edit(_grow), _expect(["chunk-tiling", "metadata-inconsistent"], where=_at_fqn)),
    "md-drop-chunk": Case(_md_edit(_drop_chunk), _expect(["chunk-tiling"], where=_at_fqn),
                          lambda lay: None if lay == "fsdp2" else "needs-a-sharded-tensor-with-global-metadata"),
    "delete-rank-metadata": Case(_delete_rank_metadata, _expect(["chunk-tiling"], where=_at_fqn),
                                 lambda lay: None if lay == "nocoll" else "needs-per-rank-metadata"),
}


def _matrix() -> list[Any]:
    """Every (layout, fault) pair where the fault applies. Pairs that cannot apply (``case.skip`` gives the
    reason, e.g. a safetensors layout has no zip payload to flip) are left out of the matrix, not skipped;
    ``test_matrix_leaves_out_only_inapplicable_pairs`` keeps that list honest."""
    return [pytest.param(layout, name, id=f"{layout}-{name}")
            for layout in LAYOUTS for name, case in CASES.items() if case.skip(layout) is None]


def test_matrix_leaves_out_only_inapplicable_pairs() -> None:
    left_out = {(lay, name): CASES[name].skip(lay) for lay in LAYOUTS for name in CASES
                if CASES[name].skip(lay) is not None}
    allowed = {"tensors-not-in-torch-save-zips", "no-equal-size-distcp-files", "needs-per-rank-metadata",
               "needs-a-sharded-tensor-with-global-metadata",
               "equal-layout-files-swap-undetectable-without-manifest"}
    assert set(left_out.values()) <= allowed, left_out
    # Every fault runs on at least one layout, and every layout sees most faults.
    assert all(any(CASES[n].skip(lay) is None for lay in LAYOUTS) for n in CASES)
    assert all(sum(CASES[n].skip(lay) is None for n in CASES) >= len(CASES) // 2 for lay in LAYOUTS)


@pytest.mark.parametrize(("layout", "fault_name"), _matrix())
def test_fault_is_detected(layout: str, fault_name: str, fresh_ckpt: Any, tmp_path: Path) -> None:
    case = CASES[fault_name]
    path = fresh_ckpt(layout)
    fault = case.inject(path, tmp_path)
    report = verify_checkpoint(path)
    case.check(report, fault, path)


@pytest.mark.parametrize("layout", sorted(ZIP_LAYOUTS))
def test_payload_flip_json_location(layout: str, fresh_ckpt: Any) -> None:
    """The JSON report of a payload flip names the chunk, the record, the bytes and the elements."""
    path = fresh_ckpt(layout)
    fault = inj.flip_in_tensor_payload(path, rng=len(layout))
    _, data = run_both(path)
    assert data["exit_code"] == 1 and data["passed"] is False
    hits = [f for f in data["findings"] if f["check"] == "zip-crc" and f["location"].get("fqn") == fault.fqn
            and tuple(f["location"].get("chunk_offsets", ())) == fault.chunk_offsets]
    assert len(hits) == 1, data["findings"]
    loc = hits[0]["location"]
    assert loc["file"] == fault.file
    assert loc["byte_range"][0] <= fault.byte_offset < loc["byte_range"][1]  # type: ignore[operator]
    assert loc["element_range"][0] <= fault.element < loc["element_range"][1]  # type: ignore[operator]
    assert loc["record"].endswith("data/0")
    assert hits[0]["severity"] == "error"


def test_safetensors_tail_truncation_is_detected(fresh_ckpt: Any) -> None:
    """Cutting the last byte of a safetensors-format file (inside the tensor blob) is an error."""
    path = fresh_ckpt("safetensors")
    fault = inj.truncate(path, nbytes=1)
    report = verify_checkpoint(path)
    assert report.exit_code == 1, f"{fault.to_dict()}\n{describe(report)}"
    assert any(f.location.file == fault.file for f in report.errors), describe(report)


def test_one_payload_flip_per_tensor_item(fresh_ckpt: Any) -> None:
    """Every tensor item of the two-rank checkpoint: a flipped bit is found in that very chunk."""
    path = fresh_ckpt("fsdp2")
    for item in inj.tensor_zip_items(path):
        rec = inj.payload_record(inj.zip_records(path, item))
        fault = inj.flip_payload_byte(path, item, rec.data_len - 1, 7)
        report = verify_checkpoint(path, jobs=1)
        hits = matching(report, ["zip-crc"], where=lambda f, fault=fault: _at_payload(f, fault))
        assert hits, f"{item.fqn}@{item.chunk_offsets}\n{describe(report)}"
        assert report.exit_code == 1
        inj.flip_bit(path, fault.file, fault.byte_offset, fault.bit)  # type: ignore[arg-type]
    assert verify_checkpoint(path).exit_code == 0


@pytest.mark.parametrize(("layout", "fault_name"), _matrix())
def test_fault_is_detected_with_a_manifest(layout: str, fault_name: str, fresh_ckpt: Any, tmp_path: Path) -> None:
    """The whole matrix again on adopted checkpoints (manifest present): every fault is still an error, except
    a planted extra file, which changes no byte the checkpoint references (a warning), and bytes appended to a
    referenced file, which the manifest's recorded file size now turns into an error."""
    from ckptverify.audit.adopt import fingerprint_checkpoint

    path = fresh_ckpt(layout)
    # The safetensors layout carries no CRC-32: adopting it is an explicit act of trust.
    _, manifest = fingerprint_checkpoint(path, trust_uncheckable=True)
    assert manifest is not None
    fault = CASES[fault_name].inject(path, tmp_path)
    report = verify_checkpoint(path)
    if fault_name == "extra-file":
        assert report.exit_code == 0 and any(f.check == "file-unreferenced" for f in report.warnings)
        return
    assert report.exit_code == 1, f"fault {fault.to_dict()}\n{describe(report)}"
    if fault_name == "append-bytes":
        assert any(f.check == "manifest-digest" for f in report.errors), describe(report)
