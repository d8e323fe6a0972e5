"""A training run's checkpoints over time: which exist, which were verified, which to resume from, which to
delete.

- :mod:`~ckptverify.runs.scan`: every checkpoint under a run directory and its state;
- :mod:`~ckptverify.runs.states`: the states a verification gives a checkpoint, and the quarantine;
- :mod:`~ckptverify.runs.stamp`: the verification stamp written beside a verified checkpoint;
- :mod:`~ckptverify.runs.latest`: the newest checkpoint that verifies;
- :mod:`~ckptverify.runs.prune`: retention that never deletes the newest verified checkpoint.

Verifying each checkpoint as it is saved (the background verifier, ``watch``) is :mod:`ckptverify.verifier`.
"""
