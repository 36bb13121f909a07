"""The checks a step passes before it touches any buffer: after them, nothing
may raise but a bug. Every error is a ValueError naming the request (or the
argument), the field and the value."""
from __future__ import annotations

import numpy as np
import torch

from engine.host.ledger import SamplerInputs


def type_name(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def is_same_view(hidden: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether `hidden` is the engine's static source itself (the zero-copy path)."""
    return (
        hidden.data_ptr() == source.data_ptr()
        and hidden.stride() == source.stride()
        and hidden.dtype == source.dtype
        and hidden.device == source.device
    )


def check_hidden_states(hidden: object, inputs: SamplerInputs, *, hidden_size: int, device: torch.device,
                        source: torch.Tensor) -> None:
    """`hidden` is a floating-point [rows, hidden_size] tensor on `device` with the
    rows the batch's ledger reads."""
    if not isinstance(hidden, torch.Tensor):
        raise ValueError(f"hidden_states: a {type_name(hidden)}, expected a torch.Tensor [rows, {hidden_size}]")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden_states: dtype {hidden.dtype}, expected a floating-point tensor (the model's last-layer rows)")
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden_states: shape {tuple(hidden.shape)}, expected [rows, {hidden_size}]")
    if hidden.device.type != device.type:
        raise ValueError(f"hidden_states: on {hidden.device}, the engine runs on {device}")
    if hidden.shape[0] < inputs.num_output_rows:
        fix = " (the engine's static source: raise EngineConfig.max_source_rows)" if is_same_view(hidden, source) else ""
        raise ValueError(
            f"hidden_states: {hidden.shape[0]} rows{fix}, but the batch's ledger needs "
            f"{inputs.num_output_rows} (requests {list(inputs.request_ids)[:4]}"
            f"{'...' if inputs.num_reqs > 4 else ''})"
        )


def check_ledger(inputs: SamplerInputs, *, vocab_size: int, max_logprobs: int) -> None:
    """Prompt-logprob targets and forced tokens inside the vocabulary, no more top logprobs (sampled or
    prompt) than `max_logprobs`."""
    targets = inputs.prompt_token_targets
    if targets is not None and len(targets) and targets.max() >= vocab_size:
        bad = int(np.flatnonzero(targets >= vocab_size)[0])
        req = int(np.searchsorted(np.cumsum(inputs.prompt_row_counts), bad, side="right"))
        raise ValueError(
            f"request {inputs.request_ids[req]!r}: prompt_tokens: token {int(targets[bad])} "
            f"is outside the vocabulary ({vocab_size})"
        )
    for name, top in (("logprobs", inputs.num_logprobs), ("prompt_logprobs", inputs.num_prompt_logprobs)):
        top_n = int(top.max(initial=-1))
        if top_n > max_logprobs:  # vLLM's cap (its max_logprobs, 20 by default) on both
            req = int(np.argmax(top))
            raise ValueError(
                f"request {inputs.request_ids[req]!r}: params.{name}={top_n}: more than "
                f"SamplerConfig.max_logprobs={max_logprobs}"
            )
    forced = inputs.forced_tokens
    if forced is not None and forced.max() >= vocab_size:
        row = int(np.argmax(forced))
        raise ValueError(f"request {inputs.request_ids[int(inputs.row_to_req[row])]!r}: "
                         f"forced_token={int(forced[row])}: outside the vocabulary ({vocab_size})")


def check_token_bitmask(mask: object, rows: int, vocab_size: int, *, applies: bool) -> None:
    """A step's token bitmask is None or a C-contiguous int32 numpy array
    [rows, ceil(vocab_size / 32)], on an engine whose head applies one."""
    if mask is None:
        return
    if not applies:
        raise ValueError("StepArrays.token_bitmask: this engine applies no token bitmask "
                         "(EngineConfig(token_bitmask=False), or a head without masked graphs)")
    words = -(-vocab_size // 32)
    if not isinstance(mask, np.ndarray) or mask.dtype != np.int32 or mask.shape != (rows, words):
        shape = f"{mask.dtype} {mask.shape}" if isinstance(mask, np.ndarray) else type_name(mask)
        raise ValueError(f"StepArrays.token_bitmask: {shape}, expected int32 [{rows} sample rows, {words} words]")
