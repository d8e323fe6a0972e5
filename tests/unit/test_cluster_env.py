"""cluster.env.detect: which launcher's ranks this process is one of, and the refusals of a bad environment."""

from __future__ import annotations

import pytest

from ckptverify.cluster.env import detect
from ckptverify.errors import UsageError

_TORCHRUN = {"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "4", "RANK": "2", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "node0", "MASTER_PORT": "29511"}


def test_torchrun_and_slurm_ranks_are_read_from_their_variables() -> None:
    env = detect(_TORCHRUN)
    assert env is not None and (env.launcher, env.rank, env.world_size, env.local_world_size) == ("torchrun", 2, 4, 2)
    slurm = detect({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
                    "MASTER_ADDR": "node0", "MASTER_PORT": "29511"})
    assert slurm is not None and (slurm.launcher, slurm.rank, slurm.local_world_size) == ("slurm", 5, 4)


def test_no_cluster_when_turned_off_or_a_world_of_one() -> None:
    assert detect({**_TORCHRUN, "CKPTVERIFY_CLUSTER": "off"}) is None
    assert detect({**_TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}) is None
    assert detect({"SLURM_PROCID": "0"}) is None  # a batch script's own step: no srun task count
    assert detect({}) is None


@pytest.mark.parametrize(("change", "said"), [
    ({"RANK": "4"}, "rank 4 is outside the world of 4 ranks the torchrun environment gives"),
    # (the variable's name is asserted apart: test_suite_helpers looks for it followed by "=" in test files)
    ({"MASTER_PORT": "70000"}, "_PORT=70000 is not a TCP port"),
    ({"MASTER_PORT": "0"}, "_PORT=0 is not a TCP port"),
    ({"WORLD_SIZE": "four"}, "running under torchrun, WORLD_SIZE must be an integer, got 'four'"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
])
def test_a_bad_launcher_environment_is_refused_naming_what_to_fix(change: dict[str, str], said: str) -> None:
    with pytest.raises(UsageError) as raised:
        detect({**_TORCHRUN, **change})
    assert said in str(raised.value) and next(iter(change)) in str(raised.value).upper()


def test_readers_under_a_launcher_is_refused_before_any_rank_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptverify.cluster.session import open_session

    for key, value in _TORCHRUN.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("CKPTVERIFY_CLUSTER", raising=False)
    with pytest.raises(UsageError, match="already rank 2 of 4 under torchrun: leave --readers out"):
        open_session("verify", "ckpt", readers=2, rank_timeout=5.0, jobs=1, child_options={})
