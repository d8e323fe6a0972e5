"""Build real framework checkpoints once per test session and judge them with the ``ckptverify`` command.

Each framework's producer (``produce_<framework>.py``) runs in its own process: the framework is never
imported into pytest. A framework whose distribution is not installed is skipped with the install command;
one that is installed but whose producer fails is an error, never a skip (that would hide a broken install).
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptverify.cli import main as cli_main

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

INSTALL_HINT = "pip install -e '.[frameworks]' (see docs/frameworks.md)"
MEGATRON_HINT = ("pip install --no-deps --ignore-requires-python megatron-core==0.19.2 triton==3.9.0 "
                 "(megatron-core declares Python >= 3.12; .ci/run does this; see docs/frameworks.md)")


@dataclass(frozen=True)
class Producer:
    script: str
    distributions: tuple[str, ...]
    hint: str
    timeout_s: int


PRODUCERS = {
    "torchtitan": Producer("produce_torchtitan.py", ("torchtitan",), INSTALL_HINT, 300),
    "lightning": Producer("produce_lightning.py", ("pytorch-lightning",), INSTALL_HINT, 400),
    "accelerate": Producer("produce_accelerate.py", ("accelerate",), INSTALL_HINT, 300),
    "transformers": Producer("produce_transformers.py", ("transformers", "accelerate"), INSTALL_HINT, 300),
    "megatron": Producer("produce_megatron.py", ("megatron-core", "triton"), MEGATRON_HINT, 400),
}


@dataclass(frozen=True)
class Built:
    """The checkpoints one producer wrote: never modify them, take a :meth:`copy`."""

    framework: str
    root: Path
    seconds: float
    produced: dict[str, dict[str, Any]]

    def path(self, name: str) -> Path:
        return self.root / self.produced[name]["path"]

    def copy(self, name: str, dst: Path) -> Path:
        src = self.path(name)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        return dst


_BUILT: dict[str, Built] = {}


def build(framework: str, base: Path) -> Built:
    """Run ``framework``'s producer into ``base/framework`` (once per process) and return what it wrote."""
    if framework in _BUILT:
        return _BUILT[framework]
    producer = PRODUCERS[framework]
    for dist in producer.distributions:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{dist} is not installed: {producer.hint}")
    out = base / framework
    # Nothing of an enclosing distributed job may leak in: each producer sets up its own ranks.
    leaked = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k not in leaked}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled",
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    log = base / f"{framework}.log"
    start = time.monotonic()
    with open(log, "wb") as fh:
        # Its own session, so that a timeout ends the producer with every rank it started (its process group).
        proc = subprocess.Popen([sys.executable, str(HERE / producer.script), str(out)], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=producer.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"timeout after {producer.timeout_s} s"
    seconds = time.monotonic() - start
    if rc != 0:
        tail = log.read_text(errors="replace")[-6000:]
        pytest.fail(f"{producer.script} failed ({rc}) after {seconds:.0f} s; last output:\n{tail}", pytrace=False)
    built = Built(framework, out, seconds, json.loads((out / "produced.json").read_text()))
    _BUILT[framework] = built
    return built


def build_times() -> dict[str, float]:
    return {name: b.seconds for name, b in _BUILT.items()}


# ---------------------------------------------------------------------------------------------------------
# the command line, as a user runs it


def cli(*args: str | os.PathLike[str]) -> dict[str, Any]:
    """``ckptverify ARGS --json``: the parsed report, with ``exit_code`` equal to the command's exit status."""
    result = CliRunner().invoke(cli_main, [*map(str, args), "--json"], catch_exceptions=False)
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"ckptverify {args} printed no JSON report (exit {result.exit_code}):\n"
                             f"{result.output}") from None
    if report.get("exit_code") != result.exit_code:
        raise AssertionError(f"report says exit {report.get('exit_code')}, command exited {result.exit_code}")
    return report


def verify(path: Path, *options: str) -> dict[str, Any]:
    return cli("verify", path, "--no-progress", *options)


def diff(a: Path, b: Path) -> dict[str, Any]:
    return cli("diff", a, b, "--no-progress")


def fingerprint(path: Path, *options: str) -> dict[str, Any]:
    return cli("fingerprint", path, "--no-progress", *options)


def findings(report: dict[str, Any], *severities: str) -> list[dict[str, Any]]:
    return [f for f in report.get("findings", []) if not severities or f["severity"] in severities]


