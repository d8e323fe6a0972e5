"""Resume equivalence: the ``Run`` protocol, the harness that runs A / A2 / B, and the verdict."""
