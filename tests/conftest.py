"""Shared fixtures.  Importing turboquant first routes MLX's CPU BLAS to OpenBLAS."""

import turboquant  # noqa: F401  (must precede any mlx import)
