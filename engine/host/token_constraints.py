"""Token constraints on the host: structured output and bad words as per-row token bitmasks.

A request's constraint turns its context into the bitmask of its sample rows
(docs/contract.md §2, stage 4), in xgrammar's packed layout: int32 words, bit
b of word w stands for token 32 w + b, 1 = allowed. The device side applies it
(`engine/sampling/token_bitmask.py`).

- Structured output (`SamplingParams.json_schema`, `regex`, `grammar`):
  xgrammar compiles the spec once per (kind, text) for the tokenizer, and a
  `GrammarMatcher` per request follows the tokens it emits. When the grammar
  is complete only the stop ids remain allowed, so the request ends on EOS.
- Bad words (`SamplingParams.bad_words`): a word's last token is banned on a
  row whose output (the tokens emitted so far and the drafts before the row;
  never the prompt, as vLLM) ends with the rest of the word; a one-token word
  is always banned.
- Drafts: row j of a request verifying k drafts gets the mask of the state
  after drafts 0..j-1. The matcher is advanced over them and rolled back. A
  draft the grammar rejects is never accepted (its row cannot draw it), so
  the rows after it are never emitted and keep an unrestricted mask.
- After a step, `advance` feeds the matcher the tokens the request emitted;
  `rollback_to` undoes that when the caller rolls the step back.

Numpy only at import: xgrammar (which loads torch) is imported on the first
structured request.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Hashable, Protocol, Sequence, runtime_checkable

import numpy as np

from engine.host.params import SamplingParams

if TYPE_CHECKING:
    import xgrammar

BITS_PER_WORD = 32
# xgrammar's errors start "[hh:mm:ss] /path/file.cc:line: "; the rest is the message.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: ceil(vocab_size / 32)."""
    return -(-vocab_size // BITS_PER_WORD)


def ban_token(row: np.ndarray, token: int) -> None:
    """Clear `token`'s bit in one bitmask row ([words] int32, in place)."""
    words = row.view(np.uint32)
    words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)


@runtime_checkable
class GrammarTokenizer(Protocol):
    """What structured output needs of a tokenizer: its vocabulary as xgrammar reads it
    (`ChatMLTokenizer`, `ByteChatMLTokenizer` and `PlainTokenizer` of engine/models/tokenizer.py
    and `HFChatTokenizer` (over a transformers tokenizer) implement it)."""

    def grammar_vocabulary(self, vocab_size: int) -> tuple[list[str] | list[bytes], str]:
        """(tokens, vocab type) for xgrammar's `TokenizerInfo`: per id below `vocab_size`
        (the model's, which may exceed the tokenizer's) the token as the vocab type encodes
        it ("RAW": raw bytes; "BYTE_LEVEL": a byte-level BPE's encoded string, "Ġword").
        Special tokens (`<|im_end|>`, ...) and ids past the tokenizer get an empty string,
        which xgrammar never lets a grammar produce as text (a stop id stays allowed where
        the grammar may end)."""
        ...


GRAMMAR_CACHE_ENTRIES = 64  # compiled grammars kept, least recently used dropped first
GRAMMAR_CACHE_BYTES = 256 * 2**20  # and at most this many bytes of them (xgrammar's memory_size_bytes)


