"""GPU kernel sources (one body per kernel, small per-backend headers)."""
