"""What `LLM.generate` accepts as prompts, read into token ids before any compute.

One prompt is a string; a list of token ids (ints, an integer numpy array or
tensor); a chat conversation (a list of `{"role": ..., "content": ...}`
messages, rendered with the tokenizer's chat template and the opening of the
assistant's turn); or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}`.
Several prompts are a list of those. Errors name the prompt by its index and
say what would be accepted."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Union

import numpy as np
import torch

from engine.host.token_ids import checked_prompt
from engine.models.tokenizer import HFProtocol, check_conversation

Conversation = Sequence[Mapping[str, str]]
PromptLike = Union[str, Sequence[int], np.ndarray, torch.Tensor, Conversation, Mapping[str, object]]

ACCEPTED = ("a str, a list of token ids, a chat (a list of {'role': ..., 'content': ...} messages), "
            "{'prompt': str} or {'prompt_token_ids': [...]}")


class Prompt(NamedTuple):
    text: str | None  # the text as given, or the chat rendered by the template; None for token ids
    token_ids: list[int]
    chat: bool = False  # rendered from a conversation with the chat template


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_message(value: object) -> bool:
    return isinstance(value, Mapping) and "role" in value


def _is_one_prompt(prompts: object) -> bool:
    """A single prompt given without the list around it: text, a flat token list, a chat."""
    if isinstance(prompts, (str, Mapping, np.ndarray, torch.Tensor)):
        return True
    if isinstance(prompts, Sequence) and prompts:
        return all(_is_int(p) for p in prompts) or all(_is_message(p) for p in prompts)
    return False


def read_prompts(prompts: object, tokenizer: HFProtocol | None, vocab_size: int) -> list[Prompt]:
    """Every prompt as token ids; **raises** ValueError naming the first bad one
    (`prompts[i]`), before anything runs."""
    if _is_one_prompt(prompts):
        prompts = [prompts]
    elif isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts={prompts!r}: a {type(prompts).__name__}; give one prompt or a list of them: {ACCEPTED}")
    if not prompts:
        raise ValueError("prompts=[]: no prompt to generate from")
    return [read_prompt(i, prompt, tokenizer, vocab_size) for i, prompt in enumerate(prompts)]


def read_prompt(i: int, prompt: object, tokenizer: HFProtocol | None, vocab_size: int) -> Prompt:
    where = f"prompts[{i}]"
    if isinstance(prompt, Mapping) and not _is_message(prompt):
        keys = set(prompt)
        if keys == {"prompt"}:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise ValueError(f"{where}['prompt']={prompt!r}: must be a str")
        elif keys == {"prompt_token_ids"}:
            prompt = prompt["prompt_token_ids"]
            if isinstance(prompt, str):
                raise ValueError(f"{where}['prompt_token_ids']={prompt!r}: must be a list of token ids, not a str")
        else:
            raise ValueError(f"{where}: a dict with keys {sorted(map(str, keys))}; a prompt is {ACCEPTED}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{where}={prompt!r}: text, but this LLM has no tokenizer; give token ids, or build "
                             "it with LLM(model=..., tokenizer=...)")
        if not prompt:
            raise ValueError(f"{where}='': an empty prompt (at least one token is needed)")
        ids = tokenizer.encode(prompt)
        return Prompt(prompt, checked_prompt(i, ids, vocab_size, label=where).tolist())
    if isinstance(prompt, Sequence) and prompt and all(_is_message(m) for m in prompt):
        if tokenizer is None:
            raise ValueError(f"{where}: a chat, but this LLM has no tokenizer to render it; build it with "
                             "LLM(model=..., tokenizer=...)")
        check_conversation(prompt, where)
        ids = tokenizer.chat_prompt(list(prompt), add_generation_prompt=True)
        text = tokenizer.chat_text(list(prompt), add_generation_prompt=True)
        return Prompt(text, checked_prompt(i, ids, vocab_size, label=where).tolist(), chat=True)
    if isinstance(prompt, (bytes, bytearray, Mapping)) or not isinstance(prompt, (Sequence, np.ndarray, torch.Tensor)):
        raise ValueError(f"{where}={prompt!r}: a {type(prompt).__name__}; a prompt is {ACCEPTED}")
    try:
        return Prompt(None, checked_prompt(i, prompt, vocab_size, label=where).tolist())
    except ValueError as err:
        raise ValueError(f"{err} (a prompt is {ACCEPTED})") from None
