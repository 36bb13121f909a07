"""A request's output tokens as text, the way its parameters ask: vLLM's
`skip_special_tokens` (special tokens left out of the text, the default) and
`spaces_between_special_tokens` (when they are kept: a space between each special
token and the text or special token beside it, the default; none when False)."""
from __future__ import annotations

from typing import Sequence

from engine.host.params import SamplingParams
from engine.loop.stop_strings import Decoder


class SpecialTokenText:
    """A `Decoder` that keeps special tokens, each as its own piece of the text: the
    runs of ordinary tokens between them decode together, and the pieces join with
    `separator` (" " for vLLM's spaces_between_special_tokens=True, "" for False)."""

    def __init__(self, tokenizer: Decoder, special_ids: frozenset[int], separator: str) -> None:
        self.tokenizer, self.special_ids, self.separator = tokenizer, special_ids, separator

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        pieces: list[str] = []
        run: list[int] = []
        for token in token_ids:
            if token in self.special_ids:
                if run:
                    pieces.append(self.tokenizer.decode(run, skip_special_tokens=False))
                    run = []
                pieces.append(self.tokenizer.decode([token], skip_special_tokens=False))
            else:
                run.append(token)
        if run:
            pieces.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return self.separator.join(pieces)


def output_decoder(tokenizer: Decoder, params: SamplingParams) -> Decoder:
    """What turns this request's output tokens into its text: the tokenizer itself with
    vLLM's defaults (its `decode` skips special tokens), else `SpecialTokenText`."""
    if params.skip_special_tokens:
        return tokenizer
    separator = " " if params.spaces_between_special_tokens else ""
    return SpecialTokenText(tokenizer, getattr(tokenizer, "special_ids", frozenset()), separator)
