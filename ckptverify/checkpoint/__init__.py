"""Saving and loading a full training state, with its manifest, verified."""
