"""Byte digests and the logical tensor fingerprint.

Two kinds of identity, documented in ``docs/fingerprint.md``:

* **Byte digests** (:mod:`~ckptverify.fingerprint.digest`) identify exact bytes: xxh3-128 by default (fast),
  sha256 when tamper evidence is wanted. :func:`new_digest` gives a streaming digest, :func:`digest_file_range`
  digests a byte range of a file with flat memory, :func:`block_digests` digests fixed-size blocks of a range in
  the same pass, so a mismatch can be narrowed to one block.
* The **logical tensor fingerprint** (:mod:`~ckptverify.fingerprint.logical`) identifies a tensor's *values*,
  independent of how it is sharded or serialized: :func:`tensor_fingerprint` for a whole tensor (or a
  ``DTensor``), :func:`chunk_fingerprint` for one chunk of a global tensor, and :func:`combine` to add chunk
  fingerprints up to the whole. A tensor subclass that keeps its values in inner tensors (torchao's
  ``MXTensor``, ``NVFP4Tensor``) is fingerprinted by its parts (:mod:`~ckptverify.fingerprint.subclass`,
  :func:`part_fingerprints`).

The package's modules depend one way: :mod:`~ckptverify.fingerprint.spec` (the constants and the one definition
of the mixing step, which every path runs) <- ``digest`` and ``logical`` <- ``kernels`` (the paths and the CPU
backend choice) <- ``triton_kernel``, ``eager`` (the reference both check against);
:mod:`~ckptverify.fingerprint.device` (on which GPU and stream a fingerprint runs, and which tensors none may read)
sits below ``kernels`` and ``triton_kernel`` and imports none of them. Importing the
package imports no torch: ``logical`` imports the kernels only when a tensor is fingerprinted, so byte digests
stay cheap to import.
"""

from __future__ import annotations

from ckptverify.fingerprint.digest import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    DEFAULT_BLOCK_SIZE,
    READ_BUFFER_SIZE,
    BlockDigest,
    ByteDigest,
    RangeDigest,
    TruncatedRangeError,
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
from ckptverify.fingerprint.logical import _dtensor_type as _dtensor_type  # tells a DTensor without torch
from ckptverify.fingerprint.spec import FINGERPRINT_VERSION

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "DEFAULT_BLOCK_SIZE",
    "FINGERPRINT_VERSION",
    "READ_BUFFER_SIZE",
    "BlockDigest",
    "ByteDigest",
    "RangeDigest",
    "TensorFingerprint",
    "TruncatedRangeError",
    "block_digests",
    "chunk_fingerprint",
    "combine",
    "digest_bytes",
    "digest_file_range",
    "digest_reader",
    "get_fingerprint_backend",
    "new_digest",
    "part_fingerprints",
    "set_fingerprint_backend",
    "tensor_fingerprint",
]
