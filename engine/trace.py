"""Named ranges around every stage of a step, for Nsight Systems, torch.profiler and `--trace`.

`stage("replay")` opens an NVTX range (domain "step-engine") when an NVTX
tool is attached (Nsight Systems sets NVTX_INJECTION64_PATH in the profiled
process), a torch.profiler `record_function` range while a torch.profiler
trace is recording, and a span in the `record_stages()` recorder while one is
open (the demo's `--trace`: the stages alone, a few hundred bytes per step,
where torch.profiler also records every op). With none of them, it is one
shared no-op context: nothing is paid on the hot path.

`step_range(...)` is the parent of one loop step's stages after its scheduling
(the stages it runs inside: model forward, ledger, the engine's): named "step", it
carries the step number, its requests, its model rows and its bucket, as the NVTX
range's message and payload (the step number), the torch.profiler range's args
and the recorded span's "args".
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import ContextManager, Iterator

import torch

DOMAIN = "step-engine"
STAGES = ("schedule", "ledger", "staging copy", "replay", "eager step",
          "output copy", "prompt logprobs", "model forward")
STEP = "step"  # the parent range of a loop step's stages (`step_range`)

_NULL = contextlib.nullcontext()
_nvtx = None
if os.environ.get("NVTX_INJECTION64_PATH") or os.environ.get("NVTX_INJECTION32_PATH"):
    try:
        import nvtx as _nvtx
    except ImportError:  # the range names still reach torch.profiler traces
        _nvtx = None


class StageRecorder:
    """Host-side spans of every `stage()` while open, as Chrome trace "complete" events."""

    def __init__(self) -> None:
        self.events: list[dict[str, object]] = []

    @contextlib.contextmanager
    def span(self, name: str, args: dict[str, object] | None = None) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            end = time.perf_counter_ns()
            event = {"name": name, "cat": DOMAIN, "ph": "X", "ts": start / 1e3, "dur": (end - start) / 1e3,
                     "pid": os.getpid(), "tid": threading.get_ident()}
            if args is not None:
                event["args"] = args
            self.events.append(event)

    def export_chrome_trace(self, path: str) -> None:
        """Write the spans as a Chrome/Perfetto JSON trace (timestamps in µs)."""
        meta = {"name": "process_name", "ph": "M", "pid": os.getpid(), "args": {"name": DOMAIN}}
        with open(path, "w") as f:
            json.dump({"traceEvents": [meta, *self.events], "displayTimeUnit": "ms"}, f)


_recorder: StageRecorder | None = None


@contextlib.contextmanager
def record_stages() -> Iterator[StageRecorder]:
    """Record every `stage()` span until the block exits; only one recorder at a time."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("record_stages() is already recording")
    _recorder = StageRecorder()
    try:
        yield _recorder
    finally:
        _recorder = None


def stage(name: str) -> ContextManager[None]:
    """A context naming one stage of the step (see STAGES)."""
    tracing = torch.autograd.profiler._is_profiler_enabled
    recorder = _recorder
    if _nvtx is None and not tracing and recorder is None:
        return _NULL
    stack = contextlib.ExitStack()
    if _nvtx is not None:
        stack.enter_context(_nvtx.annotate(name, domain=DOMAIN))
    if tracing:
        stack.enter_context(torch.profiler.record_function(name))
    if recorder is not None:
        stack.enter_context(recorder.span(name))
    return stack


def step_range(step: int, requests: int, rows: int, bucket: int | None) -> ContextManager[None]:
    """The parent range of one loop step (module docstring): `step` the loop's step
    number, `requests` scheduled, `rows` model-output rows (query tokens), `bucket` the
    engine's bucket for them (None: above the largest, an eager step)."""
    tracing = torch.autograd.profiler._is_profiler_enabled
    recorder = _recorder
    if _nvtx is None and not tracing and recorder is None:
        return _NULL
    args = {"step": step, "requests": requests, "rows": rows, "bucket": "eager" if bucket is None else bucket}
    message = ", ".join(f"{key} {value}" for key, value in args.items())
    stack = contextlib.ExitStack()
    if _nvtx is not None:
        stack.enter_context(_nvtx.annotate(f"{STEP}: {message}", domain=DOMAIN, payload=step))
    if tracing:
        stack.enter_context(torch.profiler.record_function(STEP, args=message))
    if recorder is not None:
        stack.enter_context(recorder.span(STEP, args))
    return stack