def describe(report: dict[str, Any]) -> str:
    lines = [f"exit {report.get('exit_code')}" + (f": {report['error']}" if report.get("error") else "")]
    lines += [f"  {f['severity']:7} {f['check']:20} {f['location']} {f['message'][:160]}" for f in findings(report)]
    return "\n".join(lines)


def named(report: dict[str, Any], check: str) -> set[str]:
    """The FQNs that findings of ``check`` name."""
    return {f["location"]["fqn"] for f in findings(report) if f["check"] == check and "fqn" in f["location"]}


def covered(report: dict[str, Any], check: str) -> int:
    return sum(c["count"] for c in report.get("coverage", []) if c["check"] == check)


# ---------------------------------------------------------------------------------------------------------
# expectations shared by every framework's DCP folders


def assert_clean(report: dict[str, Any], uncheckable: tuple[str, ...] = ()) -> None:
    """Passed, nothing above ``info``, and something was actually checked.

    ``uncheckable``: file-name patterns of files that carry no checksum of their own (safetensors, pickles,
    JSON); for them, and only them, a ``content-uncheckable`` warning is true, not false. A ``torch.save``
    archive (zip CRC-32) or a DCP shard is never among them.
    """
    assert report["exit_code"] == 0, describe(report)
    assert not findings(report, "error"), describe(report)
    false = [f for f in findings(report, "warning")
             if not (f["check"] == "content-uncheckable"
                     and any(fnmatch.fnmatch(f["location"].get("file", ""), pat) for pat in uncheckable))]
    assert not false, describe(report)
    assert any(c["count"] > 0 for c in report.get("coverage", [])), report.get("coverage")


def assert_flip_localized(report: dict[str, Any], fault: Any) -> None:
    """Failed with an error that names the damaged file and the damaged tensor."""
    assert report["exit_code"] == 1, describe(report)
    hits = [f for f in findings(report, "error")
            if f["location"].get("file") == fault.file and f["location"].get("fqn") == fault.fqn]
    assert hits, f"no error names {fault.file} / {fault.fqn}:\n{describe(report)}"


def tensor_fqns(ckpt: Path) -> set[str]:
    """Every tensor FQN in a DCP checkpoint's metadata (read through the fault injector's allowlist)."""
    from helpers import faults as inj

    return {it.fqn for it in inj.items(ckpt) if it.kind == "tensor"}


def fixture(framework: str) -> Any:
    """A session-scoped fixture that builds ``framework``'s checkpoints on first use."""

    @pytest.fixture(scope="session")
    def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
        base = tmp_path_factory.getbasetemp() / "frameworks"
        base.mkdir(exist_ok=True)
        return build(framework, base)

    return built


# ---------------------------------------------------------------------------------------------------------
# faults in files that are not DCP items (tests/helpers/faults.py covers the DCP items)


def flip_in_zip_member(path: Path, bit: int = 6) -> str:
    """Flip one bit in the middle of the largest member of a zip (``torch.save``) file; return its name."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = max(zf.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", fh.read(4))
    start = info.header_offset + 30 + name_len + extra_len
    _flip(path, start + info.compress_size // 2, bit)
    return info.filename


def flip_in_safetensors(path: Path, bit: int = 6) -> str:
    """Flip one bit in the middle of the largest tensor of a ``.safetensors`` file; return the tensor's name."""
    import struct

    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
    name, entry = max(((k, v) for k, v in header.items() if k != "__metadata__"),
                      key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
    begin, end = entry["data_offsets"]
    _flip(path, 8 + header_len + (begin + end) // 2, bit)
    return name


def flip_middle_byte(path: Path, bit: int = 6) -> None:
    _flip(path, path.stat().st_size // 2, bit)


def _flip(path: Path, offset: int, bit: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ (1 << bit)]))


def ckptverify_warnings(caught: list[Any]) -> list[str]:
    """The warnings ckptverify raised among ``caught``: its own category, or raised from its own source files.

    A framework's deprecation warnings are not ckptverify's business. The test is the file's place inside the
    installed package, not the word "ckptverify" in its path: a clone of the project is usually a folder of that
    name, and every library of a virtual environment inside it would match."""
    import ckptverify
    from ckptverify.errors import VerifyFailedWarning

    package = os.path.dirname(os.path.abspath(ckptverify.__file__)) + os.sep
    return [str(w.message) for w in caught
            if issubclass(w.category, VerifyFailedWarning) or os.path.abspath(w.filename).startswith(package)]
