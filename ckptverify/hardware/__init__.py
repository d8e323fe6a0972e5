"""Hardware faults seen from the training job: which device a rank runs on, replica consistency, and fault
injection for tests and fire drills.

- :mod:`~ckptverify.hardware.hostinfo`: what a fault report must name (host, device, versions, settings).
- :mod:`~ckptverify.hardware.replica`: ranks that must hold identical values compare 128-bit digests.
- :mod:`~ckptverify.hardware.inject`: flip one bit of a chosen tensor, on a chosen rank, at a chosen step.
"""
