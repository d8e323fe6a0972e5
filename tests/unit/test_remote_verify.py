"""``verify`` of DCP checkpoints in S3: written by DCP's own fsspec writer into a real S3-compatible server
(moto's standalone server, started here), read back with ranged requests, judged as the same checkpoint on a
local disk is judged.

Skipped, with the reason, when s3fs or moto is not installed (the ``test`` extra installs both).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'ckptverify[s3]'): S3 tests skipped")
pytest.importorskip("moto.server", reason="moto's S3 server is not installed (the `test` extra): S3 tests skipped")

import torch
import torch.distributed.checkpoint as dcp
from helpers.preloaded_children import PreloadedServer
from helpers.remote_s3 import SECRET, SlowDownProxy, serve_bucket

from ckptverify.audit.verify import verify_checkpoint

BUCKET = "ckpts"


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    yield from serve_bucket(BUCKET)


@pytest.fixture
def server_env(s3: Any) -> dict[str, str]:
    return {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                                       "AWS_DEFAULT_REGION")}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                        torch.nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(torch.randn(8, 64)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2, "big": torch.randn(600, 1000)}


def save_s3(prefix: str, seed: int = 0) -> str:
    """A DCP checkpoint written to ``s3://BUCKET/prefix`` by torch's ``FsspecWriter``; its URL."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    url = f"s3://{BUCKET}/{prefix}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": intended here
        dcp.save(_state(seed), storage_writer=FsspecWriter(url))
    return url


