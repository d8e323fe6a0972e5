"""Every way into a checkpoint reads the same manifests and names formats by their content, as a user meets them.

Files are made the way users make them (``torch.save``, ``safetensors.torch.save_file``, a transformers model's
``save_pretrained``, ``ckptverify.save``), fingerprinted with the CLI, damaged by one flipped byte, and then
checked through ``verify FILE``, ``verify FOLDER``, ``scan FOLDER``, ``scan PARENT`` and ``diff``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

from ckptverify.audit.diff import diff_checkpoints
from ckptverify.cli import main
from ckptverify.errors import UsageError
from ckptverify.findings import Location, Report, error

st = pytest.importorskip("safetensors.torch")


def _run(*args: str, columns: int = 200) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env={"COLUMNS": str(columns)})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def _json(*args: str) -> dict:
    code, out = _run(*args, "--json")
    data = json.loads(out)
    assert data["exit_code"] == code
    return data


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"net.0.weight": torch.randn(64, 32, generator=g), "net.0.bias": torch.randn(64, generator=g),
            "net.2.weight": torch.randn(10, 64, generator=g)}


def _flip_last_tensor_byte(path: Path) -> None:
    """One bit of the last tensor's payload (safetensors stores tensors after its header, in name order)."""
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(data)


def _fingerprinted_then_damaged(folder: Path) -> Path:
    folder.mkdir(parents=True)
    weights = folder / "model.safetensors"
    st.save_file(_state(), str(weights))
    torch.save({"step": 7, "opt": {"lr": 0.1}}, folder / "trainer.pt")
    code, out = _run("fingerprint", "--no-progress", "--trust-uncheckable", str(weights))
    assert code == 0, out
    assert (folder / "model.safetensors.ckptverify.manifest.json").is_file()
    _flip_last_tensor_byte(weights)
    return weights


# ------------------------------------------------------------------ 7: every way in reads the same manifests


def test_a_file_fingerprinted_alone_then_damaged_fails_every_way_in(tmp_path: Path) -> None:
    weights = _fingerprinted_then_damaged(tmp_path / "run" / "checkpoint-7")
    folder = weights.parent
    for target in (weights, folder):
        data = _json("verify", "--no-progress", str(target))
        assert data["exit_code"] == 1, target
        blamed = [f for f in data["findings"] if f["check"] == "manifest-digest" and f["location"].get("fqn")]
        assert [f["location"]["fqn"] for f in blamed] == ["net.2.weight"], target
        # The manifest checked the file: it is no longer "uncheckable".
        assert not [f for f in data["findings"] if f["check"] == "content-uncheckable"], target
    for run_dir, path in ((folder, "."), (tmp_path / "run", "checkpoint-7")):
        data = _json("scan", str(run_dir))
        (row,) = data["stats"]["checkpoints"]
        assert (row["path"], row["state"]) == (path, "corrupt"), row
        assert "net.2.weight" in row["reason"]
        assert data["exit_code"] == 1


def test_an_intact_file_with_its_own_manifest_is_verified_in_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "checkpoint-3"
    folder.mkdir(parents=True)
    st.save_file(_state(), str(folder / "model.safetensors"))
    assert _run("fingerprint", "--no-progress", "--trust-uncheckable", str(folder / "model.safetensors"))[0] == 0
    data = _json("verify", "--no-progress", str(folder))
    assert data["exit_code"] == 0 and data["stats"]["manifest"] is True
    assert not [f for f in data["findings"] if f["severity"] != "info"]
    (row,) = _json("scan", str(tmp_path / "run"))["stats"]["checkpoints"]
    assert row["state"] == "verified"
    # A lone-file manifest that pins another file is refused, not trusted.
    manifest = folder / "model.safetensors.ckptverify.manifest.json"
    other = folder / "other.safetensors"
    st.save_file(_state(1), str(other))
    assert _run("fingerprint", "--no-progress", "--trust-uncheckable", str(other))[0] == 0
    os.replace(folder / "other.safetensors.ckptverify.manifest.json", manifest)
    data = _json("verify", "--no-progress", str(folder / "model.safetensors"))
    assert data["exit_code"] == 1
    assert [f["check"] for f in data["findings"] if f["severity"] == "error"] == ["manifest-invalid"]


