"""Benchmarks: `python -m profiling.bench NAME [options]`.

Each NAME is a module in this package with a `main(argv) -> int`. Every
benchmark prints a ratio against a reference measured in the same run; none
asserts on wall-clock time.
"""
