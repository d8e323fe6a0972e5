"""Locating one flipped bit from a CRC-32 mismatch."""

from __future__ import annotations

import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptverify.checks.crcflip import MAX_BITS, false_match_probability, locate_single_bit


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=1, max_size=5000), where=st.integers(min_value=0), bit=st.integers(0, 7))
def test_a_single_flipped_bit_is_located_exactly(data, where, bit):
    byte = where % len(data)
    flipped = bytearray(data)
    flipped[byte] ^= 1 << bit
    assert locate_single_bit(zlib.crc32(data), zlib.crc32(bytes(flipped)), len(data)) == (byte, bit)


def test_a_flip_in_a_large_record_is_located():
    data = bytearray(range(256)) * 8192  # 2 MiB
    recorded = zlib.crc32(data)
    data[1_234_567] ^= 0x40
    assert locate_single_bit(recorded, zlib.crc32(data), len(data)) == (1_234_567, 6)


def test_equal_crcs_and_oversized_messages_give_no_answer():
    assert locate_single_bit(0x1234, 0x1234, 100) is None
    assert locate_single_bit(0x1234, 0x4321, MAX_BITS // 8 + 1) is None


def test_a_two_bit_error_in_a_short_message_is_not_mistaken_for_one():
    # In 16 bytes only 128 syndromes are single-bit ones; two flips never produce one of them.
    data = bytearray(b"0123456789abcdef")
    recorded = zlib.crc32(data)
    misses = 0
    for a in range(0, 128, 7):
        for b in range(a + 1, 128, 5):
            d = bytearray(data)
            d[a // 8] ^= 1 << (a % 8)
            d[b // 8] ^= 1 << (b % 8)
            misses += locate_single_bit(recorded, zlib.crc32(d), len(d)) is not None
    assert misses == 0


def test_false_match_probability_grows_with_length():
    assert false_match_probability(1) < false_match_probability(1 << 20) < 0.01
