"""Models: loading (local, hub, built-in), the built-in models, and the on-disk model store.

Submodules import mlx; this package file imports nothing, so ``pipeline.models.store`` stays cheap.
"""
