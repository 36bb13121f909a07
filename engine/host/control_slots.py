"""Which requests need sampling-control state, and the refusal of an engine without it.

The state itself (a slot per request, on the device) is the engine's
(`engine/step/control_state.py` `SamplingControls`); the request tables call it
through the `ControlHook` methods when a request joins, changes its
parameters or leaves. Numpy only, like the rest of engine/host.
"""
from __future__ import annotations

from typing import Hashable, Protocol, Sequence

from engine.host.params import SamplingParams

CONTROL_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "allowed_token_ids")
_NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def uses_controls(params: SamplingParams) -> bool:
    """Whether a request needs a control slot: penalties, a logit bias or an allowed set."""
    return params.has_penalties or bool(params.logit_bias) or params.allowed_token_ids is not None


def first_control(params: SamplingParams) -> str:
    """"field=value" of the first control the request sets, for messages."""
    for name in CONTROL_FIELDS:
        value = getattr(params, name)
        if name in _NEUTRAL and value != _NEUTRAL[name]:
            return f"{name}={value!r}"
        if name == "logit_bias" and value:
            return f"logit_bias={dict(value)!r}"
        if name == "allowed_token_ids" and value is not None:
            return f"allowed_token_ids={value!r}"
    return "no control"


class ControlHook(Protocol):
    """What a request table asks of the engine's control state."""

    def check_params(self, request_id: Hashable, params: SamplingParams) -> bool: ...

    def check(self, request_id: Hashable, params: SamplingParams, prompt_tokens: Sequence[int] | None,
              num_generated: int, holds_slot: bool) -> bool: ...

    def join(self, params: SamplingParams, prompt_tokens: Sequence[int] | None) -> int: ...

    def rewrite(self, slot: int, params: SamplingParams) -> None: ...

    def leave(self, slot: int) -> None: ...


class NoControls:
    """The hook of an engine that allocated no control state: any request that
    uses a control is refused, naming the request, the field and the value."""

    def __init__(self, reason: str):
        self.reason = reason

    def check_params(self, request_id: Hashable, params: SamplingParams) -> bool:
        if uses_controls(params):
            raise ValueError(f"request {request_id!r}: {first_control(params)}: {self.reason}")
        return False

    def check(self, request_id: Hashable, params: SamplingParams, prompt_tokens: Sequence[int] | None,
              num_generated: int, holds_slot: bool) -> bool:
        return self.check_params(request_id, params)

    def join(self, params: SamplingParams, prompt_tokens: Sequence[int] | None) -> int:
        raise AssertionError("NoControls.check refuses every request that would join")

    def rewrite(self, slot: int, params: SamplingParams) -> None:
        raise AssertionError("NoControls hands out no slot")

    def leave(self, slot: int) -> None:
        raise AssertionError("NoControls hands out no slot")
