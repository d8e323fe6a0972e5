"""The audit commands over a checkpoint: verify, fingerprint (adopt), diff."""