def test_a_file_of_a_fingerprinted_folder_is_checked_against_the_folder_manifest_when_verified_alone(
        tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-9"
    folder.mkdir()
    st.save_file(_state(), str(folder / "model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.randn(64, 32)}}, "param_groups": [{"lr": 0.1}]},
               folder / "optimizer.bin")
    assert _run("fingerprint", "--no-progress", "--trust-uncheckable", str(folder))[0] == 0
    for name in ("model.safetensors", "optimizer.bin"):  # weights by their names, others as FILE:PATH
        data = _json("verify", "--no-progress", str(folder / name))
        assert data["exit_code"] == 0 and data["stats"]["manifest"] is True, data["findings"]
        assert not [f for f in data["findings"] if f["severity"] != "info"], data["findings"]
    _flip_last_tensor_byte(folder / "model.safetensors")
    data = _json("verify", "--no-progress", str(folder / "model.safetensors"))
    assert data["exit_code"] == 1
    assert [f["location"]["fqn"] for f in data["findings"] if f["location"].get("fqn")] == ["net.2.weight"]


def _safetensors_with_first_byte_0x80(path: Path) -> None:
    """A plain ``save_file`` whose header length has 0x80 as its low byte (one header length in 32)."""
    for n in range(1, 400):
        st.save_file({"w" * n: torch.zeros(2)}, str(path))
        if path.read_bytes()[0] == 0x80:
            return
    raise AssertionError("no header length ending in 0x80 found")


def test_a_safetensors_file_is_never_named_a_legacy_torch_save(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    _safetensors_with_first_byte_0x80(folder / "model.safetensors")
    torch.save({"w": torch.ones(3)}, folder / "legacy.pt", _use_new_zipfile_serialization=False)
    for target in (folder, folder / "model.safetensors"):
        data = _json("verify", "--no-progress", str(target))
        messages = [f["message"] for f in data["findings"] if f["location"].get("file") == "model.safetensors"]
        assert messages and all("legacy" not in m for m in messages), messages
        assert any("is safetensors" in m for m in messages), messages
    data = _json("verify", "--no-progress", str(folder / "legacy.pt"))
    assert any("legacy (non-zip) torch.save" in f["message"] for f in data["findings"])


# ------------------------------------------------------------------ 11: diff compares what can be compared


def test_diff_compares_the_intact_tensors_of_a_damaged_side_and_names_the_damaged_one(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    st.save_file(_state(), str(a))
    st.save_file(_state(), str(b))
    assert _run("fingerprint", "--no-progress", "--trust-uncheckable", str(b))[0] == 0
    _flip_last_tensor_byte(b)
    data = _json("diff", "--no-progress", str(a), str(b))
    assert data["exit_code"] == 1
    assert data["stats"]["tensors_compared"] == 2 and data["stats"]["tensors_not_compared"] == 1
    uncompared = [f for f in data["findings"] if f["check"] == "diff-uncompared"]
    assert [f["location"]["fqn"] for f in uncompared] == ["net.2.weight"]
    assert "damaged in B" in uncompared[0]["message"]
    assert not [f for f in data["findings"] if f["check"] == "diff-nothing-compared"]
    # A difference in an intact tensor is still found next to the damage.
    changed = _state()
    changed["net.0.bias"][5] += 1.0
    st.save_file(changed, str(a))
    data = _json("diff", "--no-progress", str(a), str(b))
    assert [f["location"]["fqn"] for f in data["findings"] if f["check"] == "diff-tensor"] == ["net.0.bias"]


def test_diff_of_a_torch_save_file_with_one_corrupt_record_compares_the_rest(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"model": _state(), "step": 3}, a)
    torch.save({"model": _state(), "step": 3}, b)
    data = bytearray(b.read_bytes())
    weight = _state()["net.2.weight"].numpy().tobytes()
    at = bytes(data).index(weight)
    data[at + 10] ^= 0x04
    b.write_bytes(data)
    report = diff_checkpoints(a, b, jobs=1)
    assert report.stats["tensors_compared"] == 2 and report.stats["values_compared"] >= 1
    assert [f.location.fqn for f in report.findings if f.check == "diff-uncompared"] == ["model.net.2.weight"]
    assert not [f for f in report.errors if f.check.startswith("diff-")]


def test_diff_maps_name_prefixes(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    st.save_file(_state(), str(a))
    st.save_file({f"model.{k}": v for k, v in _state().items()}, str(b))
    assert _run("diff", "--no-progress", str(a), str(b))[0] == 1
    for spec in ("net.=model.net.", "=model."):
        data = _json("diff", "--no-progress", "--map-prefix", spec, str(a), str(b))
        assert data["exit_code"] == 0, data["findings"]
        assert data["stats"]["tensors_compared"] == 3 and data["stats"]["mapped"] == 3
    # The reverse direction strips the prefix; the Python API takes the same mappings.
    assert diff_checkpoints(b, a, jobs=1, map_prefix=["model.="]).exit_code == 0
    assert diff_checkpoints(b, a, jobs=1, map_prefix=[("model.", "")]).exit_code == 0
    # A difference is reported under both names.
    changed = {f"model.{k}": v.clone() for k, v in _state().items()}
    changed["model.net.0.bias"][0] += 1
    st.save_file(changed, str(b))
    report = diff_checkpoints(a, b, jobs=1, map_prefix=["net.=model.net."])
    (bad,) = [f for f in report.errors]
    assert bad.check == "diff-tensor" and "'net.0.bias' (A)" in bad.message and "'model.net.0.bias' (B)" in bad.message


@pytest.mark.parametrize("spec", ["net.", "=", "a=b=c", "net.=x\x1b"])
def test_a_malformed_prefix_mapping_exits_2(tmp_path: Path, spec: str) -> None:
    a = tmp_path / "a.safetensors"
    st.save_file(_state(), str(a))
    code, out = _run("diff", "--no-progress", "--map-prefix", spec, str(a), str(a))
    assert code == 2 and "--map-prefix" in out and "Traceback" not in out
    data = _json("diff", "--no-progress", "--map-prefix", spec, str(a), str(a))
    assert data["exit_code"] == 2 and "--map-prefix" in data["error"]
    with pytest.raises(UsageError):
        diff_checkpoints(a, a, map_prefix=[spec])


def test_a_mapping_that_merges_two_names_and_a_repeated_prefix_exit_2(tmp_path: Path) -> None:
    a = tmp_path / "a.safetensors"
    st.save_file({"x.w": torch.ones(2), "y.w": torch.ones(2)}, str(a))
    assert _run("diff", "--map-prefix", "x.=y.", str(a), str(a))[0] == 2
    assert _run("diff", "--map-prefix", "x.=a.", "--map-prefix", "x.=b.", str(a), str(a))[0] == 2
    with pytest.raises(UsageError):
        diff_checkpoints(a, a, map_prefix="x.=y.")  # one string, not a list of them


# ------------------------------------------------------------------ 12: scan of a checkpoint folder itself


def _hf_model(folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(folder))


def test_scan_finds_the_hugging_face_folder_it_is_given(tmp_path: Path) -> None:
    out = tmp_path / "output_dir"
    _hf_model(out)  # trainer.save_model(output_dir): the final model beside the checkpoint-N folders
    _hf_model(out / "checkpoint-500")
    data = _json("scan", str(out / "checkpoint-500"))
    assert [(r["path"], r["format"], r["step"]) for r in data["stats"]["checkpoints"]] == [(".", "hf", 500)]
    data = _json("scan", str(out))
    assert sorted((r["path"], r["step"]) for r in data["stats"]["checkpoints"]) == [
        (".", None), ("checkpoint-500", 500)]
    # Fingerprinted, the folder is verified through the same routing verify uses.
    assert _run("fingerprint", "--no-progress", "--trust-uncheckable", str(out / "checkpoint-500"))[0] == 0
    data = _json("scan", str(out / "checkpoint-500"))
    assert data["exit_code"] == 0 and data["stats"]["checkpoints"][0]["state"] == "verified"


def test_scan_finds_the_dcp_checkpoint_it_is_given(tmp_path: Path) -> None:
    import ckptverify

    ckptverify.save({"model": {"w": torch.randn(32, 8)}, "step": 4}, tmp_path / "step_4")
    data = _json("scan", str(tmp_path / "step_4"))
    assert [(r["path"], r["format"], r["step"], r["state"]) for r in data["stats"]["checkpoints"]] == [
        (".", "dcp", 4, "verified")]


# ------------------------------------------------------------------ 13: output


def test_single_file_verify_shows_no_zero_rate_and_suggests_fingerprint(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    st.save_file(_state(), str(path))
    code, out = _run("verify", "--no-progress", str(path), columns=400)
    assert code == 0
    assert "(0 B/s)" not in out
    assert re.search(r"1 files, [\d.]+ KiB in [\d.]+ s", out)
    data = _json("verify", "--no-progress", str(path))
    advice = [f for f in data["findings"] if f["check"] == "fingerprint-advice"]
    assert len(advice) == 1 and "ckptverify fingerprint" in advice[0]["message"]
    # Once fingerprinted: no advice, no uncheckable warning.
    assert _run("fingerprint", "--no-progress", "--trust-uncheckable", str(path))[0] == 0
    data = _json("verify", "--no-progress", str(path))
    assert {f["check"] for f in data["findings"]} & {"fingerprint-advice", "content-uncheckable"} == set()
    # A damaged file is never advised to be fingerprinted.
    torch.save({"w": torch.randn(300)}, tmp_path / "bad.pt")
    raw = bytearray((tmp_path / "bad.pt").read_bytes())
    raw[len(raw) // 2] ^= 1
    (tmp_path / "bad.pt").write_bytes(raw)
    data = _json("verify", "--no-progress", str(tmp_path / "bad.pt"))
    assert data["exit_code"] == 1 and not [f for f in data["findings"] if f["check"] == "fingerprint-advice"]


def test_fingerprint_of_a_single_file_names_the_manifest_it_writes(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    st.save_file(_state(), str(path))
    data = _json("fingerprint", "--no-progress", "--trust-uncheckable", str(path))
    (written,) = [f for f in data["findings"] if f["check"] == "manifest-written"]
    assert written["location"]["file"] == "model.safetensors.ckptverify.manifest.json"


def test_scan_text_shows_every_error_it_counts_and_incomplete_rows_say_no_error(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run"
    dcp.save({"w": torch.ones(8)}, checkpoint_id=str(run / "step-1"))
    os.remove(run / "step-1" / ".metadata")
    code, out = _run("scan", str(run), columns=400)
    assert code == 1
    assert "scan-no-good-checkpoint" in out and "none of the 1 checkpoint(s)" in out
    assert "1 incomplete" in out
    data = _json("scan", str(run))
    (row,) = [f for f in data["findings"] if f["check"] == "scan"]
    assert row["severity"] == "warning" and "error(s)" not in row["message"]


def test_verify_help_names_files_and_folders_not_only_dcp() -> None:
    code, out = _run("verify", "--help")
    assert code == 0
    assert "DCP checkpoint directory" not in out
    assert "safetensors" in out and "NAME.ckptverify.manifest.json" in out


def test_numbers_are_never_broken_across_lines_at_80_columns() -> None:
    from ckptverify.render.report import render_text

    numbers = ["-1.1920928955078125e-07", "0.0012345314025878906", "123456789012345678901234"]
    report = Report(command="diff", target="a b", findings=(
        error("content-uncheckable", f"'layer.attention.self.query.weight' differs: max |a-b| {numbers[0]}, "
              f"mean {numbers[1]}, count {numbers[2]}",
              location=Location(file="pytorch_model-00001-of-00002.bin", fqn="layer.attention.self.query.weight",
                                byte_range=(1234567, 7654321))),
    ))
    console = Console(width=80, record=True, highlight=False)
    render_text(report, console)
    text = console.export_text()
    cells = "".join(line.split("│")[4] if line.count("│") >= 5 else "" for line in text.splitlines())
    for number in numbers:
        assert any(number in line for line in text.splitlines()), (number, text)
    assert "differs" in cells
