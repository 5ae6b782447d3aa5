"""The CPU block decoders (turboquant.decode) and the slot layout they read.

Both must reproduce the plain decode exactly (the attention's scores and
value sums are built on them): scalar codes are ``centroids[unpack(words)]``,
TCQ codes are ``trellis.reconstruct`` of the unpacked indices.
"""

import mlx.core as mx
import numpy as np
import pytest

from turboquant.codebooks import codebook
from turboquant.decode import block_decoder, symmetric_half
from turboquant.packing import pack, packed_words, slot_layout, unpack
from turboquant.trellis import TrellisCodec, reconstruct

DIMS = [64, 80, 96, 128, 256]


def random_words(bits: int, dim: int, n: int, seed: int) -> mx.array:
    """Packed words of random indices (tail bits zero, as pack writes them)."""
    rng = np.random.default_rng(seed)
    return pack(mx.array(rng.integers(0, 1 << bits, size=(n, dim), dtype=np.uint8)), bits)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", DIMS)
def test_slot_layout_reads_every_index(bits, dim):
    lay = slot_layout(bits, dim)
    words = random_words(bits, dim, 7, bits * 1000 + dim)
    slots = ((lay.windows(words) >> mx.array(lay.shifts)) & ((1 << bits) - 1)).reshape(7, -1)
    assert slots.shape[-1] == lay.slots >= dim
    np.testing.assert_array_equal(np.array(lay.from_slots(slots)), np.array(unpack(words, bits, dim)))
    # queries in slot layout: zero in pad slots, so a dot over slots is the dot over indices
    q = mx.random.normal((7, dim), key=mx.random.key(bits))
    qs = lay.to_slots(q)
    pads = lay.index < 0
    assert not np.any(np.array(qs)[:, pads])
    np.testing.assert_allclose(np.array((qs * slots.astype(mx.float32)).sum(-1)),
                               np.array((q * unpack(words, bits, dim).astype(mx.float32)).sum(-1)),
                               rtol=1e-5)
    # the layouts the cache uses most have no pad slots at all
    assert lay.identity == (32 % bits == 0 and (dim * bits) % 32 == 0)


def test_slot_layout_words_and_pads():
    lay = slot_layout(3, 128)
    assert (lay.stride, lay.n_windows, lay.per, lay.slots) == (16, 24, 6, 144)
    assert (lay.index >= 0).sum() == 128
    assert slot_layout(4, 128).stride == 32 and slot_layout(4, 128).slots == 128
    with pytest.raises(ValueError, match="1..16 bits"):
        slot_layout(17, 128)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", DIMS)
def test_scalar_decoder_is_exact(bits, dim):
    words = random_words(bits, dim, 33, bits + dim)
    dec = block_decoder(("scalar", bits, dim))
    ref = np.asarray(codebook(bits, dim).centroids, np.float32)[np.array(unpack(words, bits, dim))]
    np.testing.assert_array_equal(np.array(dec.dense(words)), ref)
    assert dec.codes(words).shape == (33, dec.layout.slots)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [64, 80, 128])
def test_tcq_decoder_is_exact(bits, dim):
    """Parity and sign-magnitude codes computed on words == the per-index decode."""
    codec = TrellisCodec(dim, bits)
    words = random_words(bits, dim, 65, 7 * bits + dim)
    dec = block_decoder(codec.code_key)
    ref = reconstruct(unpack(words, bits, dim).astype(mx.uint32), codec.levels, codec.taps, codec.offsets)
    np.testing.assert_allclose(np.array(dec.dense(words)), np.array(ref), rtol=0, atol=1e-7)
    np.testing.assert_allclose(np.array(codec.unit_codes(words)), np.array(ref), rtol=0, atol=1e-7)
    # offsets are carried separately in slot layout (the attention folds them in)
    if any(codec.offsets):
        np.testing.assert_allclose(np.array(dec.layout.from_slots(dec.offsets)), codec.offsets, atol=1e-7)


def test_tcq_decoder_needs_a_symmetric_codebook():
    assert symmetric_half((-2.0, -1.0, 1.0, 2.0)) == (1.0, 2.0)
    with pytest.raises(ValueError, match="symmetric"):
        symmetric_half((-2.0, -1.0, 1.0, 2.5))


def test_words_per_vector_match_the_layout():
    for bits in (2, 3, 4):
        assert slot_layout(bits, 128).n_windows * slot_layout(bits, 128).stride == 32 * packed_words(128, bits)
