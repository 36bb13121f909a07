"""Per-request inputs: sampling parameters and one request's view of one step.

Both validate on construction and name the field and the value they reject;
`SeqMeta` also names the request. Checks that need the step's context (how many
drafts the engine verifies, whether compaction is on) live in the ledger's
`validate_batch`, which runs before any shared state is touched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

import numpy as np

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1


def _is_int(value: object) -> bool:
    # bool is an int subclass; a flag passed where a count belongs is a bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. `top_k=0` is off; `temperature=0` is greedy.

    `prompt_logprobs`: False/None = off, True = the target token's logprob and
    rank only, an int N >= 0 = that plus the top-N alternatives.
    `logprobs`: None = off, an int N >= 0 = the sampled token's logprob and rank
    plus the top-N alternatives.
    """

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

    def __post_init__(self) -> None:
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise ValueError(f"stop_token_ids={ids!r}: must be a sequence of int token ids")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """The first invalid field as 'field=value: why', or None when valid."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            return f"temperature={t!r}: must be a finite number >= 0 (0 means greedy)"
        if not _is_int(self.top_k) or self.top_k < 0 or self.top_k > INT32_MAX:
            return f"top_k={self.top_k!r}: must be an int >= 0 (0 means off)"
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            return f"top_p={p!r}: must lie in (0, 1]"
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0.0 <= m <= 1.0):
            return f"min_p={m!r}: must lie in [0, 1]"
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= UINT64_MAX):
            return f"seed={self.seed!r}: must be None or an int in [0, 2**64)"
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            return f"min_tokens={self.min_tokens!r}: must be an int >= 0"
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            return f"max_tokens={self.max_tokens!r}: must be None or an int >= 1"
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            return f"min_tokens={self.min_tokens!r}: exceeds max_tokens={self.max_tokens!r}"
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            return f"logprobs={self.logprobs!r}: must be None or an int >= 0 (top-N alternatives)"
        pl = self.prompt_logprobs
        if not (pl is None or isinstance(pl, bool) or (_is_int(pl) and pl >= 0)):
            return f"prompt_logprobs={pl!r}: must be a bool or an int >= 0 (top-N alternatives)"
        for tok in self.stop_token_ids:
            if not _is_int(tok) or not 0 <= tok <= INT32_MAX:
                return f"stop_token_ids={self.stop_token_ids!r}: token {tok!r} is not an int32 token id >= 0"
        if not isinstance(self.ignore_eos, bool):
            return f"ignore_eos={self.ignore_eos!r}: must be a bool"
        return None

    @property
    def num_prompt_logprobs(self) -> int:
        """-1 when prompt logprobs are off, else the number of top-N alternatives."""
        pl = self.prompt_logprobs
        if pl is None or pl is False:
            return -1
        return 0 if pl is True else int(pl)

    @property
    def num_logprobs(self) -> int:
        """-1 when sample logprobs are off, else the number of top-N alternatives."""
        return -1 if self.logprobs is None else int(self.logprobs)

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
    The engine checks it lies inside the vocabulary.
    """

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
            if not _is_int(value) or not 0 <= value <= INT32_MAX:
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
            if len(self.prompt_tokens) != self.prompt_len:
                return f"prompt_tokens: has {len(self.prompt_tokens)} tokens but prompt_len={self.prompt_len}"
            tokens = np.asarray(self.prompt_tokens)
            if tokens.size and tokens.dtype.kind not in "iu":
                if not isinstance(self.prompt_tokens, np.ndarray):
                    # A Python list that numpy could not type as ints (a float,
                    # a bool, an int past int64): name the element.
                    j, bad = next((j, t) for j, t in enumerate(self.prompt_tokens)
                                  if not _is_int(t) or not 0 <= t <= INT32_MAX)
                    return f"prompt_tokens[{j}]={bad!r}: not an int32 token id >= 0"
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
        if forced is not None and (not _is_int(forced) or not 0 <= forced <= INT32_MAX):
            return f"forced_token={forced!r}: must be None or an int token id >= 0"
        return None

    @property
    def num_drafts(self) -> int:
        return 0 if self.is_prompt else self.seqlen_q - 1

    @property
    def is_last_chunk(self) -> bool:
        return self.is_prompt and self.seqlen_k == self.prompt_len
