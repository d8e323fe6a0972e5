"""The zstd frame scan refuses what it cannot bound before anything is inflated."""

import pytest
from numcodecs import zstd as nczstd

from ckptverify.safeparse.zstd import decompress

_MAGIC = (0xFD2FB528).to_bytes(4, "little")
_SKIPPABLE = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
# One single-segment frame holding 5 bytes in one raw block (header: last=1, kind=0 raw, length=5).
_RAW_FRAME = _MAGIC + bytes([0x20, 5]) + ((5 << 3) | 1).to_bytes(3, "little") + b"hello"


def test_whole_frames_decode_and_skippable_frames_add_nothing() -> None:
    data = bytes(range(256)) * 40
    frame = bytes(nczstd.compress(data))
    assert decompress(frame, len(data), exact=True) == data
    assert decompress(_SKIPPABLE + _RAW_FRAME, 5) == b"hello"


@pytest.mark.parametrize("raw", [
    _MAGIC[:3],  # shorter than any frame header
    b"\0" * 8,  # no frame magic
    _MAGIC + bytes([0x21, 0, 5]) + _RAW_FRAME[6:],  # names a dictionary
    _MAGIC + bytes([0xE0, 0]),  # cut inside the 8-byte content size
    _MAGIC + bytes([0x20, 5]) + ((5 << 3) | (3 << 1) | 1).to_bytes(3, "little") + b"hello",  # reserved block type
    _RAW_FRAME[:-2],  # the last block runs past the end
])
def test_streams_the_scan_cannot_bound_are_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="corrupt or cut short"):
        decompress(raw, 1 << 20)


def test_a_compressed_block_of_garbage_is_refused_as_corrupt() -> None:
    garbage = _MAGIC + bytes([0x20, 5]) + ((4 << 3) | (2 << 1) | 1).to_bytes(3, "little") + b"\xff" * 4
    with pytest.raises(ValueError, match="the zstd stream is corrupt:"):
        decompress(garbage, 1 << 20)
