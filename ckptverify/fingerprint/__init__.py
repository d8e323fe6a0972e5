"""Byte digests and the logical tensor fingerprint (``docs/fingerprint.md``).

**Byte digests** (:mod:`~ckptverify.fingerprint.digest`: xxh3-128, or sha256 for tamper evidence) identify exact
bytes, per range and per block. The **logical fingerprint** (:mod:`~ckptverify.fingerprint.logical`) identifies a
tensor's *values* whatever its sharding or serialization: :func:`tensor_fingerprint`, :func:`chunk_fingerprint`,
:func:`combine`; wrapper subclasses by their parts (:func:`part_fingerprints`).

Modules depend one way: ``spec`` (constants, the one :func:`~ckptverify.fingerprint.spec.mix`) <- ``digest``,
``logical`` <- ``kernels`` <- ``triton_kernel``, ``eager`` (the reference); ``device`` sits below ``kernels``.
Importing the package imports no torch.
"""

from __future__ import annotations

from ckptverify.fingerprint.digest import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    DEFAULT_BLOCK_SIZE,
    BlockDigest,
    ByteDigest,
    RangeDigest,
    block_digests,
    digest_bytes,
    digest_file_range,
    digest_reader,
    new_digest,
)
from ckptverify.fingerprint.logical import (
    TensorFingerprint,
    chunk_fingerprint,
    combine,
    get_fingerprint_backend,
    part_fingerprints,
    set_fingerprint_backend,
    tensor_fingerprint,
)
from ckptverify.fingerprint.spec import FINGERPRINT_VERSION

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "DEFAULT_BLOCK_SIZE", "FINGERPRINT_VERSION", "BlockDigest", "ByteDigest",
           "RangeDigest", "TensorFingerprint", "block_digests", "chunk_fingerprint", "combine", "digest_bytes",
           "digest_file_range", "digest_reader", "get_fingerprint_backend", "new_digest", "part_fingerprints",
           "set_fingerprint_backend", "tensor_fingerprint"]
