"""TurboQuant KV-cache compression for MLX models (arXiv 2504.19874)."""

from .cpu_blas import enable_fast_cpu_blas

enable_fast_cpu_blas()  # must run before mlx.core is imported anywhere

# Public names load lazily: ``import turboquant`` must stay cheap and must
# not import mlx.core (the BLAS preload above has to come first everywhere).
_EXPORTS = {
    "TurboQuantKVCache": ".cache",
    "make_prompt_cache": ".prompt_cache",
    "install": ".integration",
    "turboquant_attention": ".attention",
    "KVQuantPolicy": ".policy",
    "parse_kv_policy": ".policy",
}

__all__ = ["enable_fast_cpu_blas", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'turboquant' has no attribute {name!r}")
