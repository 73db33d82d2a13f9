"""engine/cuda/bits.py: the simulator's stand-ins agree with the GPU instructions' rules."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cuda.bits import _bits_float_sim, _byte_perm_sim, _float_bits_sim

X, Y = 0x33221100, 0x77665544  # bytes 0-3 and 4-7 of the pool


@pytest.mark.parametrize(
    ("selector", "want"),
    [
        (0x3210, 0x33221100),  # x as is
        (0x7654, 0x77665544),  # y as is
        (0x0123, 0x00112233),  # x reversed
        (0x7650, 0x77665500),  # the kv_load pattern: byte 0 of x under y's upper bytes
        (0x7653, 0x77665533),
        (0x4567, 0x44556677),
    ],
)
def test_byte_perm_selects_bytes_of_y_x(selector, want):
    got = int(_byte_perm_sim(X, Y, selector)) & 0xFFFFFFFF
    assert got == want


def test_byte_perm_takes_negative_words():
    """Words come in as signed ints (int8 codes, 0x8... patterns): only their 32 bits count."""
    assert int(_byte_perm_sim(-1, 0, 0x4440)) & 0xFFFFFFFF == 0x000000FF
    assert int(_byte_perm_sim(np.int32(-2), 0x4B000000, 0x7650)) & 0xFFFFFFFF == 0x4B0000FE


def test_magic_bits_give_the_code():
    """0x4B000000 | c is the float 2^23 + c (kv_load's integer-to-float path)."""
    for c in (0, 1, 8, 15, 255):
        assert float(_bits_float_sim(0x4B000000 | c)) - 2.0**23 == c
        assert _float_bits_sim(_bits_float_sim(0x4B000000 | c)) == 0x4B000000 | c


def test_nibble_bits_give_the_code_through_word_affine():
    """A stored nibble c (code + 8) permuted into byte 2 of 0.5 is the float 0.5 + c / 256, and
    kv_load.word_affine's factor and offset turn it back into the code exactly."""
    from engine.cuda.kv_load import _HALF_BITS, _HALF_OF_BYTE, word_affine

    factor, offset = word_affine(4)
    word = 0x0F080100  # nibbles 0, 1, 8, 15 in bytes 0-3
    for k, c in enumerate((0, 1, 8, 15)):
        x = np.float32(_bits_float_sim(_byte_perm_sim(word, _HALF_BITS, _HALF_OF_BYTE[k])))
        assert x == np.float32(0.5 + c / 256)
        assert np.float32(factor) * (x - np.float32(offset)) == c - 8
    assert word_affine(8) == (1.0, 0.0)  # 8-bit words unpack to the code itself
