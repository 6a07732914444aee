"""Benchmarks of the BOUNCE plugin: compare.py (one shape, side by side) and the sweep package
(`python -m benches.sweep`)."""
