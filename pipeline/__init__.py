"""tqpipe: batch long-document pipeline over a TurboQuant KV cache.

The Python API (:mod:`pipeline.api`) is importable from here:
``from pipeline import load_job, run_job, read_results, ask_files``.  It is
loaded on first use, so ``import pipeline`` (the CLI's first line) stays
instant and imports no MLX.
"""

from turboquant.cpu_blas import enable_fast_cpu_blas

enable_fast_cpu_blas()  # before anything imports mlx.core

_API = ("Job", "RunSummary", "ask_files", "load_job", "read_results", "run_job")


def __getattr__(name: str):
    if name in _API:
        from pipeline import api

        return getattr(api, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")


__all__ = list(_API)
