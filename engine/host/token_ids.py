"""The checks of what names a request and what it asks about: its id and its prompt's token ids.

Run where a request enters (the persistent batch's `add`, the loop's `submit`, `LLM`):
a nested list, a dict, a float, a bool, text or an id outside the vocabulary is a
caller's bug, refused with a ValueError naming the request, the field and the value.
Numpy only: a torch tensor is read only when torch is already loaded.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Hashable

import numpy as np


def check_request_id(request_id: Hashable) -> None:
    """ValueError unless `request_id` is a hashable value other than None."""
    if request_id is None:
        raise ValueError("request_id=None: must not be None")
    try:
        hash(request_id)
    except TypeError:
        raise ValueError(f"request_id={request_id!r}: must be hashable") from None


def checked_prompt(request_id: Hashable, prompt_tokens: object, vocab_size: int, *, label: str | None = None) -> np.ndarray:
    """[prompt_len] int64 from a flat sequence of int ids in [0, vocab_size). Nothing is
    coerced: a float, a bool, a string or a nested list is a caller's bug, not a token.
    `label`: how errors name the prompt (default `request <id>: prompt_tokens`)."""
    where = label or f"request {request_id!r}: prompt_tokens"
    torch = sys.modules.get("torch")  # a tensor exists only once torch is loaded: engine/host never imports it
    if torch is not None and isinstance(prompt_tokens, torch.Tensor):
        if prompt_tokens.dtype.is_floating_point or prompt_tokens.dtype.is_complex or prompt_tokens.dtype == torch.bool:
            raise ValueError(f"{where}: a tensor of {prompt_tokens.dtype}, not of integer token ids")
        prompt_tokens = prompt_tokens.detach().cpu().numpy()
    if isinstance(prompt_tokens, np.ndarray):
        if not np.issubdtype(prompt_tokens.dtype, np.integer):
            raise ValueError(f"{where}: a numpy array of {prompt_tokens.dtype}, not of integer token ids")
        if prompt_tokens.ndim != 1:
            raise ValueError(f"{where}: shape {prompt_tokens.shape}, must be 1-D")
        tokens = prompt_tokens.tolist()  # Python ints: range checks below cannot overflow
    elif isinstance(prompt_tokens, str):
        raise ValueError(f"{where}={prompt_tokens!r}: text, not token ids; encode it first "
                         "(tokenizer.encode(text)), or use engine.LLM, which takes text")
    elif isinstance(prompt_tokens, Sequence) and not isinstance(prompt_tokens, (bytes, bytearray)):
        tokens = list(prompt_tokens)
        for i, token in enumerate(tokens):
            if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
                raise ValueError(f"{where}[{i}]={token!r}: must be an int token id, not a {type(token).__name__}")
    else:
        raise ValueError(
            f"{where}={prompt_tokens!r}: must be a sequence of int token ids, not a {type(prompt_tokens).__name__}"
        )
    if not tokens:
        raise ValueError(f"{label or f'request {request_id!r}: prompt'} is empty (at least one token is needed)")
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise ValueError(f"{where}[{i}]={int(token)}: outside [0, {vocab_size})")
    return np.asarray(tokens, dtype=np.int64)
