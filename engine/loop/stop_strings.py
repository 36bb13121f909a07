"""A completion's text as it grows a step at a time, and where a stop string ends it.

`OutputText` detokenizes a request's output incrementally, the way vLLM does:
each step it decodes a short window of tokens twice (without and with the new
ones) and releases the difference, so a step costs a few tokens' decoding, not
the whole output's. Text that ends in U+FFFD is held back: with a byte-level
vocabulary a token may carry the first bytes of a character whose remaining
bytes come with the next token, and releasing the replacement character would
put a character into the text that the finished output does not have. So the
released text is a prefix of `decode(all tokens)`, and equals it once the
output ends (checked on SmolLM2's byte-level BPE in tests/test_stop_strings.py).

A stop string is looked for in the released text only (what precedes the hold
back), in the part a step's new characters could have completed. The request
stops at the occurrence that *ends* first, as if the text had been checked
after every character (so the answer does not depend on how tokens were
grouped into steps, drafts or not); of two ending at the same character, the
longer one. The kept text ends before the stop string, or after it with
`include_stop_str_in_output`; the kept tokens are the shortest prefix of the
output whose text starts with the kept text. A token whose text straddles the
cut therefore stays in the token list while the part of its text past the cut
is dropped: `decode(kept tokens)` starts with the kept text and may run past it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a decoder makes of bytes that are not (yet) a whole character


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ...


@dataclass(frozen=True)
class StopMatch:
    """Where a stop string ended a request."""

    stop: str  # the stop string found
    text: str  # the text kept (before the stop string, or through it when it is included)
    num_tokens: int  # how many output tokens produced the kept text


class OutputText:
    """One request's output text, released a step at a time (module docstring)."""

    def __init__(self, decoder: Decoder, stop: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        self.decoder = decoder
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self.text = ""  # released so far
        # The window decoded each step starts at `prefix_offset`; tokens before `read_offset`
        # have their text released. Decoding from a few tokens back, not from `read_offset`,
        # keeps whatever a tokenizer makes of a token's neighbour (SentencePiece drops the
        # leading space of the first token it decodes) out of the released difference.
        self.prefix_offset = 0
        self.read_offset = 0
        # (tokens, characters) released after each release: where to start looking for the
        # tokens that produced a cut text.
        self.releases: list[tuple[int, int]] = [(0, 0)]

    def state(self) -> tuple:
        """What `advance` changes; `restore` puts it back (a step that is undone)."""
        return self.text, self.prefix_offset, self.read_offset, len(self.releases)

    def restore(self, state: tuple) -> None:
        self.text, self.prefix_offset, self.read_offset, num_releases = state
        del self.releases[num_releases:]

    def advance(self, tokens: Sequence[int], *, final: bool = False) -> StopMatch | None:
        """Release the text of `tokens` (the whole output so far, longer than at the last
        call) and look for a stop string in what was released. `final`: the output ends
        here, release the held-back text too."""
        checked = len(self.text)
        decode = self.decoder.decode
        window_before = decode(tokens[self.prefix_offset : self.read_offset])
        window = decode(tokens[self.prefix_offset :])
        if len(window) > len(window_before) and (final or not window.endswith(REPLACEMENT_CHAR)):
            self.text += window[len(window_before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
            self.releases.append((len(tokens), len(self.text)))
        return self._find_stop(checked, tokens) if len(self.text) > checked else None

    def _find_stop(self, checked: int, tokens: Sequence[int]) -> StopMatch | None:
        """The first-ending stop string among those that end past character `checked`."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop:
            start = self.text.find(stop, max(0, checked - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        end, start, stop = best
        kept = self.text[: end if self.include_stop else start]
        return StopMatch(stop, kept, self._tokens_for(kept, tokens))

    def _tokens_for(self, kept: str, tokens: Sequence[int]) -> int:
        """The shortest prefix of `tokens` whose text starts with `kept`. The search starts
        after the last release that stopped short of it: fewer tokens cannot reach it."""
        if not kept:
            return 0
        start = max(n for n, chars in self.releases if chars < len(kept))
        for k in range(start + 1, len(tokens) + 1):
            if self.decoder.decode(tokens[:k]).startswith(kept):
                return k
        raise RuntimeError(f"no prefix of the output decodes to the kept text {kept!r}: the decoder's text "
                           "of a prefix is not a prefix of its text of the whole")
