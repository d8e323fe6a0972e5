"""Locating where two runs part, below the step a verdict names: :mod:`~ckptverify.resume.locate.walk` re-runs
that step at trace level ``op`` (and the origin op alone, for its kernel), :mod:`~ckptverify.resume.locate.ops`
reads the op logs it records to name the origin rank, module and op, and the receivers."""
