"""Per-request inputs: sampling parameters and one request's view of one step.

Both validate on construction and name the field and the value they reject;
`SeqMeta` also names the request. Checks that need the step's context (how many
drafts the engine verifies, whether compaction is on) live in the ledger's
`validate_batch`, which runs before any shared state is touched.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from engine.host.step_fields import PARAM_FIELDS
from engine.host.param_records import PARAMS_RECORD, PARAMS_PACKER, SEQ_PACKER, FLOAT_FIELDS, SEQ_RECORD, set_state, is_int, plain_number

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as vLLM
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # each logit_bias value, as OpenAI and vLLM
STRUCTURED_FIELDS = ("json_schema", "regex", "grammar")
# The top-N of `logprobs=-1` before the loop knows the vocabulary: past every cap, so a
# caller that does not resolve it (`resolve_whole_vocabulary`) is refused, never silently off.
WHOLE_VOCABULARY = INT32_MAX


class TokenBias(MappingABC):
    """`SamplingParams.logit_bias` as stored: token id -> bias, read-only and hashable
    (so `SamplingParams` hashes like any frozen dataclass); equal to a dict of the same
    items."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[int, float]) -> None:
        self._items = dict(items)

    def __getitem__(self, token: int) -> float:
        return self._items[token]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `structured_outputs=` for `SamplingParams`: exactly one of `json` (a JSON
    schema as text or a dict), `regex` or `grammar` (EBNF). The same constraint as the
    flat `json_schema` / `regex` / `grammar` fields, which it fills in."""

    json: str | Mapping | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams({', '.join(f'{n}=...' for n in given)}): give exactly one of "
                             "json, regex or grammar")
        [name] = given
        value = getattr(self, name)
        if not (isinstance(value, str) or (name == "json" and isinstance(value, Mapping))):
            kinds = "a str or a dict" if name == "json" else "a str"
            raise ValueError(f"StructuredOutputsParams.{name}={value!r}: must be {kinds}")

    def flat(self) -> tuple[str, str | Mapping]:
        """(the `SamplingParams` field it stands for, its value)."""
        if self.json is not None:
            return "json_schema", self.json
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


# The scalar fields a numpy scalar may stand for (normalised to a Python int or float).
_NUMBER_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "min_tokens", "max_tokens", "logprobs",
                  "prompt_logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "n")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. `top_k=0` (or -1, vLLM's) is off; `temperature=0` is greedy
    (and then `n` must be 1, as vLLM: the samples would all be alike).

    `prompt_logprobs`: False/None = off, True = the target token's logprob and
    rank only, an int N >= 0 = that plus the top-N alternatives.
    `logprobs`: None = off, an int N >= 0 = the sampled token's logprob and rank
    plus the top-N alternatives. -1 in either (vLLM's) = the whole vocabulary: the
    loop reads it as the vocabulary's size, refused past `SamplerConfig.max_logprobs`.
    `seed=-1` is None (vLLM's).

    The controls a vLLM user knows, with vLLM's semantics (docs/contract.md §2):
    - `repetition_penalty` (> 0, 1 = off): over the prompt and the output
      tokens, a positive logit is divided by it and a negative one multiplied;
    - `presence_penalty`, `frequency_penalty` (in [-2, 2], 0 = off): over the
      output tokens, subtract the penalty once, or once per occurrence;
    - `logit_bias`: token id -> bias in [-100, 100], added to the logit;
    - `allowed_token_ids`: only these may be sampled (non-empty);
    - `bad_words`: words as text (tokenized as vLLM does: the word, and the
      word after a space where that starts with another token of the same
      count) or token sequences; a sequence's last token is banned where
      the context ends with the rest of it (a one-token word is always banned);
    - `n`: samples per prompt, each with its own seed derived from `seed`;
    - `stop`: strings that end the output (the loop checks them on the text;
      the stop string is cut unless `include_stop_str_in_output`);
    - `json_schema` (a JSON schema as text or a dict), `regex`, `grammar`
      (EBNF): structured output through xgrammar; at most one of the three;
      or vLLM's `structured_outputs=StructuredOutputsParams(json=...)`, which
      fills in the flat field;
    - `skip_special_tokens` (default True), `spaces_between_special_tokens`
      (default True): how the output text is detokenized, as vLLM: special
      tokens left out, or kept with a space between each and its neighbours.
    Checks that need the vocabulary or a tokenizer run at submission.
    `ledger_record` (bytes, not a field): the values the ledger reads, packed once the
    fields are validated.
    """

    # The record lives in a slot, outside the instance dict: `vars(params)` holds the fields
    # only, so `SamplingParams(**vars(params))` still rebuilds the same parameters.
    __slots__ = ("ledger_record", "__dict__", "__weakref__")

    def __setstate__(self, state: tuple[dict, dict | None]) -> None:
        set_state(self, state)

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    max_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: bool | int = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise ValueError(f"stop_token_ids={ids!r}: must be a sequence of int token ids")
        object.__setattr__(self, "stop_token_ids", tuple(map(plain_number, ids)))
        problem = self._normalise()
        if problem:
            raise ValueError(problem)
        problem = self.problem()
        if problem:
            raise ValueError(problem)
        values = {"min_tokens": self.min_tokens, "num_logprobs": self.num_logprobs,
                  "num_prompt_logprobs": self.num_prompt_logprobs, "has_seed": self.seed is not None,
                  **{f.name: getattr(self, f.param) for f in PARAM_FIELDS}}
        values["seeds"] = self.seed or 0
        with np.errstate(over="ignore"):  # a finite temperature past float32's range is inf there, as staged
            for name in FLOAT_FIELDS:
                values[name] = np.float32(values[name]).item()
        # Not a field: these parameters as one `PARAMS_RECORD`, what the ledger reads.
        object.__setattr__(self, "ledger_record", PARAMS_PACKER.pack(*(values[name] for name in PARAMS_RECORD.names)))

    def _normalise(self) -> str | None:
        """Copy the container fields into immutable forms (a caller's later
        edit of its dict or list must not change a submitted request), and numpy
        scalars into the Python numbers they hold."""
        for name in _NUMBER_FIELDS:
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        # vLLM's spellings of "off" and "none": top_k=-1 and seed=-1.
        if is_int(self.top_k) and self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if is_int(self.seed) and self.seed == -1:
            object.__setattr__(self, "seed", None)
        problem = self._take_structured_outputs()
        if problem:
            return problem
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                return f"logit_bias={bias!r}: must be None or a mapping token id -> bias"
            object.__setattr__(self, "logit_bias", TokenBias(
                {plain_number(token): plain_number(value) for token, value in bias.items()}))
        allowed = self.allowed_token_ids
        if allowed is not None:
            if isinstance(allowed, (str, bytes, Mapping)) or not isinstance(allowed, Iterable):
                return f"allowed_token_ids={allowed!r}: must be None or a sequence of token ids"
            object.__setattr__(self, "allowed_token_ids", tuple(map(plain_number, allowed)))
        words = self.bad_words
        if words is not None:
            if isinstance(words, (str, bytes)) or not isinstance(words, Iterable):
                return f"bad_words={words!r}: must be None or a sequence of token-id sequences"
            words = tuple(words)
            for j, word in enumerate(words):
                if isinstance(word, bytes) or not isinstance(word, (str, Iterable)):
                    return f"bad_words[{j}]={word!r}: must be a word (a str) or a sequence of token ids"
            object.__setattr__(self, "bad_words", tuple(
                word if isinstance(word, str) else tuple(map(plain_number, word)) for word in words))
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)  # vLLM accepts one string
        if stop is None or isinstance(stop, bytes) or not isinstance(stop, Iterable):
            return f"stop={self.stop!r}: must be a string or a sequence of strings"
        object.__setattr__(self, "stop", tuple(stop))
        schema = self.json_schema
        if isinstance(schema, Mapping):
            try:
                object.__setattr__(self, "json_schema", json.dumps(schema))
            except (TypeError, ValueError) as e:
                return f"json_schema={schema!r}: not serialisable as JSON ({e})"
        elif isinstance(schema, str) and schema.strip():
            # The syntax is checked here; whether xgrammar can compile the schema, at submission.
            try:
                json.loads(schema)
            except ValueError as e:
                return f"json_schema={schema!r}: not valid JSON ({e})"
        return None

    def _take_structured_outputs(self) -> str | None:
        """`structured_outputs` fills in its flat field; one given beside it must agree
        (as in `SamplingParams(**vars(params))`)."""
        given = self.structured_outputs
        if given is None:
            return None
        if not isinstance(given, StructuredOutputsParams):
            return f"structured_outputs={given!r}: must be None or a StructuredOutputsParams"
        name, value = given.flat()
        if name == "json_schema" and isinstance(value, Mapping):
            try:
                value = json.dumps(value)
            except (TypeError, ValueError) as e:
                return f"structured_outputs.json={value!r}: not serialisable as JSON ({e})"
        for flat in STRUCTURED_FIELDS:
            current = getattr(self, flat)
            if current is not None and (flat != name or current != value):
                return (f"structured_outputs={given!r} and {flat}={current!r}: give the constraint one way, "
                        "not both")
        object.__setattr__(self, name, value)
        return None

    def problem(self) -> str | None:
        """The first invalid field as 'field=value: why', or None when valid."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            return f"temperature={t!r}: must be a finite number >= 0 (0 means greedy)"
        if not is_int(self.top_k) or self.top_k < 0 or self.top_k > INT32_MAX:
            return f"top_k={self.top_k!r}: must be an int >= 0, or -1 (0 and -1 mean off)"
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            return f"top_p={p!r}: must lie in (0, 1]"
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0.0 <= m <= 1.0):
            return f"min_p={m!r}: must lie in [0, 1]"
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= UINT64_MAX):
            return f"seed={self.seed!r}: must be None or an int in [0, 2**64)"
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT32_MAX:
            return f"min_tokens={self.min_tokens!r}: must be an int in [0, 2**31)"
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            return f"max_tokens={self.max_tokens!r}: must be None or an int >= 1"
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            return f"min_tokens={self.min_tokens!r}: exceeds max_tokens={self.max_tokens!r}"
        if self.logprobs is not None and (not is_int(self.logprobs) or not -1 <= self.logprobs <= INT32_MAX):
            return (f"logprobs={self.logprobs!r}: must be None, an int in [0, 2**31) (top-N alternatives) or -1 "
                    "(the whole vocabulary)")
        pl = self.prompt_logprobs
        if not (pl is None or isinstance(pl, bool) or (is_int(pl) and -1 <= pl <= INT32_MAX)):
            return (f"prompt_logprobs={pl!r}: must be a bool, an int in [0, 2**31) (top-N alternatives) or -1 "
                    "(the whole vocabulary)")
        for tok in self.stop_token_ids:
            if not is_int(tok) or not 0 <= tok <= INT32_MAX:
                return f"stop_token_ids={self.stop_token_ids!r}: token {tok!r} is not an int32 token id >= 0"
        if not isinstance(self.ignore_eos, bool):
            return f"ignore_eos={self.ignore_eos!r}: must be a bool"
        return self._controls_problem()

    def _controls_problem(self) -> str | None:
        """The first invalid penalty, bias, mask, n, stop or structured-output field."""
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not math.isfinite(rp) or rp <= 0:
            return f"repetition_penalty={rp!r}: must be a finite number > 0 (1 means off)"
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                return f"{name}={value!r}: must lie in [{low:g}, {high:g}] (0 means off)"
        low, high = LOGIT_BIAS_RANGE
        for tok, bias in (self.logit_bias or {}).items():
            if not is_int(tok) or not 0 <= tok <= INT32_MAX:
                return f"logit_bias: key {tok!r} is not an int32 token id >= 0"
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not low <= bias <= high:
                return f"logit_bias[{tok}]={bias!r}: must lie in [{low:g}, {high:g}]"
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                return "allowed_token_ids=(): an empty allowed set leaves nothing to sample (None means no restriction)"
            for tok in self.allowed_token_ids:
                if not is_int(tok) or not 0 <= tok <= INT32_MAX:
                    return f"allowed_token_ids: token {tok!r} is not an int32 token id >= 0"
        for j, word in enumerate(self.bad_words or ()):
            if not word:
                return f"bad_words[{j}]={word!r}: an empty bad word bans nothing"
            if isinstance(word, str):
                if not word.strip():
                    return f"bad_words[{j}]={word!r}: a word of white space bans nothing"
                continue
            for tok in word:
                if not is_int(tok) or not 0 <= tok <= INT32_MAX:
                    return f"bad_words[{j}]: token {tok!r} is not an int32 token id >= 0"
        if not is_int(self.n) or self.n < 1:
            return f"n={self.n!r}: must be an int >= 1"
        if self.n > 1 and self.is_greedy:
            return f"n={self.n}: must be 1 when temperature=0 (greedy): every sample would be the same (as vLLM)"
        for s in self.stop:
            if not isinstance(s, str) or not s:
                return f"stop={self.stop!r}: {s!r} is not a non-empty string"
        if not isinstance(self.include_stop_str_in_output, bool):
            return f"include_stop_str_in_output={self.include_stop_str_in_output!r}: must be a bool"
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None]
        for name in given:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                return f"{name}={value!r}: must be None or a non-empty string"
        if len(given) > 1:
            return f"{given[0]} and {given[1]}: at most one structured-output constraint per request"
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                return f"{name}={getattr(self, name)!r}: must be a bool"
        return None

    @property
    def has_penalties(self) -> bool:
        """Repetition, presence or frequency penalty on (they need the token counts)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def structured(self) -> tuple[str, str] | None:
        """("json_schema" | "regex" | "grammar", its text), or None."""
        for name in STRUCTURED_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def num_prompt_logprobs(self) -> int:
        """-1 when prompt logprobs are off, else the number of top-N alternatives
        (`WHOLE_VOCABULARY` for -1, until the loop reads it as the vocabulary's size)."""
        pl = self.prompt_logprobs
        if pl is None or pl is False:
            return -1
        return 0 if pl is True else WHOLE_VOCABULARY if pl == -1 else int(pl)

    @property
    def num_logprobs(self) -> int:
        """-1 when sample logprobs are off, else the number of top-N alternatives
        (`WHOLE_VOCABULARY` for -1, as `num_prompt_logprobs`)."""
        if self.logprobs is None:
            return -1
        return WHOLE_VOCABULARY if self.logprobs == -1 else int(self.logprobs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SeqMeta:
    """One request's view of one step (docs/contract.md §1).

    `seqlen_k` is the context length after this step's tokens. In a decode step
    `seqlen_q = 1 + drafts`; the first query token is the last generated one.
    `forced_token`: the token the request's first sample row emits this step
    whatever its logits say (a "golden" token, docs/contract.md §2); None = sample.
    The engine checks it lies inside the vocabulary. `ledger_record` (bytes, not a
    field): the values the ledger reads, packed once the fields are validated.
    """

    __slots__ = ("ledger_record", "__dict__", "__weakref__")  # the record outside vars(seq), as SamplingParams

    def __setstate__(self, state: tuple[dict, dict | None]) -> None:
        set_state(self, state)

    request_id: Hashable
    is_prompt: bool
    seqlen_q: int
    seqlen_k: int
    prompt_len: int
    prompt_tokens: Sequence[int] | None = None
    num_generated: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    mtp_read_slot: int = 0
    mtp_write_slot: int = 0
    forced_token: int | None = None

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(f"request {self.request_id!r}: {problem}")
        forced = -1 if self.forced_token is None else self.forced_token
        # Not a field: this view of the step as one `SEQ_RECORD`; a batch of them joined is
        # what `prepare_sampler_inputs` reads, in one go.
        object.__setattr__(self, "ledger_record", SEQ_PACKER.pack(
            self.is_prompt, self.seqlen_q, self.seqlen_k, self.prompt_len, self.num_generated, self.mtp_read_slot,
            self.mtp_write_slot, forced) + self.params.ledger_record)

    def problem(self) -> str | None:
        """The first invalid field as 'field=value: why', or None when valid."""
        if not isinstance(self.params, SamplingParams):
            return f"params={self.params!r}: must be a SamplingParams"
        param_problem = self.params.problem()
        if param_problem:
            return f"params.{param_problem}"
        if not isinstance(self.is_prompt, bool):
            return f"is_prompt={self.is_prompt!r}: must be a bool"
        for name in ("seqlen_q", "seqlen_k", "prompt_len", "num_generated", "mtp_read_slot", "mtp_write_slot"):
            value = getattr(self, name)
            if not is_int(value) or not 0 <= value <= INT32_MAX:
                return f"{name}={value!r}: must be an int in [0, 2**31)"
        if self.seqlen_q < 1:
            return f"seqlen_q={self.seqlen_q}: must be >= 1 (a scheduled request has at least one query token)"
        if self.seqlen_k < self.seqlen_q:
            return f"seqlen_k={self.seqlen_k}: is smaller than seqlen_q={self.seqlen_q} (seqlen_k counts this step's tokens too)"
        if self.prompt_len < 1:
            return f"prompt_len={self.prompt_len}: must be >= 1"
        if self.is_prompt and self.seqlen_k > self.prompt_len:
            return (
                f"seqlen_k={self.seqlen_k}: a prompt chunk reaches past prompt_len={self.prompt_len}"
                " (schedule the remainder as decode, or fix prompt_len)"
            )
        if self.prompt_tokens is not None:
            prompt = self.prompt_tokens
            if isinstance(prompt, (str, bytes, Mapping)) or not hasattr(prompt, "__len__"):
                return f"prompt_tokens={prompt!r}: must be a flat sequence of int token ids, not a {type(prompt).__name__}"
            if len(prompt) != self.prompt_len:
                return f"prompt_tokens: has {len(prompt)} tokens but prompt_len={self.prompt_len}"
            try:
                tokens = np.asarray(prompt)
            except (ValueError, TypeError):  # ragged nesting
                tokens = np.asarray(prompt, dtype=object)
            if tokens.ndim != 1:
                return f"prompt_tokens: shape {tokens.shape}: must be a flat (1-D) sequence of int token ids"
            if tokens.size and tokens.dtype.kind not in "iu":
                if not isinstance(prompt, np.ndarray):
                    # A Python list that numpy could not type as ints (a float,
                    # a bool, an int past int64, a nested list): name the element.
                    for j, t in enumerate(prompt):
                        if not is_int(plain_number(t)) or not 0 <= t <= INT32_MAX:
                            return f"prompt_tokens[{j}]={t!r}: not an int32 token id >= 0"
                return f"prompt_tokens: dtype {tokens.dtype} is not an integer type"
            bad = np.flatnonzero((tokens < 0) | (tokens > INT32_MAX)) if tokens.size else ()
            if len(bad):
                return f"prompt_tokens[{bad[0]}]={int(tokens[bad[0]])}: not an int32 token id >= 0"
        drafts = self.seqlen_q - 1
        if not self.is_prompt and self.seqlen_k != self.prompt_len + self.num_generated + drafts:
            return (
                f"seqlen_k={self.seqlen_k}: a decode step has seqlen_k == prompt_len + num_generated + drafts = "
                f"{self.prompt_len} + {self.num_generated} + {drafts} = {self.prompt_len + self.num_generated + drafts}"
                " (its first query token is the last generated one)"
            )
        if self.params.num_prompt_logprobs >= 0 and self.is_prompt and self.prompt_tokens is None:
            return "params.prompt_logprobs: requested but prompt_tokens is None (targets come from the prompt)"
        forced = self.forced_token
        if forced is not None and (not is_int(forced) or not 0 <= forced <= INT32_MAX):
            return f"forced_token={forced!r}: must be None or an int token id >= 0"
        return None

    @property
    def num_drafts(self) -> int:
        return 0 if self.is_prompt else self.seqlen_q - 1

    @property
    def is_last_chunk(self) -> bool:
        return self.is_prompt and self.seqlen_k == self.prompt_len
