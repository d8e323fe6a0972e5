"""Checkpoint formats: recognising what a path holds and describing it (checks live in :mod:`ckptverify.checks`,
which import this package, never the reverse). ``rundir`` finds checkpoints under a run, ``describe`` sniffs a
file and makes a :class:`~ckptverify.formats.describe.Description`, ``dcp`` does so for DCP."""
