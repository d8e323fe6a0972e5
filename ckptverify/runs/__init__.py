"""A training run's checkpoints over time: which exist and their state (:mod:`~.scan`, :mod:`~.states`), the
verification stamp (:mod:`~.stamp`), which to resume from (:mod:`~.latest`), which to delete (:mod:`~.prune`).
Verifying each save as it happens is :mod:`ckptverify.verifier`."""
