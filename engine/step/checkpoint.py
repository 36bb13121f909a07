"""Undoing a step: the host state of a StepEngine that spans steps (`StepEngine.checkpoint`)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Hashable, TypeVar

from engine.step.engine_config import EngineStats
from engine.step.prompt_logprobs import PromptLogprob
from graphs.replay import ReplayCounts

Counters = TypeVar("Counters")


@dataclass(frozen=True)
class EngineCheckpoint:
    """The host state of a StepEngine that spans steps (see `StepEngine.checkpoint`)."""

    # Per front's request table: its requests' partial prompt logprobs.
    partial_prompt_logprobs: dict[object, dict[Hashable, list[PromptLogprob]]]
    stats: EngineStats  # a copy of the engine's stats
    head_stats: object | None  # a copy of its LM head's own counters (`LMHead.stats`), if any
    replayer_counts: ReplayCounts  # `StepEngine.replayer`'s
    control_steps: int | None = None  # `SamplingControls.steps`, None without controls


def copy_counters(counters: Counters) -> Counters:
    """A copy of a stats dataclass whose dict fields are copied too (cheap
    enough for every step, unlike deepcopy)."""
    out = copy.copy(counters)
    for name, value in vars(out).items():
        if isinstance(value, dict):
            setattr(out, name, dict(value))
    return out


def restore_counters(counters: Counters, saved: Counters) -> None:
    """Put `saved`'s values back into `counters`, in place: whoever holds
    `counters` sees them, and `saved` stays as it was for another rollback."""
    vars(counters).update(vars(copy_counters(saved)))
