"""Checkpoint formats: what a path on disk is, and where the checkpoints of a run directory are.

:mod:`~ckptverify.formats.rundir` recognizes a checkpoint by what it holds (DCP metadata and shards, Hugging
Face and accelerate files, single ``torch.save``/safetensors files) and finds every one under a training
run's directory, with the step its name carries.
"""
