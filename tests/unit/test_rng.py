"""RNG capture/restore: bitwise-equal next draws, through DCP, in a fresh process, and per rank."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.multiproc import spawn_ranks
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.state.digest import state_digest
from ckptverify.state.rng import (
    RngState,
    capture_rng,
    derive_seed,
    rank_key,
    reseed_rng,
    restore_rng,
)

HERE = Path(__file__).resolve().parent  # this file's folder; its parent, tests/, holds the shared helpers
N = 64


def _draw(gen: torch.Generator) -> dict[str, str]:
    """Draw from every stream; each result as hex of its exact bytes, so equality is bitwise."""
    py = [random.random() for _ in range(N)] + [random.gauss(0.0, 1.0) for _ in range(3)]
    np_uniform = np.random.random(N)
    np_normal = np.random.standard_normal(3)
    torch_cpu = torch.rand(N)
    named = torch.rand(N, generator=gen)
    dropout = torch.nn.Dropout(p=0.5)
    dropout.train()
    mask = dropout(torch.ones(N))
    return {
        "python": b"".join(np.float64(x).tobytes() for x in py).hex(),
        "numpy": (np_uniform.tobytes() + np_normal.tobytes()).hex(),
        "torch_cpu": torch_cpu.numpy().tobytes().hex(),
        "named": named.numpy().tobytes().hex(),
        "dropout": mask.numpy().tobytes().hex(),
    }


def _scramble(gen: torch.Generator | None = None, seed: int = 12345) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if gen is not None:
        gen.manual_seed(seed + 1)


def _prime_gauss() -> None:
    """Leave a cached gaussian in python's and numpy's state, so those fields are exercised too."""
    random.gauss(0.0, 1.0)
    np.random.standard_normal(1)


# ----------------------------------------------------------------------------------- in process


def test_capture_restore_next_draws_bitwise_equal() -> None:
    gen = torch.Generator().manual_seed(7)
    _scramble(gen, 3)
    _prime_gauss()
    state = capture_rng({"loader": gen})
    assert state["python"]["has_gauss_next"] is True
    assert state["numpy"]["has_gauss"] == 1
    expected = _draw(gen)
    _scramble(gen)
    assert _draw(gen) != expected
    restore_rng(state, {"loader": gen})
    assert _draw(gen) == expected
    # Restoring again replays again: the captured state is a copy, not a view of live generator state.
    restore_rng(state, {"loader": gen})
    assert _draw(gen) == expected


def test_every_kind_is_captured_and_restored() -> None:
    gen = torch.Generator().manual_seed(1)
    state = capture_rng({"loader": gen, "dropout": torch.Generator().manual_seed(2)})
    kinds = set(state)
    assert {"python", "numpy", "torch_cpu", "gen.loader", "gen.dropout"} <= kinds
    assert not any(k.startswith("cuda.") for k in kinds)  # never a stream per visible device
    # The rank's own device's stream, only in a process that uses CUDA (tests/unit/test_rng_cuda_roles.py).
    assert ("cuda" in kinds) == ("cuda_device" in kinds) == torch.cuda.is_initialized()
    assert state["gen.loader"]["device"] == "cpu"
    assert state["torch_cpu"].dtype == torch.uint8
    assert state["numpy"]["keys"].shape == (624,)


def _fingerprints(state: dict[str, object]) -> dict[str, str]:
    return {kind: state_digest(value) for kind, value in state.items()}


def test_fingerprints_stable_and_sensitive() -> None:
    gen = torch.Generator().manual_seed(5)
    state = capture_rng({"loader": gen})
    fp = _fingerprints(state)
    assert set(fp) == set(state)
    assert all(len(v) == 32 for v in fp.values())
    _draw(gen)
    after = _fingerprints(capture_rng({"loader": gen}))
    assert all(after[k] != fp[k] for k in ("python", "numpy", "torch_cpu", "gen.loader"))
    restore_rng(state, {"loader": gen})
    assert _fingerprints(capture_rng({"loader": gen})) == fp
    # Only the values count: a non-contiguous copy of a tensor digests the same.
    copy = dict(state)
    copy["torch_cpu"] = torch.stack([state["torch_cpu"], state["torch_cpu"]], dim=1)[:, 0]
    assert not copy["torch_cpu"].is_contiguous()
    assert _fingerprints(copy) == fp


def test_restore_refuses_mismatched_generators() -> None:
    gen = torch.Generator().manual_seed(5)
    state = capture_rng({"loader": gen})
    with pytest.raises(UsageError, match="generators"):
        restore_rng(state)
    with pytest.raises(UsageError, match="generators"):
        restore_rng(state, {"other": gen})
    with pytest.raises(UsageError, match=r"not a torch\.Generator"):
        capture_rng({"loader": 3})  # type: ignore[dict-item]
    with pytest.raises(UsageError, match="unknown RNG state kinds"):
        restore_rng({**state, "bogus": 1}, {"loader": gen})
    bad = dict(state)
    bad["torch_cpu"] = state["torch_cpu"].to(torch.int64)
    before = _fingerprints(capture_rng({"loader": gen}))
    with pytest.raises(UsageError, match="torch_cpu"):
        restore_rng(bad, {"loader": gen})
    # Validation happens before any stream is touched.
    assert _fingerprints(capture_rng({"loader": gen})) == before


def test_rank_key() -> None:
    assert rank_key(3) == "rank3"
    for bad in (-1, True, "1"):
        with pytest.raises(UsageError):
            rank_key(bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- DCP, fresh process


def _fresh_process_restore(ckpt: str, out: str) -> None:
    """Run in a new interpreter: load the checkpoint into a fresh RngState, restore, draw."""
    warnings.simplefilter("ignore")
    gen = torch.Generator()
    _scramble(gen, 999)
    rng = RngState({"loader": gen})
    template = rng.state_dict()
    dcp.load(template, checkpoint_id=ckpt)
    rng.load_state_dict(template)
    result = {"draws": _draw(gen)}
    Path(out).write_text(json.dumps(result))


def test_dcp_round_trip_restores_in_fresh_process(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(11)
    _scramble(gen, 4)
    _prime_gauss()
    rng = RngState({"loader": gen})
    sd = rng.state_dict()
    assert set(sd) == {"version", "world_size", "rank0"}
    ckpt = tmp_path / "ckpt"
    dcp.save(sd, checkpoint_id=str(ckpt))
    keys = set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert {"rank0.torch_cpu", "rank0.gen.loader.state", "rank0.python.state", "rank0.numpy.keys"} <= keys
    restore_rng(sd["rank0"], {"loader": gen})
    expected = _draw(gen)

    # In this process: DCP's Stateful path (template from state_dict(), then load_state_dict).
    _scramble(gen)
    again = RngState({"loader": gen})
    loaded = again.state_dict()  # the template: current (scrambled) state, same shapes
    dcp.load(loaded, checkpoint_id=str(ckpt))
    again.load_state_dict(loaded)
    assert _draw(gen) == expected

    out = tmp_path / "fresh.json"
    code = (
        f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]; import test_rng; "
        f"test_rng._fresh_process_restore({str(ckpt)!r}, {str(out)!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, "PYTHONHASHSEED": "1"})
    result = json.loads(out.read_text())
    assert result["draws"] == expected


def test_dcp_stateful_protocol(tmp_path: Path) -> None:
    """``dcp.save``/``dcp.load`` drive RngState through state_dict()/load_state_dict() themselves."""
    gen = torch.Generator().manual_seed(21)
    rng = RngState({"loader": gen})
    saved = capture_rng({"loader": gen})
    dcp.save({"rng": rng}, checkpoint_id=str(tmp_path))
    restore_rng(saved, {"loader": gen})
    expected = _draw(gen)
    _scramble(gen)
    dcp.load({"rng": RngState({"loader": gen})}, checkpoint_id=str(tmp_path))
    assert _draw(gen) == expected


# ----------------------------------------------------------------------------------- 2 ranks


def _two_rank_worker(rank: int, world: int, ckpt: str, out_dir: str) -> None:
    warnings.simplefilter("ignore")
    gen = torch.Generator()
    _scramble(gen, 100 + rank)  # different streams on each rank
    rng = RngState({"loader": gen})
    assert (rng.rank, rng.world_size) == (rank, world)
    sd = rng.state_dict()
    own_cpu = sd[rank_key(rank)]["torch_cpu"].clone()
    # The trap: the same key on every rank. DCP keeps one copy.
    dcp.save({"rng": sd, "naive": {"torch_cpu": own_cpu.clone()}}, checkpoint_id=ckpt)
    restore_rng(sd[rank_key(rank)], {"loader": gen})
    expected = _draw(gen)
    _scramble(gen, 7)  # same junk state on both ranks
    fresh = RngState({"loader": gen})
    naive = {"torch_cpu": torch.zeros_like(own_cpu)}
    dcp.load({"rng": fresh, "naive": naive}, checkpoint_id=ckpt)
    report = {
        "expected": expected,
        "got": _draw(gen),
        "naive_is_own": bool(torch.equal(naive["torch_cpu"], own_cpu)),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def test_two_ranks_one_checkpoint_each_restores_its_own(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    spawn_ranks(_two_rank_worker, 2, str(ckpt), str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in reports:
        assert r["got"] == r["expected"]
    assert reports[0]["expected"] != reports[1]["expected"]
    keys = set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert {"rng.rank0.torch_cpu", "rng.rank1.torch_cpu", "rng.world_size"} <= keys
    # The unkeyed copy shows why keying matters: one rank did not get its own state back.
    assert reports[0]["naive_is_own"] != reports[1]["naive_is_own"]


# ----------------------------------------------------------------------------------- world size


def test_world_size_change_raises() -> None:
    sd = RngState(rank=0, world_size=2).state_dict()
    with pytest.raises(UsageError, match=r"saved by 2 rank.*this job has 1") as info:
        RngState(rank=0, world_size=1).load_state_dict(sd)
    assert isinstance(info.value, UsageError)
    assert isinstance(info.value, CkptVerifyError)
    assert info.value.exit_code == 2


def test_world_size_change_through_dcp_partial_load(tmp_path: Path) -> None:
    """A rank of a larger job finds no key of its own; the saved world size still stops the restore."""
    dcp.save({"rng": RngState(rank=0, world_size=1)}, checkpoint_id=str(tmp_path))
    grown = RngState(rank=1, world_size=2)
    with pytest.raises(UsageError):
        dcp.load({"rng": grown}, checkpoint_id=str(tmp_path), planner=DefaultLoadPlanner(allow_partial_load=True))


def test_world_size_change_with_reseed_is_deterministic_and_warns() -> None:
    sd = RngState(rank=0, world_size=4).state_dict()
    draws = []
    for _ in range(2):
        gen = torch.Generator()
        _scramble(gen, len(draws))
        rng = RngState({"loader": gen}, rank=1, world_size=2, allow_reseed=True, seed=42)
        rng.load_state_dict(sd)
        assert len(rng.warnings) == 1
        assert "from 4 to 2" in rng.warnings[0]
        assert "not bitwise identical" in rng.warnings[0]
        draws.append(_draw(gen))
    assert draws[0] == draws[1]

    gen = torch.Generator()
    RngState({"loader": gen}, rank=0, world_size=2, allow_reseed=True, seed=42).load_state_dict(sd)
    other_rank = _draw(gen)
    assert all(other_rank[k] != draws[0][k] for k in draws[0])
    # Named generators get seeds unrelated to the global one.
    assert derive_seed(42, 1, "torch_cpu") != derive_seed(42, 1, "gen.loader")


def test_reseed_is_reproducible() -> None:
    gen = torch.Generator()
    reseed_rng(3, 0, {"loader": gen})
    a = _draw(gen)
    reseed_rng(3, 0, {"loader": gen})
    assert _draw(gen) == a


def test_a_state_only_setting_can_refuse_leaves_every_stream_as_it_was() -> None:
    """The Python stream is valid and set first; numpy refuses its own (an unknown bit generator): the Python stream
    is put back, so a refused restore never leaves some streams restored and others not."""
    gen = torch.Generator().manual_seed(5)
    saved = capture_rng({"loader": gen})
    random.random()
    np.random.random()
    gen.seed()
    before = _fingerprints(capture_rng({"loader": gen}))
    bad = {**saved, "numpy": {**saved["numpy"], "bit_generator": "PCG64"}}
    with pytest.raises(UsageError, match="numpy"):
        restore_rng(bad, {"loader": gen})
    assert _fingerprints(capture_rng({"loader": gen})) == before


def test_load_refuses_foreign_rank_and_bad_version() -> None:
    sd = RngState(rank=0, world_size=2).state_dict()
    with pytest.raises(UsageError, match="rank1"):
        RngState(rank=1, world_size=2).load_state_dict(sd)
    with pytest.raises(UsageError, match="version"):
        RngState(rank=0, world_size=2).load_state_dict({**sd, "version": 99})
    with pytest.raises(UsageError, match="out of range"):
        RngState(rank=2, world_size=2)


def test_malformed_states_are_refused_before_any_stream_changes() -> None:
    """Each hostile shape of a saved RNG state is refused with a message naming what is wrong, streams untouched."""
    gen = torch.Generator().manual_seed(5)
    state = capture_rng({"loader": gen})
    before = _fingerprints(capture_rng({"loader": gen}))
    cases = [
        ([1, 2], "must be a mapping"),
        ({k: v for k, v in state.items() if k != "numpy"}, "lacks"),
        ({**state, "gen.loader": {"state": state["gen.loader"]["state"]}}, "has no field 'device'"),
        ({**state, "gen.loader": {**state["gen.loader"], "device": "meta"}}, "captured on meta"),
        ({**state, "python": {**state["python"], "version": 99}}, "not a valid random.getstate"),
    ]
    for bad, message in cases:
        with pytest.raises(UsageError, match=message):
            restore_rng(bad, {"loader": gen})  # type: ignore[arg-type]
        assert _fingerprints(capture_rng({"loader": gen})) == before
    with pytest.raises(UsageError, match="mapping of name"):
        capture_rng([gen])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="non-empty strings"):
        capture_rng({"": gen})
    with pytest.raises(UsageError, match="positive int"):
        RngState(rank=0, world_size=0)
    sd = RngState(rank=0, world_size=1).state_dict()
    with pytest.raises(UsageError, match="must be a mapping"):
        RngState(rank=0, world_size=1).load_state_dict([sd])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="no valid world_size"):
        RngState(rank=0, world_size=1).load_state_dict({**sd, "world_size": "1"})


# ----------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generators_restored() -> None:
    """The rank's own device's stream, restored into the device the rank uses, whatever its index."""
    torch.cuda.init()
    state = capture_rng()
    index = torch.cuda.current_device()
    assert state["cuda_device"]["index"] == index and not any(k.startswith("cuda.") for k in state)
    expected = torch.rand(N, device="cuda").cpu()
    torch.cuda.manual_seed_all(777)
    restore_rng(state)
    assert torch.equal(torch.rand(N, device="cuda").cpu(), expected)
    if torch.cuda.device_count() > 1:
        other = (index + 1) % torch.cuda.device_count()
        with torch.cuda.device(other):  # another layout: the rank now uses another index
            torch.cuda.manual_seed_all(777)
            restore_rng(state)
            assert torch.equal(torch.rand(N, device=f"cuda:{other}").cpu(), expected)
    gen = torch.Generator(device="cuda:0").manual_seed(3)
    st = capture_rng({"g": gen})
    assert st["gen.g"]["device"].startswith("cuda")
    first = torch.rand(N, device="cuda:0", generator=gen).cpu()
    restore_rng(st, {"g": gen})
    assert torch.equal(torch.rand(N, device="cuda:0", generator=gen).cpu(), first)
    with pytest.raises(UsageError, match="captured on"):
        restore_rng(st, {"g": torch.Generator()})
