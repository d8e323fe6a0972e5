"""Verification after a save: the background verifier, its process, throttling, stamping, watch, notification."""
