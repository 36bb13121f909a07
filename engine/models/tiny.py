"""A seeded random Llama over the byte tokenizer: the whole machinery with no weights to
ship (`python -m engine demo --model tiny`, `LLM("tiny")`, tests)."""
from __future__ import annotations

import dataclasses

import torch

from engine.models.llama import LlamaModel
from engine.models.llama_weights import LlamaConfig, random_weights
from engine.models.tokenizer import ByteChatMLTokenizer


def tiny_model(
    seed: int = 0,
    device: torch.device | str = "cpu",
    num_slots: int = 8,
    *,
    max_context: int = 1024,
    batch_invariant: bool = True,
) -> tuple[LlamaModel, ByteChatMLTokenizer]:
    """(model, tokenizer): a seeded random Llama over the byte tokenizer, needing no weights.

    Its embedding is also its LM head. Plain random rows give logits so peaked that every
    request emits the same control byte (a newline) forever. So the rows are scaled down (softer
    logits: sampled requests differ), the printable-ASCII rows and `<|im_end|>` to 0.1 and the
    rest to 0.03: the answers are noise, but mostly noise a terminal shows.
    """
    tokenizer = ByteChatMLTokenizer()
    eos = tokenizer.token_id("<|im_end|>")
    config = LlamaConfig(vocab_size=288, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position=max(1024, max_context), eos_token_id=eos)
    weights = random_weights(config, seed)
    row_scale = torch.full((config.vocab_size, 1), 0.03)
    row_scale[ord(" ") : ord("~") + 1] = 0.1
    row_scale[eos] = 0.1
    weights = dataclasses.replace(weights, embed=weights.embed * row_scale)
    model = LlamaModel(config, weights, device=device, num_slots=num_slots, max_context=max_context,
                       batch_invariant=batch_invariant)
    return model, tokenizer
