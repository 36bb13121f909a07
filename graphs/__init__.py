"""Static-address graphs: bucket table, capture-safety check, capture and replay.

Generic machinery: a step function over static tensors is captured once per
batch-size bucket and replayed per step (CUDA graphs on a GPU; on CPU the
same function re-run over the same buffers after a capture-time safety check).
"""
from graphs.replay import BucketTable, default_buckets
from graphs.capture_safety import (
    BufferAddress,
    CaptureSafetyError,
    capture_safety_check,
    check_addresses,
    record_addresses,
)
from graphs.replay import CaptureReport, GraphReplayer, StepFn

__all__ = [
    "BucketTable",
    "default_buckets",
    "BufferAddress",
    "CaptureSafetyError",
    "capture_safety_check",
    "check_addresses",
    "record_addresses",
    "CaptureReport",
    "GraphReplayer",
    "StepFn",
]
