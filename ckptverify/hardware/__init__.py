"""Hardware faults seen from the training job: which device a rank runs on (:mod:`~.hostinfo`), replica consistency
(:mod:`~.replica`), and bit-flip injection for tests and fire drills (:mod:`~.inject`)."""