class GrammarCache:
    """xgrammar's view of one tokenizer over a model's vocabulary, and its
    compiled grammars keyed by (kind, text), least recently used dropped first
    past `max_entries` grammars or `max_bytes` bytes (a grammar bigger than
    `max_bytes` alone is compiled, used and not kept).

    `vocab_size` is the model's (the logits' width), which may exceed the
    tokenizer's; `stop_token_ids` end a complete grammar (the model's EOS)."""

    def __init__(self, tokenizer: GrammarTokenizer, vocab_size: int, stop_token_ids: Sequence[int], *,
                 max_entries: int = GRAMMAR_CACHE_ENTRIES, max_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        import xgrammar as xgr

        encoded, vocab_type = tokenizer.grammar_vocabulary(vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType[vocab_type], vocab_size=vocab_size,
                                      stop_token_ids=self.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.max_entries, self.max_bytes = max_entries, max_bytes
        # (kind, text) -> (compiled grammar, its bytes), least recently used first.
        self._compiled: OrderedDict[tuple[str, str], tuple[xgrammar.CompiledGrammar, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._compiled)

    def compiled(self, request_id: Hashable, kind: str, text: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `params.<kind> = text`; ValueError naming the
        request, the field and xgrammar's message when it does not compile."""
        key = (kind, text)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key][0]
        compile_spec = {"json_schema": self.compiler.compile_json_schema, "regex": self.compiler.compile_regex,
                        "grammar": self.compiler.compile_grammar}[kind]
        try:
            grammar = compile_spec(text)
        except (RuntimeError, ValueError) as err:
            message = _XGRAMMAR_PREFIX.sub("", str(err).strip())
            raise ValueError(f"request {request_id!r}: params.{kind}={text!r}: xgrammar cannot compile it: "
                             f"{message}") from None
        size = int(grammar.memory_size_bytes)
        if size <= self.max_bytes and self.max_entries > 0:
            self._compiled[key] = (grammar, size)
            self.nbytes += size
            while len(self._compiled) > self.max_entries or self.nbytes > self.max_bytes:
                _, (_, dropped) = self._compiled.popitem(last=False)
                self.nbytes -= dropped
        return grammar

    def matcher(self, compiled: xgrammar.CompiledGrammar, stop_token_ids: Sequence[int]) -> xgrammar.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)


class TokenConstraint:
    """One request's constraint: a grammar matcher, bad words, or both.

    `output` holds every token the request emitted since it was made."""

    def __init__(
        self,
        matcher: xgrammar.GrammarMatcher | None,
        bad_words: Sequence[Sequence[int]],
        stop_token_ids: Sequence[int],
    ) -> None:
        self.matcher = matcher
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.single_bans = np.array(sorted({w[0] for w in bad_words if len(w) == 1}), dtype=np.int64)
        self._single_mask: np.ndarray | None = None  # [words] int32: all ones but the one-token bad words
        self.longer_words = tuple(tuple(w) for w in bad_words if len(w) > 1)
        self.context_needed = max((len(w) - 1 for w in self.longer_words), default=0)
        self.output: list[int] = []
        self.matched = 0  # leading output tokens the matcher accepted
        self.off_grammar = False  # an emitted token the matcher rejected (a forced token): nothing is allowed after it
        self._off_at = -1  # the output index of that token

    def fill(self, rows: np.ndarray, drafts: Sequence[int]) -> None:
        """Write the masks of one request's sample rows into `rows`
        ([1 + len(drafts), words] int32, all ones on entry): row j assumes
        drafts 0..j-1 were accepted."""
        if self.matcher is not None:
            self._fill_grammar(rows, drafts)
        if self.single_bans.size:
            if self._single_mask is None:
                self._single_mask = np.full(rows.shape[1], -1, dtype=np.int32)
                for token in self.single_bans:
                    ban_token(self._single_mask, int(token))
            rows &= self._single_mask
        if self.longer_words:
            tail = self.output[-self.context_needed :]
            for j in range(len(rows)):
                self._ban_words(rows[j], tail + [int(d) for d in drafts[:j]])

    def _fill_grammar(self, rows: np.ndarray, drafts: Sequence[int]) -> None:
        import torch

        if self.off_grammar:
            rows[...] = 0
            return
        matcher, view = self.matcher, torch.from_numpy(rows)
        advanced = 0
        for j in range(len(rows)):
            if matcher.is_terminated():
                rows[j] = 0
                for stop in self.stop_token_ids:
                    rows[j].view(np.uint32)[stop >> 5] |= np.uint32(1 << (stop & 31))
            else:
                matcher.fill_next_token_bitmask(view, j)
            if j == len(rows) - 1:
                break
            if not matcher.accept_token(int(drafts[j])):
                break  # the grammar rejects this draft: no later row of the request is emitted
            advanced += 1
        if advanced:
            matcher.rollback(advanced)

    def _ban_words(self, row: np.ndarray, context: list[int]) -> None:
        for word in self.longer_words:
            n = len(word) - 1
            if len(context) >= n and tuple(context[len(context) - n :]) == word[:-1]:
                ban_token(row, word[-1])

    def advance(self, tokens: Sequence[int]) -> None:
        """The request emitted `tokens` this step."""
        for token in tokens:
            token = int(token)
            self.output.append(token)
            if self.matcher is None or self.off_grammar:
                continue
            if self.matcher.is_terminated() and token in self.stop_token_ids:
                continue  # past the end only stop ids come (ignore_eos): the matcher stays at its end
            if self.matcher.accept_token(token):
                self.matched += 1
            else:
                self.off_grammar = True
                self._off_at = len(self.output) - 1

    def rollback_to(self, num_generated: int) -> None:
        """Back to the state after the first `num_generated` emitted tokens."""
        drop = len(self.output) - num_generated
        if drop <= 0:
            return
        del self.output[num_generated:]
        if self.matcher is None:
            return
        if self.off_grammar and self._off_at >= num_generated:
            self.off_grammar = False
        if self.matched > num_generated:
            self.matcher.rollback(self.matched - num_generated)
            self.matched = num_generated


class TokenConstraints:
    """The token constraints of a batch's requests, by key (a table row).

    `tokenizer`: what structured output compiles against (None: only bad
    words can be served); `vocab_size`: the model's; `eos_token_id`: the
    engine's EOS, which ends a complete grammar together with the request's
    own stop_token_ids."""

    def __init__(self, vocab_size: int, tokenizer: object | None = None, eos_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self._grammars: GrammarCache | None = None
        self.of: dict[int, TokenConstraint] = {}

    def make(self, request_id: Hashable, params: SamplingParams) -> TokenConstraint | None:
        """The constraint `params` asks for (None: none). Every check runs here:
        ValueError naming the request, the field and the value."""
        structured = params.structured
        if structured is None and not params.bad_words:
            return None
        bad_words = self.bad_word_tokens(request_id, params.bad_words or ())
        for j, word in enumerate(bad_words):
            outside = [t for t in word if t >= self.vocab_size]
            if outside:
                raise ValueError(f"request {request_id!r}: params.bad_words[{j}]={word}: token {outside[0]} is "
                                 f"outside the vocabulary ({self.vocab_size} tokens)")
        stops = ([self.eos_token_id] if self.eos_token_id is not None and not params.ignore_eos else [])
        stops += [t for t in params.stop_token_ids if t not in stops]
        matcher = None
        if structured is not None:
            kind, text = structured
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: params.{kind}: structured output needs a tokenizer: "
                                 "PersistentBatch(..., tokenizer=)")
            if not isinstance(self.tokenizer, GrammarTokenizer):
                raise ValueError(f"request {request_id!r}: params.{kind}: structured output needs a tokenizer with "
                                 f"grammar_vocabulary() (GrammarTokenizer), got a {type(self.tokenizer).__name__}")
            if not stops:
                raise ValueError(f"request {request_id!r}: params.{kind}: structured output needs a stop id to end "
                                 "on (EngineConfig.eos_token_id, or params.stop_token_ids)")
            outside = [t for t in stops if t >= self.vocab_size]
            if outside:  # xgrammar would raise its own RuntimeError building the matcher
                raise ValueError(f"request {request_id!r}: params.stop_token_ids={params.stop_token_ids}: token "
                                 f"{outside[0]} is outside the vocabulary ({self.vocab_size} tokens)")
            try:
                grammars = self.grammars()
            except ValueError as err:  # the tokenizer's vocabulary is not one xgrammar can read
                raise ValueError(f"request {request_id!r}: params.{kind}: {err}") from None
            matcher = grammars.matcher(grammars.compiled(request_id, kind, text), stops)
        return TokenConstraint(matcher, bad_words, stops)

    def bad_word_tokens(self, request_id: Hashable, words: Sequence[str | Sequence[int]]) -> list[tuple[int, ...]]:
        """The token sequences `bad_words` stands for. A word given as text is read as vLLM
        reads it: the word with its leading white space stripped, as the tokenizer encodes
        it at the start of a text; and, when a space before it makes a different first
        token and the same number of tokens, that encoding too (the word inside a text).
        **Raises** ValueError naming the request and the word when there is no tokenizer
        or the word encodes to nothing."""
        sequences: list[tuple[int, ...]] = []
        for j, word in enumerate(words):
            if not isinstance(word, str):
                sequences.append(tuple(word))
                continue
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: params.bad_words[{j}]={word!r}: a word as text needs a "
                                 "tokenizer (PersistentBatch(..., tokenizer=), DecodeLoop(..., tokenizer=)); or give "
                                 "its token ids")
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not alone:
                raise ValueError(f"request {request_id!r}: params.bad_words[{j}]={word!r}: encodes to no tokens")
            sequences.append(alone)
            inside = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if inside and inside[0] != alone[0] and len(inside) == len(alone):
                sequences.append(inside)
        return sequences

    def grammars(self) -> GrammarCache:
        """The grammar cache over `tokenizer` (a `GrammarTokenizer`), made on first use."""
        if self._grammars is None:
            stops = [] if self.eos_token_id is None else [self.eos_token_id]
            self._grammars = GrammarCache(self.tokenizer, self.vocab_size, stops)
        return self._grammars