def fresh(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def shard(fs: Any, url: str) -> str:
    names = [p for p in fs.ls(url) if p.endswith(".distcp")]
    assert names
    return names[0]


def local_copy(fs: Any, url: str, tmp_path: Path) -> str:
    dest = tmp_path / "local"
    fs.get(url.removeprefix("s3://") + "/", str(dest) + "/", recursive=True)
    return str(dest)


def judged(report: Any) -> set[tuple[str, str, str | None]]:
    """What a report finds, independent of where the checkpoint lives."""
    return {(f.check, f.severity.value, f.location.file) for f in report.findings}


def test_clean_checkpoint_written_by_fsspec_writer_passes(s3: Any, tmp_path: Path) -> None:
    url = save_s3(fresh("clean"))
    report = verify_checkpoint(url)
    assert report.passed, [f.message for f in report.findings]
    assert report.target == url
    assert report.stats["items"] > 0 and report.stats["bytes"] > 2_000_000
    # Ranged reads, never more than a few times the checkpoint's bytes, and counted in the report.
    storage = report.stats["storage"]
    assert storage["requests"] >= 2 and report.stats["bytes"] <= storage["bytes"] <= 2 * report.stats["bytes"]
    assert storage["retries"] == 0
    local = verify_checkpoint(local_copy(s3, url, tmp_path))
    assert judged(report) == judged(local)
    assert {c.check: c.count for c in report.coverage} == {c.check: c.count for c in local.coverage}


def test_big_object_is_read_in_ranges_not_whole(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptverify.safeparse import remote

    monkeypatch.setattr(remote, "RANGE_BYTES", 512 << 10)
    url = save_s3(fresh("ranged"))
    sizes: list[int] = []
    real = remote.RemoteFile._get

    def spy(self: Any, start: int, end: int) -> bytes:
        sizes.append(end - start)
        return real(self, start, end)

    monkeypatch.setattr(remote.RemoteFile, "_get", spy)
    report = verify_checkpoint(url)
    assert report.passed
    assert max(sizes) <= 512 << 10 and sum(sizes) >= report.stats["bytes"]


def test_header_blocks_are_bounded_process_wide(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks small reads are served from stay under their budget, across files, and go with their file."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from ckptverify.safeparse import remote

    url = f"s3://{BUCKET}/{fresh('blocks')}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {f"t{i}": torch.randn(400_000) for i in range(8)}  # items over 1 MiB: parsed by ranged reads
        dcp.save(state, storage_writer=FsspecWriter(url, thread_count=4))
    budget = 3 * remote._BLOCK_BYTES
    monkeypatch.setattr(remote, "_BLOCK_BUDGET", budget)
    held: list[int] = []
    real = remote.RemoteFile._block

    def spy(self: Any, index: int) -> bytes:
        data = real(self, index)
        held.append(remote._blocks_held[0])
        return data

    monkeypatch.setattr(remote.RemoteFile, "_block", spy)
    report = verify_checkpoint(url)
    assert report.passed and report.stats["files"] == 4
    assert held and max(held) <= budget
    assert remote._blocks_held[0] == 0 and not remote._blocks  # every file closed: nothing kept


def test_truncated_object_same_findings_as_local(s3: Any, tmp_path: Path) -> None:
    url = save_s3(fresh("trunc"))
    key = shard(s3, url)
    data = s3.cat_file(key)
    s3.pipe_file(key, data[: len(data) - 4096])
    report = verify_checkpoint(url)
    assert not report.passed
    local = verify_checkpoint(local_copy(s3, url, tmp_path))
    assert judged(report) == judged(local)
    assert any(f.severity.value == "error" and f.location.file == key.rsplit("/", 1)[-1] for f in report.findings)


def test_missing_part(s3: Any) -> None:
    url = save_s3(fresh("missing"))
    key = shard(s3, url)
    s3.rm_file(key)
    report = verify_checkpoint(url)
    assert any(f.check == "file-missing" and f.location.file == key.rsplit("/", 1)[-1] for f in report.findings)
    assert not report.passed


def test_flipped_byte_fails_crc(s3: Any, tmp_path: Path) -> None:
    url = save_s3(fresh("flip"))
    key = shard(s3, url)
    data = bytearray(s3.cat_file(key))
    data[len(data) // 2] ^= 0x10
    s3.pipe_file(key, bytes(data))
    report = verify_checkpoint(url)
    assert not report.passed
    assert any(f.check == "zip-crc" for f in report.findings)
    assert judged(report) == judged(verify_checkpoint(local_copy(s3, url, tmp_path)))


def test_missing_commit_marker(s3: Any, tmp_path: Path) -> None:
    url = save_s3(fresh("nometa"))
    s3.rm_file(f"{url}/.metadata".removeprefix("s3://"))
    report = verify_checkpoint(url)
    assert not report.passed
    assert judged(report) == judged(verify_checkpoint(local_copy(s3, url, tmp_path)))


def test_uncommitted_save_marker(s3: Any) -> None:
    from ckptverify.ownfiles.names import SAVE_MARKER

    url = save_s3(fresh("marker"))
    s3.pipe_file(f"{url}/{SAVE_MARKER}".removeprefix("s3://"), json.dumps({"save_id": "s1", "pid": 7}).encode())
    report = verify_checkpoint(url)
    assert any(f.check == "save-uncommitted" for f in report.findings)


def test_object_replaced_while_verified_is_file_changed(s3: Any) -> None:
    """Same size, other bytes: only the ETag tells. The replacement happens after the objects were opened
    and before their bytes are hashed; the ranged GETs (If-Match) or the final check must see it."""
    url = save_s3(fresh("replaced"))
    key = shard(s3, url)
    data = bytearray(s3.cat_file(key))
    data[-100] ^= 1

    class Replacer:
        def start(self, total: int) -> None:
            if data is not None and not done:
                s3.pipe_file(key, bytes(data))
                done.append(True)

        def advance(self, n: int) -> None:
            pass

    done: list[bool] = []
    report = verify_checkpoint(url, progress=Replacer())
    assert done
    changed = [f for f in report.findings if f.check == "file-changed"]
    assert changed and changed[0].location.file == key.rsplit("/", 1)[-1]
    assert not report.passed


def test_object_replaced_after_it_was_read_is_file_changed(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replaced after every byte was read (no ranged GET left to refuse it): the listing at the end sees the
    new ETag."""
    from ckptverify.checks.dcp_pipeline import VerificationRun

    url = save_s3(fresh("replaced-late"))
    key = shard(s3, url)
    data = bytearray(s3.cat_file(key))
    data[-100] ^= 1
    original = VerificationRun.changed_files
    done: list[bool] = []

    def replace_then_check(self: Any) -> Any:
        if not done:
            s3.pipe_file(key, bytes(data))
            done.append(True)
        return original(self)

    monkeypatch.setattr(VerificationRun, "changed_files", replace_then_check)
    report = verify_checkpoint(url)
    assert done
    changed = [f for f in report.findings if f.check == "file-changed"]
    assert [f.location.file for f in changed] == [key.rsplit("/", 1)[-1]] and "ETag" in changed[0].message


def test_any_fsspec_url_memory_filesystem() -> None:
    """Not S3: fsspec's in-memory file system (no ETag: size and time are the signature; plain ranged reads)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    url = f"memory://ckpts/{uuid.uuid4().hex[:8]}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(3), storage_writer=FsspecWriter(url))
    report = verify_checkpoint(url)
    assert report.passed, [f.message for f in report.findings]
    import fsspec

    fs = fsspec.filesystem("memory")
    name = next(p for p in fs.find(url) if p.endswith(".distcp"))
    blob = bytearray(fs.cat_file(name))
    fs.pipe_file(name, bytes(blob[: len(blob) - 100]))
    assert not verify_checkpoint(url).passed


def test_throttled_requests_are_retried_and_verify_passes(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url = save_s3(fresh("throttled"))
    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    proxy = SlowDownProxy(port, failures=3, only_ranged=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        report = verify_checkpoint(url)
    finally:
        proxy.stop()
    assert proxy.refused == 3
    assert report.passed, [f.message for f in report.findings]
    assert report.stats["storage"]["retries"] == 3


def test_a_store_that_keeps_failing_is_exit_2_naming_the_object(s3: Any, server_env: dict[str, str],
                                                               children: PreloadedServer) -> None:
    """Every ranged GET answered 500 (retried, 3 attempts): the command could not run; it says which object
    and range, passes nothing, prints no traceback."""
    url = save_s3(fresh("failing"))
    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    proxy = SlowDownProxy(port, failures=10**9, only_ranged=True, status=500, code=b"InternalError")
    try:
        run = _child_cli(children, ["verify", url],
                         {**server_env, "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_MAX_ATTEMPTS": "3"})
    finally:
        proxy.stop()
    assert run.returncode == 2, run.stdout + run.stderr
    assert "did not serve bytes" in run.stderr and ".metadata" in run.stderr
    assert "Traceback" not in run.stderr and SECRET not in run.stdout + run.stderr
    assert proxy.refused >= 3
    # Access denied to everything: not "does not exist", not a finding: the store refused.
    denied = SlowDownProxy(port, failures=10**9, status=403, code=b"AccessDenied")
    try:
        run = _child_cli(children, ["verify", url], {**server_env, "AWS_ENDPOINT_URL": denied.endpoint})
    finally:
        denied.stop()
    assert run.returncode == 2 and "did not answer" in run.stderr and "does not exist" not in run.stderr, \
        run.stdout + run.stderr
    assert "Traceback" not in run.stderr and SECRET not in run.stdout + run.stderr


def test_manifest_on_s3_is_checked(s3: Any, tmp_path: Path) -> None:
    """A manifest written beside the checkpoint (by ``fingerprint`` on a copy) is read from S3 and the block
    digests are compared; a payload byte changed afterwards is caught by them."""
    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.ownfiles.manifest import MANIFEST_FILE

    url = save_s3(fresh("manifest"))
    local = local_copy(s3, url, tmp_path)
    fingerprint_checkpoint(local)
    s3.put_file(os.path.join(local, MANIFEST_FILE), f"{url}/{MANIFEST_FILE}".removeprefix("s3://"))
    report = verify_checkpoint(url)
    assert report.passed and report.stats["manifest"] is True
    assert any(c.check == "manifest-digest" and c.count > 0 for c in report.coverage)
    deep = verify_checkpoint(url, deep=True)  # every tensor rebuilt from ranged reads, fingerprints compared
    assert deep.passed and any(c.check == "fingerprint" and c.count > 0 for c in deep.coverage)
    key = shard(s3, url)
    data = bytearray(s3.cat_file(key))
    data[len(data) // 3] ^= 0x01
    s3.pipe_file(key, bytes(data))
    bad = verify_checkpoint(url)
    assert any(f.check == "manifest-digest" for f in bad.findings) and not bad.passed


def _code(args: list[str], prelude: str = "") -> str:
    return f"{prelude}\nimport sys\nfrom ckptverify.cli import main\nsys.argv = ['ckptverify', *{args!r}]\nmain()"


def _cli(args: list[str], env: dict[str, str], *, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """The command in a fresh interpreter started with ``env``: for the tests about the environment itself."""
    return subprocess.run([sys.executable, "-c", _code(args, prelude)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@pytest.fixture(scope="module")
def children(s3: Any) -> Iterator[PreloadedServer]:
    """Processes for the command line forked from a server that imported it and s3fs once (a fresh interpreter
    costs a second of CPU apiece, a child a third of that); started once the module's server is up."""
    preload = ("s3fs", "ckptverify.cli", "ckptverify.audit.verify", "ckptverify.safeparse.remote")
    with PreloadedServer(preload) as server:
        yield server


def _child_cli(children: PreloadedServer, args: list[str], env: dict[str, str]) -> Any:
    """The command in a child process (exit status, stdout, stderr), ``env`` set before it runs."""
    done = children.run(_code(args), env=env, timeout=300)
    assert not done.timed_out, f"{args} did not finish"
    return done


def test_cli_verify_s3_never_prints_the_secret(s3: Any, server_env: dict[str, str], children: PreloadedServer) -> None:
    url = save_s3(fresh("cli"))
    ok = _child_cli(children, ["verify", url, "--json"], server_env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["target"] == url
    key = shard(s3, url)
    s3.rm_file(key)
    bad = _child_cli(children, ["verify", url], server_env)
    assert bad.returncode == 1
    gone = _child_cli(children, ["verify", f"s3://{BUCKET}/no-such-checkpoint"], server_env)
    assert gone.returncode == 2 and "does not exist" in gone.stderr
    wrong = _child_cli(children, ["verify", f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/x"], server_env)
    assert wrong.returncode == 2
    for run in (ok, bad, gone, wrong):
        assert SECRET not in run.stdout + run.stderr
        assert "Traceback" not in run.stderr


def test_storage_options_from_the_environment(s3: Any, server_env: dict[str, str]) -> None:
    """``CKPTVERIFY_STORAGE_OPTIONS`` reaches the file system (here: the endpoint, while the standard variable
    names a port nothing listens on); one that is not a JSON object is exit 2, its content never echoed."""
    from helpers.ports import refused_port

    url = save_s3(fresh("options"))
    options = json.dumps({"client_kwargs": {"endpoint_url": server_env["AWS_ENDPOINT_URL"]}})
    with refused_port() as port:
        dead = {**server_env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_MAX_ATTEMPTS": "1"}
        ok = _cli(["verify", url], {**dead, "CKPTVERIFY_STORAGE_OPTIONS": options})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = _cli(["verify", url], {**server_env, "CKPTVERIFY_STORAGE_OPTIONS": f'["{SECRET}"]'})
    assert bad.returncode == 2 and "CKPTVERIFY_STORAGE_OPTIONS must hold a JSON object" in bad.stderr
    assert SECRET not in bad.stdout + bad.stderr and "Traceback" not in bad.stderr
