"""Real framework checkpoints for the test suite: producer scripts and the harness that runs them."""
