"""``kv_bits`` and the other cache options, parsed once into a policy.

``make_prompt_cache`` (and a ``TurboQuantKVCache`` built on its own) turns
its arguments into one :class:`KVQuantPolicy`; the caches, their codecs and
through them the attention kernels read the widths from it, so a width is
validated in exactly one place.

Keys carry the softmax logits, so errors there are amplified by the
exponential; values are only averaged.  Fractional presets therefore give
the extra bit to values (2.5 = 2-bit keys / 3-bit values, 3.5 = 3 / 4): the
codebook of the extra bit is worth more on the averaged side at equal bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

ALLOWED_KV_BITS: tuple[float, ...] = (2, 2.5, 3, 3.5, 4)
ALLOWED_COMPONENT_BITS: tuple[int, ...] = (1, 2, 3, 4)
SCHEMES: tuple[str, ...] = ("turboquant", "affine", "fp16")
QUANTIZERS: tuple[str, ...] = ("scalar", "tcq")
AFFINE_BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)

_SPLITS: dict[float, tuple[int, int]] = {2: (2, 2), 2.5: (2, 3), 3: (3, 3), 3.5: (3, 4), 4: (4, 4)}


def _component(name: str, value) -> int:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and value == int(value)
    if not ok or int(value) not in ALLOWED_COMPONENT_BITS:
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


@dataclass(frozen=True)
class KVQuantPolicy:
    """How every converted layer's KV cache is compressed.

    ``scheme``: ``"turboquant"`` (packed codes, ``key_bits``/``value_bits``
    per coordinate), ``"affine"`` (mlx's ``QuantizedKVCache`` at
    ``affine_bits``, groups of ``affine_group_size``) or ``"fp16"`` (the
    model's own caches).  ``quantizer``: ``"scalar"`` (Lloyd-Max, the GPU
    kernels' layout) or ``"tcq"`` (trellis-coded, reference path only).
    ``window``: most recent tokens kept exact.  ``seed``: rotation seed of
    layer 0 (layer ``i`` uses ``seed + i``).
    """

    scheme: str = "turboquant"
    key_bits: int = 3
    value_bits: int = 4
    quantizer: str = "scalar"
    window: int = 128
    seed: int = 0
    affine_bits: int = 4
    affine_group_size: int = 64

    @property
    def kv_bits(self) -> float:
        """Mean bits per coordinate of keys and values."""
        return (self.key_bits + self.value_bits) / 2


def parse_kv_policy(
    kv_bits: float | None = 3.5,
    kv_quant_scheme: str = "turboquant",
    *,
    key_bits: int | None = None,
    value_bits: int | None = None,
    quantizer: str = "scalar",
    window: int = 128,
    seed: int = 0,
    affine_group_size: int = 64,
    where: str = "make_prompt_cache",
) -> KVQuantPolicy:
    """Validate the cache options once; ``where`` names the caller in errors."""
    if kv_quant_scheme not in SCHEMES:
        raise ValueError(
            f"{where}: unknown kv_quant_scheme={kv_quant_scheme!r}; choose one of {', '.join(SCHEMES)}"
        )
    if kv_quant_scheme == "fp16":
        return KVQuantPolicy(scheme="fp16")
    if kv_quant_scheme == "affine":
        if kv_bits not in AFFINE_BITS:
            raise ValueError(
                f"{where}: affine kv_bits={kv_bits!r} is not allowed; "
                f"choose one of {', '.join(map(str, AFFINE_BITS))}"
            )
        return KVQuantPolicy(scheme="affine", affine_bits=int(kv_bits),
                             affine_group_size=int(affine_group_size))
    k, v = resolve_bits(kv_bits, key_bits, value_bits)
    if quantizer not in QUANTIZERS:
        raise ValueError(f"{where}: unknown quantizer={quantizer!r}; choose one of {', '.join(QUANTIZERS)}")
    if window < 0:
        raise ValueError(f"{where}: window must be >= 0, got {window}")
    return KVQuantPolicy(scheme="turboquant", key_bits=k, value_bits=v, quantizer=quantizer,
                         window=int(window), seed=int(seed))
