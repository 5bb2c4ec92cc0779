"""Example workloads for `python -m vramkit run` (shipped as vramkit.examples)."""
