"""Verification after a save: the background verifier, its worker process, throttling, stamping, watch, notification."""
