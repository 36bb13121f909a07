"""Stage ranges (engine/trace.py) cost nothing without a profiler and carry their names
into torch.profiler traces; the demo's NVML telemetry (engine/cli/telemetry.py) degrades
to a notice."""
from __future__ import annotations

import importlib.util

import torch

from engine import trace
from engine.cli.telemetry import Telemetry


def test_stage_is_a_shared_no_op_without_a_profiler():
    if trace._nvtx is None:
        assert trace.stage("replay") is trace.stage("ledger")  # nothing allocated per call


def test_stage_names_reach_a_torch_profiler_trace():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for name in ("ledger", "replay"):
            with trace.stage(name):
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


def test_record_stages_writes_only_the_stage_spans(tmp_path):
    import json

    with trace.record_stages() as recorder:
        with trace.stage("model forward"):
            with trace.stage("replay"):
                torch.ones(4).sum()
        with trace.stage("ledger"):
            pass
    assert trace.stage("replay") is trace.stage("ledger") or trace._nvtx is not None  # off again
    path = tmp_path / "trace.json"
    recorder.export_chrome_trace(str(path))
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["replay", "model forward", "ledger"]  # in closing order
    inner, outer = spans[0], spans[1]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def test_record_stages_does_not_nest():
    import pytest

    with trace.record_stages():
        with pytest.raises(RuntimeError, match="already recording"):
            with trace.record_stages():
                pass
    with trace.record_stages():  # free again after the first one closed
        pass


def test_telemetry_summary_as_numbers():
    from engine.cli.telemetry import TelemetrySummary

    figures = TelemetrySummary(samples=3, gpu_util_pct=50.0, memory_used_mib=1024.0).as_dict()
    assert figures["samples"] == 3 and figures["gpu_util_pct"] == 50.0 and figures["notice"] is None
