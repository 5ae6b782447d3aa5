import pytest

from turboquant.widths import ALLOWED_KV_BITS, resolve_bits


@pytest.mark.parametrize(
    "kv_bits,expected",
    [(2, (2, 2)), (2.5, (3, 2)), (3, (3, 3)), (3.5, (4, 3)), (4, (4, 4)), (4.0, (4, 4))],
)
def test_presets(kv_bits, expected):
    assert resolve_bits(kv_bits) == expected


def test_allowed_values_listed():
    assert set(ALLOWED_KV_BITS) == {2, 2.5, 3, 3.5, 4}


def test_default_is_3_5():
    assert resolve_bits() == (4, 3)


def test_separate_widths_and_overrides():
    assert resolve_bits(key_bits=4, value_bits=2) == (4, 2)
    assert resolve_bits(key_bits=3) == (3, 3)
    assert resolve_bits(value_bits=2) == (2, 2)
    assert resolve_bits(3, value_bits=4) == (3, 4)
    assert resolve_bits(2.5, key_bits=4) == (4, 2)
    assert resolve_bits(3.5, key_bits=3) == (3, 3)


@pytest.mark.parametrize("bad", [1.5, 5, 8, 0, 3.25, "3.5", None.__class__, True])
def test_bad_kv_bits_names_allowed(bad):
    with pytest.raises(ValueError) as e:
        resolve_bits(bad)
    assert "2, 2.5, 3, 3.5, 4" in str(e.value)


@pytest.mark.parametrize("bad", [0, 5, 2.5, "3"])
def test_bad_component_bits(bad):
    with pytest.raises(ValueError, match="key_bits"):
        resolve_bits(key_bits=bad)
    with pytest.raises(ValueError, match="value_bits"):
        resolve_bits(3, value_bits=bad)
