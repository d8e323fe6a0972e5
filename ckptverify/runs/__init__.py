"""A training run's checkpoints over time: which exist, which were verified, which to resume from, which to
delete.

- :mod:`~ckptverify.runs.scan`: every checkpoint under a run directory and its state;
- :mod:`~ckptverify.runs.stamp`: the verification stamp written beside a verified checkpoint;
- :mod:`~ckptverify.runs.latest`: the newest checkpoint that verifies;
- :mod:`~ckptverify.runs.prune`: retention that never deletes the newest verified checkpoint;
- :mod:`~ckptverify.verifier.watch`: verify each checkpoint as it commits;
- :mod:`~ckptverify.verifier.stamper`: verify one committed checkpoint under its verifying lock, and stamp it;
- :mod:`~ckptverify.verifier.background`: a save's verification after it commits, in a verifier process
  (:mod:`~ckptverify.verifier.worker`) or inline;
- :mod:`~ckptverify.verifier.throttle`: a background verification's pacing, off the cores the training uses.
"""
