"""What a decode loop counts as it runs (`DecodeLoop.stats`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoopStats:
    # The loop's clock, which arrival steps are counted in: steps run, idle ones included
    # (`run` skips a stretch of idle steps before a future arrival in one go).
    steps: int = 0
    tokens_generated: int = 0
    prefill_tokens: int = 0  # prompt tokens computed by the model
    shared_prefix_tokens: int = 0  # prompt tokens copied from another request's cache instead
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    forward_seconds: float = 0.0
    engine_seconds: float = 0.0
    schedule_seconds: float = 0.0
