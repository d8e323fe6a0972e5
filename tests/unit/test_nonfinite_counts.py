"""NaN and Inf counts: a save's manifest, the manifest ``fingerprint`` writes for a DCP checkpoint or a
``torch.save`` file already on disk, and the deep check's warning count the same values for every dtype, float8
and complex32 included; a dtype whose counts are not kept has none (not zero) on every path."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import ckptverify.checkpoint.save as cs
from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.fingerprint.nonfinite import COUNTED_DTYPES, nonfinite_counts
from ckptverify.ownfiles.manifest import MANIFEST_FILE, Manifest, read_manifest

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:ComplexHalf support is experimental:UserWarning",
)

_F8 = [d for d in ("float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
       if isinstance(getattr(torch, d, None), torch.dtype)]


def _state() -> dict[str, torch.Tensor]:
    """Tensors of every counted dtype with known NaNs and Infs (as the format can hold them), small ones (a fast
    path of their own when adopted) and large ones, and tensors whose counts are not kept."""
    nan, inf = float("nan"), float("inf")
    state: dict[str, torch.Tensor] = {}
    for name in ("float32", "float64", "float16", "bfloat16"):
        dtype = getattr(torch, name)
        state[f"small.{name}"] = torch.tensor([1.0, nan, -inf, inf, 2.0, nan, nan], dtype=dtype)
        big = torch.randn(70_000).to(dtype)
        big[[3, 60_001]] = nan
        big[17] = -inf
        state[f"big.{name}"] = big
    state["finite.float32"] = torch.randn(300)
    for name in ("complex64", "complex128"):
        state[name] = torch.tensor([1 + 1j, complex(nan, 0), complex(0, inf), complex(nan, inf), 3j],
                                   dtype=getattr(torch, name))
    state["complex32"] = torch.tensor([1 + 1j, complex(nan, 0), complex(inf, 1)], dtype=torch.complex64).to(
        torch.complex32)
    for name in _F8:
        dtype = getattr(torch, name)
        bits = torch.arange(256, dtype=torch.int16).to(torch.uint8)  # every encoding once
        state[name] = bits.view(dtype).clone()
    state["int32"] = torch.arange(10, dtype=torch.int32)
    state["bool"] = torch.tensor([True, False])
    return state


def _counts(manifest: Manifest) -> dict[str, tuple[int | None, int | None]]:
    return {fqn: (t.nan_count, t.inf_count) for fqn, t in manifest.tensors.items()}


def test_every_path_counts_alike(tmp_path: Path) -> None:
    state = _state()
    expected = {fqn: nonfinite_counts(t) for fqn, t in state.items()}
    # What the counts are, told apart from how they are computed: torch's own tests, element by element.
    for fqn, t in state.items():
        name = str(t.dtype).removeprefix("torch.")
        if name not in COUNTED_DTYPES:
            assert expected[fqn] == (None, None), fqn
        elif name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
            assert expected[fqn] == (int(torch.isnan(t).sum()), 0), fqn
        elif name == "complex32":
            assert expected[fqn] == (1, 1), fqn
        else:
            wide = t if t.dtype.is_complex else t.float()
            nans = int(torch.isnan(wide).sum())
            assert expected[fqn] == (nans, int((~torch.isfinite(wide)).sum()) - nans), fqn
    assert expected["float8_e4m3fn"] == (2, 0) and expected.get("float8_e5m2", (6, 2)) == (6, 2)
    assert expected["complex64"] == (2, 1) and expected["small.bfloat16"] == (3, 2)

    saved = cs.save(state, os.fspath(tmp_path / "saved"), fingerprint=True, sync_files=False)
    assert saved is not None
    assert _counts(saved) == expected

    # The same checkpoint adopted by `fingerprint` (its manifest taken away), through both of adopt's paths.
    shutil.copytree(tmp_path / "saved", tmp_path / "adopted")
    (tmp_path / "adopted" / MANIFEST_FILE).unlink()
    report, adopted = fingerprint_checkpoint(tmp_path / "adopted")
    assert report.passed and adopted is not None
    assert _counts(adopted) == expected
    assert {fqn: t.fingerprint for fqn, t in adopted.tensors.items()} == {
        fqn: t.fingerprint for fqn, t in saved.tensors.items()}

    # A torch.save file, adopted through the described formats' path.
    pt = tmp_path / "model.pt"
    torch.save(state, pt)
    report, single = fingerprint_checkpoint(pt)
    assert report.passed and single is not None
    assert _counts(single) == expected


def test_the_deep_check_warns_of_nan_in_float8(tmp_path: Path) -> None:
    """A float8 tensor holding NaNs is warned about as any floating tensor is (it was not counted before)."""
    dtype = torch.float8_e4m3fn
    bits = torch.zeros(64, dtype=torch.uint8)
    bits[[5, 9]] = 0x7F  # the format's NaN
    state = {"w": bits.view(dtype).clone(), "ok": torch.ones(8).to(dtype)}
    cs.save(state, os.fspath(tmp_path / "c"), fingerprint=True, sync_files=False)
    report = verify_checkpoint(tmp_path / "c", deep=True)
    warned = [f for f in report.findings if f.check == "nonfinite"]
    assert [(f.location.fqn, f.actual) for f in warned] == [("w", {"nan": 2, "inf": 0})]
    manifest = read_manifest(os.fspath(tmp_path / "c"))
    assert manifest is not None and manifest.tensors["w"].nan_count == 2
