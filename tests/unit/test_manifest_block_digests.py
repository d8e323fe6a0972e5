"""Reading a manifest checks its block digests in a few passes over all of them at once; it refuses exactly what
checking them one by one refused, and names the first bad one the same way."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.errors import ManifestError
from ckptverify.fingerprint.digest import digest_bytes, new_digest
from ckptverify.ownfiles import manifest as mf


@pytest.fixture(scope="module")
def adopted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("manifest-digests") / "ckpt"
    g = torch.Generator().manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(64 * 1024, generator=g), "v": torch.randn(9000, generator=g)},
                 storage_writer=dcp.FileSystemWriter(str(root), thread_count=1))
    report, manifest = fingerprint_checkpoint(str(root), block_bytes=4096)
    assert report.passed and manifest is not None
    return root


def _rewrite(root: Path, edit: Any) -> None:
    """Edit the manifest's JSON and seal it again (a valid self-digest): only the field check can refuse it."""
    path = root / mf.MANIFEST_FILE
    body = json.loads(path.read_text())
    del body["self_digest"]
    edit(body)
    body["self_digest"] = mf._self_digest(body)
    path.write_text(json.dumps(body))


def _item_with_blocks(body: dict) -> dict:
    return next(i for i in body["items"] if len(i["blocks"]) > 3)


BAD_BLOCKS = {
    "upper case": lambda b: b.upper(),
    "one character short": lambda b: b[:-1],
    "one character long": lambda b: b + "0",
    "not hex": lambda b: "g" + b[1:],
    "a NUL": lambda b: "\x00" + b[1:],
    "too long for a digest field": lambda b: b * 5,
    "a number": lambda b: 7,
    "null": lambda b: None,
}


@pytest.mark.parametrize("where", [0, 2, -1], ids=["first", "middle", "last"])
@pytest.mark.parametrize("bad", list(BAD_BLOCKS), ids=list(BAD_BLOCKS))
def test_a_bad_block_digest_anywhere_is_refused(adopted: Path, tmp_path: Path, bad: str, where: int) -> None:
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(adopted, root)

    def edit(body: dict) -> None:
        item = _item_with_blocks(body)
        item["blocks"][where] = BAD_BLOCKS[bad](item["blocks"][where])

    _rewrite(root, edit)
    with pytest.raises(ManifestError) as exc:
        mf.read_manifest(str(root))
    if bad in ("a number", "null", "a NUL", "too long for a digest field"):
        assert "wrong structure" in str(exc.value)
    else:
        assert "a block digest of item" in str(exc.value)
    report = verify_checkpoint(str(root))
    assert not report.passed and "manifest-invalid" in {f.check for f in report.findings}


def test_block_digests_read_back_as_written(adopted: Path) -> None:
    manifest = mf.read_manifest(str(adopted))
    assert manifest is not None
    written = json.loads((adopted / mf.MANIFEST_FILE).read_text())
    assert [list(i.blocks) for i in manifest.items] == [i["blocks"] for i in written["items"]]
    assert sum(len(i.blocks) for i in manifest.items) > 60
    assert mf._block_digests_valid((), 32) and not mf._block_digests_valid(("",), 32)


@pytest.mark.parametrize("algorithm", ["xxh3-128", "sha256"])
def test_digest_bytes_is_the_streaming_digest(algorithm: str) -> None:
    data = bytes(range(256)) * 40
    for n in (0, 1, 2047, 2048, len(data)):
        streamed = new_digest(algorithm)
        streamed.update(data[:n // 2])
        streamed.update(data[n // 2:n])
        assert digest_bytes(memoryview(data)[:n], algorithm) == streamed.hexdigest()
    with pytest.raises(Exception, match="unknown digest algorithm"):
        digest_bytes(data, "md5")


def test_block_strings_refuse_what_the_field_check_refused() -> None:
    class Text(str):
        pass

    good = ["0" * 32, "f" * 32]
    assert mf._block_strings(good) == tuple(good) and mf._block_strings([]) == ()
    for bad in ([Text("0" * 32)], ["0" * 32, 5], ["a" * 129], ["ab\x00"], [None]):
        with pytest.raises(ValueError):
            mf._block_strings(bad)


BAD_TENSOR_ENTRIES = {
    "a long dtype": ({"dtype": "f" * 65}, "is malformed"),
    "too many dims": ({"shape": [1] * 65}, "is malformed"),
    "an oversized fingerprint": ({"fingerprint": "f" * 257}, "has an oversized fingerprint"),
    "too many parts": ({"parts": {f"p{i}": "0" * 32 for i in range(17)}}, "has malformed parts"),
    "parts not an object": ({"parts": ["qdata"]}, "tensor parts are not an object"),
    "a long part name": ({"parts": {"p" * 65: "0" * 32}}, "wrong structure"),
}


@pytest.mark.parametrize("bad", list(BAD_TENSOR_ENTRIES), ids=list(BAD_TENSOR_ENTRIES))
def test_a_bad_tensor_entry_is_refused(adopted: Path, tmp_path: Path, bad: str) -> None:
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(adopted, root)
    fields, said = BAD_TENSOR_ENTRIES[bad]
    _rewrite(root, lambda body: body["tensors"]["w"].update(fields))
    with pytest.raises(ManifestError, match=said):
        mf.read_manifest(str(root))


@pytest.mark.parametrize(("field", "value", "said"), [
    ("schema", "other", "not a ckptverify manifest"),
    ("schema_version", 99, "schema version 99 is not supported"),
    ("source", "copied", "neither 'save' nor 'fingerprint'"),
])
def test_a_manifest_of_another_schema_or_source_is_refused(adopted: Path, tmp_path: Path, field: str, value: Any,
                                                            said: str) -> None:
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(adopted, root)
    _rewrite(root, lambda body: body.update({field: value}))
    with pytest.raises(ManifestError, match=said):
        mf.read_manifest(str(root))
