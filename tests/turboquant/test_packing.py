import mlx.core as mx
import numpy as np
import pytest

from turboquant.packing import pack, packed_words, unpack


def _reference_pack(idx: np.ndarray, bits: int) -> np.ndarray:
    """Bit-by-bit implementation of the documented layout."""
    dim = idx.shape[-1]
    out = np.zeros(idx.shape[:-1] + (packed_words(dim, bits),), dtype=np.uint64)
    for i in range(dim):
        for t in range(bits):
            k = i * bits + t
            bit = (idx[..., i].astype(np.uint64) >> np.uint64(t)) & np.uint64(1)
            out[..., k // 32] |= bit << np.uint64(k % 32)
    return out.astype(np.uint32)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dim", [64, 80, 96, 128, 256, 7])
def test_round_trip_and_layout(bits, dim):
    rng = np.random.default_rng(bits * 1000 + dim)
    idx = rng.integers(0, 2**bits, size=(2, 3, 5, dim), dtype=np.uint8)
    words = pack(mx.array(idx), bits)
    assert words.dtype == mx.uint32
    assert words.shape == (2, 3, 5, packed_words(dim, bits))
    np.testing.assert_array_equal(np.array(words), _reference_pack(idx, bits))
    back = unpack(words, bits, dim)
    assert back.dtype == mx.uint8
    np.testing.assert_array_equal(np.array(back), idx)


def test_word_counts():
    assert packed_words(128, 3) == 12
    assert packed_words(128, 4) == 16
    assert packed_words(80, 3) == 8  # 240 bits: last word has 16 zero tail bits
    assert packed_words(96, 3) == 9


def test_three_bit_straddle_explicit():
    # index 10 occupies stream bits 30..32: two bits in word 0, one in word 1.
    idx = np.zeros(32, dtype=np.uint8)
    idx[10] = 0b111
    words = np.array(pack(mx.array(idx), 3))
    assert words[0] == 0b11 << 30 and words[1] == 1 and words[2] == 0


def test_tail_bits_are_zero():
    idx = np.full((4, 80), 7, dtype=np.uint8)
    words = np.array(pack(mx.array(idx), 3))
    assert np.all(words[:, -1] == 0xFFFF)  # 240 = 7*32 + 16 used bits


def test_wrong_word_count_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 12"):
        unpack(mx.zeros((3, 11), dtype=mx.uint32), 3, 128)
