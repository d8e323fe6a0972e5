"""Replay: re-run production steps from their checkpoints and judge what differs (a hardware fault, or a cause
the trace names)."""
