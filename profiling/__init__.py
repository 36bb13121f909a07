"""Profiling kit: NVTX ranges, telemetry and benchmarks. Stands beside the hot path, never inside it."""
