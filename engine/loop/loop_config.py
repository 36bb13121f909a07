"""The loop's configuration, and the engine configuration it runs.

`LoopConfig` sizes the loop (running requests, token budget, drafts, prefix
sharing). `engine_config_for` gives the `EngineConfig` its step engine is
built with: a field the caller left at its default is filled in from the loop
and the model; a field set to a value the loop cannot honour raises
ValueError naming the field, the value and what the loop needs. Nothing the
caller set is silently replaced.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from engine.models.protocol import CausalLM
from engine.step.engine_config import EngineConfig


@dataclass(frozen=True)
class LoopConfig:
    max_num_reqs: int = 16  # running requests (also the engine's largest bucket, unless the engine asks for more)
    token_budget: int = 256  # query tokens per step, decodes first, then prefill chunks
    max_draft_tokens: int = 0  # 0 = no speculation
    ngram_max: int = 3  # longest n-gram the drafter matches
    default_max_tokens: int = 64  # when a request's params.max_tokens is None
    # Prefix sharing (models with `copy_prefix`): a request whose prompt starts with tokens
    # whose keys and values another request's cache holds copies them instead of computing
    # them. Donors are running requests and finished ones, whose caches stay until their slot
    # is needed (or `run` returns), so a follow-up turn reuses the whole conversation. A prefix
    # shorter than `min_shared_prefix` is computed; for a longer one a request waits a step
    # while the request ahead of it that shares it prefills it.
    prefix_sharing: bool = True
    min_shared_prefix: int = 16
    # Seeds of requests that bring none. None (the default): each gets a fresh one from the
    # OS's entropy when it is submitted, reported in `Completion.seed` (rerun with it to
    # reproduce the completion). An int: fully reproducible runs; the engine derives each
    # seed from this base and the request id (`EngineConfig.seed_base`), the same every run.
    seed_base: int | None = None
    max_n: int = 128  # the most samples one request may ask for (params.n)
    # Finished requests' completions kept for `forget` / `abort` / `finished`; past this
    # many the oldest are dropped (with their ids, which may then be submitted again).
    # `run()` hands back every completion that finished while it ran, dropped or not.
    max_finished: int = 4096
    # Ranks the LM head is split over by vocabulary (engine/parallel/launch.py): every rank
    # runs this loop over the same requests, in a torch.distributed group of this many ranks
    # (the caller's, or the one torchrun's environment describes). 1: this process alone.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.prefix_sharing, bool):
            raise ValueError(f"LoopConfig.prefix_sharing={self.prefix_sharing!r}: must be a bool")
        if self.seed_base is not None and (isinstance(self.seed_base, bool) or not isinstance(self.seed_base, int)
                                           or not 0 <= self.seed_base < 2**64):
            raise ValueError(f"LoopConfig.seed_base={self.seed_base!r}: must be None (fresh seeds) or an int in "
                             "[0, 2**64)")
        for name, minimum in (("max_num_reqs", 1), ("token_budget", 1), ("max_draft_tokens", 0),
                              ("ngram_max", 1), ("default_max_tokens", 1), ("min_shared_prefix", 1), ("max_n", 1),
                              ("max_finished", 1), ("tensor_parallel_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"LoopConfig.{name}={value!r}: must be an int >= {minimum}")
        if self.token_budget < self.max_num_reqs * (1 + self.max_draft_tokens):
            raise ValueError(
                f"LoopConfig.token_budget={self.token_budget}: must cover one decode step of every running "
                f"request, max_num_reqs * (1 + max_draft_tokens) = {self.max_num_reqs * (1 + self.max_draft_tokens)}"
            )

    @property
    def max_step_rows(self) -> int:
        """Model-output rows of the largest step: a full token budget, or every request verifying max drafts."""
        return max(self.token_budget, self.max_num_reqs * (1 + self.max_draft_tokens))


@dataclass(frozen=True)
class _Need:
    """What the loop needs of one EngineConfig field."""

    fill: object  # the value a field left at its default gets
    honours: Callable[[object], bool]  # whether a value the caller set works for the loop
    needs: str  # what the loop needs, for the error


def engine_config_for(config: LoopConfig, model: CausalLM, engine_config: EngineConfig | None) -> EngineConfig:
    """The `EngineConfig` a `DecodeLoop` with `config` runs over `model`.

    Fields at their default are filled in: `max_num_reqs` and
    `max_draft_tokens` from the loop, `max_source_rows` to the rows of the
    loop's largest step, `eos_token_id` from the model, `draft_pool_slots=1`
    (no draft-info pool: the loop's n-gram drafts go in as `draft_tokens`),
    `max_control_slots` to `max_num_reqs` (every request may use penalties,
    logit bias or allowed tokens), `seed_base` from `LoopConfig.seed_base`.
    Everything else (device, graphs, buckets, sampler, seeds) is the
    caller's. **Raises** ValueError naming a field whose value the loop
    cannot honour, the value and what the loop needs.
    """
    engine_config = engine_config or EngineConfig()
    rows = config.max_step_rows
    needs = {
        "max_num_reqs": _Need(config.max_num_reqs, lambda v: v >= config.max_num_reqs,
                              f">= LoopConfig.max_num_reqs={config.max_num_reqs} (every step's requests in one bucket)"),
        "max_draft_tokens": _Need(config.max_draft_tokens, lambda v: v >= config.max_draft_tokens,
                                  f">= LoopConfig.max_draft_tokens={config.max_draft_tokens}"),
        "max_source_rows": _Need(rows, lambda v: v >= rows,
                                 f">= {rows}, the model-output rows of the loop's largest step "
                                 "(max of token_budget and max_num_reqs * (1 + max_draft_tokens))"),
        "eos_token_id": _Need(model.eos_token_id, lambda v: v == model.eos_token_id,
                              f"the model's eos_token_id={model.eos_token_id!r}, which ends requests"),
        "draft_pool_slots": _Need(1, lambda v: v == 1,
                                  "1 or None: the loop keeps no draft-info pool (its n-gram drafts go in as "
                                  "draft_tokens)"),
        # Every running request may use penalties, logit_bias or allowed_token_ids.
        "max_control_slots": _Need(config.max_num_reqs, lambda v: v >= config.max_num_reqs,
                                   f">= LoopConfig.max_num_reqs={config.max_num_reqs} (a control slot for every "
                                   "running request)"),
        "compaction_keep_tokens": _Need(None, lambda v: v is None,
                                        "None: the loop's model produces a row for every query token"),
        # The loop owns the choice between fresh and derived seeds (LoopConfig.seed_base).
        "seed_base": _Need(config.seed_base or 0, lambda v: v == config.seed_base,
                           f"the seed base from LoopConfig(seed_base=...) (now {config.seed_base!r}; None draws fresh "
                           "seeds at submission): set it there"),
    }
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name in needs}
    filled = {}
    for name, need in needs.items():
        value = getattr(engine_config, name)
        if value == defaults[name]:
            filled[name] = need.fill
        elif not need.honours(value):
            raise ValueError(f"EngineConfig.{name}={value!r}: DecodeLoop needs {need.needs}")
    return dataclasses.replace(engine_config, **filled)
