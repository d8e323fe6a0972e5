"""The manifest's text, built from string pieces, is byte for byte what the JSON encoder writes for it.

``manifest_text`` builds every entry's line and its canonical form (the one the self-digest is taken of) from
pieces encoded once; ``_dumps_by_line(manifest.to_dict())`` is the general path it replaces. They must give
the same bytes for every manifest: odd names (quotes, backslashes, non-ASCII, control characters), every
optional field set or not, tensor subclass parts, chunked items of many blocks, empty sections, and values of
another type than the entries declare (which take the general path).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from ckptverify.ownfiles import manifest as manifest_mod
from ckptverify.ownfiles.manifest import (
    MANIFEST_FILE,
    FileEntry,
    ItemEntry,
    Manifest,
    TensorEntry,
    manifest_text,
    read_manifest,
    write_manifest,
)

_ODD = ["a", "layers.0.weight", 'q"uote', "back\\slash", "é\u2603", "tab\there", "new\nline", "\x00\x1f", "", " ",
        "\\", '"', "a\\\"b", "ends\\", "\U0001f600", "/slash"]


def _general(manifest: Manifest) -> str:
    return manifest_mod._dumps_by_line(manifest.to_dict())


def _name(rng: random.Random, k: int) -> str:
    return f"{rng.choice(_ODD)}{k}{rng.choice(_ODD)}"


def _digest(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def _random_manifest(seed: int) -> Manifest:
    rng = random.Random(seed)
    tensors = {}
    for k in range(rng.randint(0, 30)):
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 4)))
        nan = rng.choice([None, 0, 3])
        inf = rng.choice([None, 0, 2])
        parts = rng.choice([None, None, (("qdata", _digest(rng)), ("scale", _digest(rng)))])
        tensors[_name(rng, k)] = TensorEntry(dtype=rng.choice(["float32", "bfloat16", "int64", 'od"d']), shape=shape,
                                             fingerprint=rng.choice([None, _digest(rng)]), nan_count=nan,
                                             inf_count=inf, parts=parts)
    files = {_name(rng, k): FileEntry(size=rng.randint(0, 1 << 40), digest=_digest(rng))
             for k in range(rng.randint(0, 20))}
    items = []
    for k in range(rng.randint(0, 40)):
        blocks = tuple(_digest(rng) for _ in range(rng.randint(0, 4)))
        offsets = rng.choice([None, (), (0,), (4, 0, 128)])
        items.append(ItemEntry(fqn=_name(rng, k), chunk_offsets=offsets, file=_name(rng, k % 3),
                               offset=rng.randint(0, 1 << 50), length=rng.randint(0, 1 << 30),
                               digest=_digest(rng), blocks=blocks))
    return Manifest(digest_algorithm=rng.choice(["xxh3-128", "sha256"]), block_bytes=1 << 20, items=tuple(items),
                    files=files, tensors=tensors, metadata_files={".metadata": FileEntry(size=12, digest="ab" * 16)}
                    if rng.random() < 0.8 else {}, world_size=rng.randint(1, 9),
                    fingerprint_version=rng.choice([None, 1, 2]), created=rng.choice(["", "2026-12-02T03:00:00+00:00"]),
                    tool_version=_name(rng, 0), torch_version="2.13.0+cpu", source=rng.choice(["save", "fingerprint"]))


@pytest.mark.parametrize("seed", range(40))
def test_random_manifests_encode_as_the_json_encoder_writes_them(seed: int) -> None:
    manifest = _random_manifest(seed)
    text = manifest_text(manifest)
    assert text == _general(manifest)
    assert json.loads(text) == manifest.to_dict()


def test_an_empty_manifest_encodes_alike() -> None:
    manifest = Manifest(digest_algorithm="xxh3-128", block_bytes=1 << 20, items=(), files={}, tensors={})
    assert manifest_text(manifest) == _general(manifest)


@pytest.mark.parametrize("odd", [
    "bool-shape", "bool-size", "bool-offset", "bool-nan", "list-blocks", "list-shape", "list-offsets", "int-subclass",
])
def test_values_of_other_types_take_the_general_path_and_give_its_text(odd: str) -> None:
    class Count(int):
        pass

    tensor = TensorEntry(dtype="float32", shape=(2, 3), fingerprint="f" * 32, nan_count=0, inf_count=0)
    item = ItemEntry(fqn="w", chunk_offsets=(0, 0), file="f.distcp", offset=0, length=9, digest="d" * 32,
                     blocks=("b" * 32,))
    file = FileEntry(size=9, digest="e" * 32)
    if odd == "bool-shape":
        tensor = TensorEntry(dtype="float32", shape=(True, 3), fingerprint=None)  # type: ignore[arg-type]
    elif odd == "bool-size":
        file = FileEntry(size=True, digest="e" * 32)  # type: ignore[arg-type]
    elif odd == "bool-offset":
        item = ItemEntry(fqn="w", chunk_offsets=(False, 0), file="f.distcp", offset=0, length=9,  # type: ignore[arg-type]
                         digest="d" * 32, blocks=("b" * 32,))
    elif odd == "bool-nan":
        tensor = TensorEntry(dtype="float32", shape=(2,), fingerprint=None, nan_count=False)  # type: ignore[arg-type]
    elif odd == "list-blocks":
        item = ItemEntry(fqn="w", chunk_offsets=None, file="f.distcp", offset=0, length=9, digest="d" * 32,
                         blocks=["b" * 32, "c" * 32])  # type: ignore[arg-type]
    elif odd == "list-shape":
        tensor = TensorEntry(dtype="float32", shape=[2, 3], fingerprint=None)  # type: ignore[arg-type]
    elif odd == "list-offsets":
        item = ItemEntry(fqn="w", chunk_offsets=[0, 0], file="f.distcp", offset=0, length=9,  # type: ignore[arg-type]
                         digest="d" * 32, blocks=())
    elif odd == "int-subclass":
        item = ItemEntry(fqn="w", chunk_offsets=None, file="f.distcp", offset=Count(5), length=9,
                         digest="d" * 32, blocks=())
    manifest = Manifest(digest_algorithm="xxh3-128", block_bytes=1 << 20, items=(item,), files={"f.distcp": file},
                        tensors={"w": tensor})
    assert manifest_text(manifest) == _general(manifest)


def test_a_value_the_encoder_refuses_is_refused_alike() -> None:
    class NotJSON:
        pass

    manifest = Manifest(digest_algorithm="xxh3-128", block_bytes=1 << 20, items=(), files={},
                        tensors={"w": TensorEntry(dtype="float32", shape=(NotJSON(),), fingerprint=None)})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _general(manifest)
    with pytest.raises(TypeError):
        manifest_text(manifest)


def test_the_written_manifest_is_the_text_and_reads_back(tmp_path: Path) -> None:
    tensors = {"é.w\"": TensorEntry(dtype="float32", shape=(2, 3), fingerprint="f" * 32, nan_count=1, inf_count=0),
               "b": TensorEntry(dtype="int64", shape=(), fingerprint=None)}
    manifest = Manifest(digest_algorithm="xxh3-128", block_bytes=1 << 20,
                        items=(ItemEntry(fqn="é.w\"", chunk_offsets=(0, 0), file="__0_0.distcp", offset=0, length=3,
                                         digest="d" * 32, blocks=("d" * 32,)),),
                        files={"__0_0.distcp": FileEntry(size=3, digest="a" * 32)}, tensors=tensors,
                        metadata_files={".metadata": FileEntry(size=5, digest="b" * 32)}, world_size=1,
                        fingerprint_version=1, created="2026-12-02T03:00:00+00:00", tool_version="x",
                        torch_version="y", source="fingerprint")
    write_manifest(str(tmp_path), manifest)
    text = (tmp_path / MANIFEST_FILE).read_text()
    assert text == _general(manifest)
    back: Any = read_manifest(str(tmp_path))
    assert back == manifest
    # The self-digest is the one the general path computes: one changed digit is refused.
    (tmp_path / MANIFEST_FILE).write_text(text.replace("a" * 32, "c" + "a" * 31, 1))
    with pytest.raises(Exception, match="self-digest"):
        read_manifest(str(tmp_path))
