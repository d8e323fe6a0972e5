"""Checkpoint formats: recognising what a path holds and describing it (checks live in :mod:`ckptverify.checks`,
which import this package, never the reverse). ``rundir`` finds checkpoints under a run, ``single`` sniffs a
file, ``describe`` makes a :class:`~ckptverify.formats.describe.Description`, ``dcp`` does so for DCP."""
