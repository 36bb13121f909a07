"""Profiling kit: benchmarks and the fake-CUDA dry run. Stands beside the hot path, never inside it
(the stage ranges the hot path opens are the library's own, `engine/trace.py`)."""
