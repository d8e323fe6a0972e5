"""Checkpoint formats: what a path on disk is, and what it holds. Recognising and describing only: the
checks live in :mod:`ckptverify.checks`, which import this package (never the reverse).

:mod:`~ckptverify.formats.rundir` recognizes a checkpoint by what it holds (DCP metadata and shards, Hugging
Face and accelerate files, single ``torch.save``/safetensors files) and finds every one under a training
run's directory, with the step its name carries; :mod:`~ckptverify.formats.single` recognizes a single file
by its first bytes. :mod:`~ckptverify.formats.describe` turns a file or folder into a
:class:`~ckptverify.formats.describe.Description` (files, tensors with their payloads, values), and
:mod:`~ckptverify.formats.dcp` does the same for a DCP checkpoint from what the DCP pipeline read safely.
"""
