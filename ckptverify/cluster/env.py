"""Whether this process is one rank of a distributed command, and where the ranks meet, from the environment.

Launchers: ``torchrun`` (``TORCHELASTIC_RUN_ID``); Slurm ``srun`` (``SLURM_PROCID`` with ``SLURM_STEP_NUM_TASKS``
above 1, which only ``srun`` sets: a batch script's own ``verify`` runs alone; ``MASTER_ADDR``/``MASTER_PORT``
must be set by the job script); ``--readers N`` (``CKPTVERIFY_CLUSTER=local``). A world of one is no cluster.
``--no-cluster`` / ``CKPTVERIFY_CLUSTER=off`` forces one process (e.g. a ``verify`` inheriting a training job's
variables).
"""

from __future__ import annotations

import dataclasses
import os
import re

from ckptverify.errors import UsageError


@dataclasses.dataclass(frozen=True)
class ClusterEnv:
    """This process's place among the ranks: ``launcher`` is ``torchrun``, ``slurm`` or ``local``."""

    rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str


def detect(environ: dict[str, str] | None = None) -> ClusterEnv | None:
    """The cluster this process is a rank of, or ``None``. :class:`~ckptverify.errors.UsageError` naming what to set
    when a recognised launcher lacks a needed variable."""
    env = os.environ if environ is None else environ
    if env.get("CKPTVERIFY_CLUSTER") == "off":
        return None
    local = env.get("CKPTVERIFY_CLUSTER") == "local"
    if local or env.get("TORCHELASTIC_RUN_ID"):
        launcher, world_key, rank_key = "local" if local else "torchrun", "WORLD_SIZE", "RANK"
    elif env.get("SLURM_PROCID") is not None and env.get("SLURM_STEP_NUM_TASKS"):
        launcher, world_key, rank_key = "slurm", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"
    else:
        return None
    world = _int(env, world_key, launcher)
    if world <= 1:
        return None
    rank = _int(env, rank_key, launcher)
    if launcher == "slurm":
        # Tasks on the first node of a ``TASKS_PER_NODE`` spec (``4(x2),3``), taken as this node's.
        m = re.match(r"\s*(\d+)", env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or "")
        local_world = int(m.group(1)) if m else 1
    else:
        local_world = _int(env, "LOCAL_WORLD_SIZE", launcher) if env.get("LOCAL_WORLD_SIZE") else world
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} is outside the world of {world} ranks the {launcher} environment gives")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise UsageError(
            f"running as rank {rank} of {world} under {launcher}, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: set MASTER_ADDR to rank 0's host name and MASTER_PORT "
            "to a free TCP port on it, the same on every rank (e.g. in the job script: "
            "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) MASTER_PORT=29511), "
            "or pass --no-cluster to verify in this one process")
    port = _int(env, "MASTER_PORT", launcher)
    if not 0 < port < 65536:
        raise UsageError(f"MASTER_PORT={port} is not a TCP port")
    return ClusterEnv(rank=rank, world_size=world, local_world_size=max(1, local_world),
                      master_addr=env["MASTER_ADDR"], master_port=port, launcher=launcher)


def _int(env: dict[str, str] | os._Environ[str], key: str, launcher: str) -> int:
    value = env.get(key)
    try:
        return int(str(value).strip())
    except ValueError:
        raise UsageError(f"running under {launcher}, {key} must be an integer, got {value!r}") from None


def cores_per_rank(local_world_size: int) -> int:
    """Worker threads per rank by default: this node's usable cores shared among the ranks that run on it."""
    from ckptverify.checks.dcp_pipeline import default_jobs

    return max(1, default_jobs() // max(1, local_world_size))
