"""Parse ``kv_bits`` into separate key and value bit widths.

Keys carry the softmax logits, so errors there are amplified by the
exponential; values are only averaged.  Fractional widths therefore give the
extra bit to values (2.5 = 2-bit keys / 3-bit values, 3.5 = 3 / 4) because
the codebook of the extra bit is worth more on the averaged side at equal
bytes (this matches the peer's layout so byte counts compare directly).
"""

from __future__ import annotations

ALLOWED_KV_BITS: tuple[float, ...] = (2, 2.5, 3, 3.5, 4)
ALLOWED_COMPONENT_BITS: tuple[int, ...] = (1, 2, 3, 4)

_SPLITS: dict[float, tuple[int, int]] = {
    2: (2, 2),
    2.5: (2, 3),
    3: (3, 3),
    3.5: (3, 4),
    4: (4, 4),
}


def _component(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(
            f"{name}={value!r} is not allowed; use an integer in {list(ALLOWED_COMPONENT_BITS)}"
        )
    if int(value) not in ALLOWED_COMPONENT_BITS:
        raise ValueError(
            f"{name}={value!r} is not allowed; use an integer in {list(ALLOWED_COMPONENT_BITS)}"
        )
    return int(value)


def resolve_bits(
    kv_bits: float | None = None,
    key_bits: int | None = None,
    value_bits: int | None = None,
) -> tuple[int, int]:
    """Return ``(key_bits, value_bits)``.

    ``kv_bits`` picks a preset from ``ALLOWED_KV_BITS``; ``key_bits`` /
    ``value_bits`` override either side (each 1..4).  With nothing given the
    default is 3.5 bits (3-bit keys, 4-bit values).
    """
    if kv_bits is None:
        base = _SPLITS[3.5] if key_bits is None and value_bits is None else None
    else:
        ok = (
            isinstance(kv_bits, (int, float))
            and not isinstance(kv_bits, bool)
            and float(kv_bits) in _SPLITS
        )
        if not ok:
            raise ValueError(
                f"kv_bits={kv_bits!r} is not allowed; choose one of "
                f"{', '.join(str(b) for b in ALLOWED_KV_BITS)} "
                "(2.5 = 2-bit keys/3-bit values, 3.5 = 3-bit keys/4-bit values)"
            )
        base = _SPLITS[float(kv_bits)]
    if base is None:
        # Only one side given: the other side defaults to the same width.
        k = key_bits if key_bits is not None else value_bits
        v = value_bits if value_bits is not None else key_bits
        return _component("key_bits", k), _component("value_bits", v)
    k = base[0] if key_bits is None else _component("key_bits", key_bits)
    v = base[1] if value_bits is None else _component("value_bits", value_bits)
    return k, v
