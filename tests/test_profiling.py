"""Profiling kit: stage ranges cost nothing without a profiler and carry
their names into torch.profiler traces; NVML telemetry degrades to a notice."""
from __future__ import annotations

import importlib.util

import torch

from profiling import ranges
from profiling.telemetry import Telemetry


def test_stage_is_a_shared_no_op_without_a_profiler():
    if ranges._nvtx is None:
        assert ranges.stage("replay") is ranges.stage("ledger")  # nothing allocated per call


def test_stage_names_reach_a_torch_profiler_trace():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for name in ("ledger", "replay"):
            with ranges.stage(name):
                torch.ones(4).sum()
    names = {event.name for event in prof.events()}
    assert {"ledger", "replay"} <= names


def test_telemetry_without_a_driver_reports_one_line():
    summary = Telemetry(interval_s=0.01).start().stop()
    rows = summary.rows()
    if summary.notice:
        assert rows == [("GPU telemetry", summary.notice)]
        if importlib.util.find_spec("pynvml") is not None and not torch.cuda.is_available():
            assert "no NVIDIA driver" in summary.notice or "no samples" in summary.notice
    else:
        assert any(key.startswith("GPU utilisation") for key, _ in rows)
