"""Locating where two runs part below a verdict's step: :mod:`~ckptverify.resume.locate.walk` re-runs the step at
level ``op``, :mod:`~ckptverify.resume.locate.ops` reads the op logs to name the origin and receivers."""
