"""Benchmarks: run as modules, e.g. ``python -m benchmarks.ingest``."""
