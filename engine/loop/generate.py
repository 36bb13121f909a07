"""`generate`: every prompt through a decode loop built for this one call."""
from __future__ import annotations

from typing import Iterable, Sequence

from engine.host.params import SamplingParams
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.host.token_ids import checked_prompt
from engine.loop.requests import Completion
from engine.models.protocol import CausalLM, ChatTokenizer
from engine.step.engine_config import EngineConfig


def generate(
    model: CausalLM,
    prompts: Iterable[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    config: LoopConfig | None = None,
    engine_config: EngineConfig | None = None,
    tokenizer: ChatTokenizer | None = None,
) -> list[Completion | list[Completion]]:
    """Run every prompt (token ids) to completion; completions in prompt order. A prompt
    whose params have `n > 1` gets the list of its n completions in place of one.
    `tokenizer`: the model's, for `Completion.text`, stop strings and structured output.

    A one-shot convenience: each call builds a step engine and captures its graphs
    (seconds), then throws them away. To generate more than once, build an
    `engine.LLM` (text or token ids in, `RequestOutput`s out, graphs captured once) or
    keep a `DecodeLoop`. The prompts and the params are checked before the engine is
    built. Seeds: fresh per request unless `config=LoopConfig(seed_base=...)`."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError(f"prompts={prompts!r}: a str; generate takes a list of token-id prompts "
                         "(tokenizer.encode(text)), or use engine.LLM, which takes text")
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        raise ValueError(f"prompts={prompts!r}: a flat list of ints; generate takes a list of prompts, each a list "
                         "of token ids: [[...ids...]]")
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"params: {len(params)} entries for {len(prompts)} prompts")
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        checked_prompt(i, prompt, model.vocab_size, label=f"prompts[{i}]")
        if not isinstance(p, SamplingParams):
            raise ValueError(f"params[{i}]: must be SamplingParams, got {type(p).__name__}")
    loop = DecodeLoop(model, config, engine_config=engine_config, tokenizer=tokenizer)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.check(i, prompt, p)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    done = loop.run()
    return [done[i] if p.n == 1 else [done[(i, j)] for j in range(p.n)] for i, p in enumerate(params)]
