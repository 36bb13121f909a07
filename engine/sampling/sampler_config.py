"""The sampler's configuration: which stages a variant (one kind of CPU step) runs
and how. Its own module so that the stage modules the sampler imports may read it
without importing the sampler; `engine.sampling.sampler` re-exports every name here.
"""
from __future__ import annotations

from dataclasses import dataclass

LOGPROBS_MODES = ("raw", "processed")
# What a sampler variant computes: "greedy" only the argmax (every
# row greedy and none with its EOS suppression on), "plain" the draw without
# filters (no sampled row has top-k, top-p or min-p), "filters" the filters too.
# Rows a variant cannot serve must not reach it.
STAGES = ("greedy", "plain", "filters")
# How the "filters" stage finds the top-k cut: "none" (no row has top-k), "topk" (a
# topk of candidate_cap scores: every top-k <= candidate_cap), "radix" (a counting
# radix select: any k).
TOP_K_MODES = ("none", "topk", "radix")


@dataclass(frozen=True)
class SamplerConfig:
    candidate_cap: int = 1024  # C: the largest top-k of the "filters" stages and of top-k-space verification
    max_logprobs: int = 20  # largest top-N the engine allocates for
    logprobs_mode: str = "raw"  # "raw": log-softmax of unprocessed logits; "processed": of the sampled distribution
    stages: str = "filters"  # STAGES: what this variant computes
    top_k: str = "radix"  # TOP_K_MODES: how "filters" finds the top-k cut
    top_p: bool = True  # whether "filters" runs top-p (False: no row has it)
    logprobs: bool = True  # False: this variant never computes logprobs (no request wants them)
    chunk_rows: int = 0  # > 0: sample at most this many rows at a time, fewer for a wide V (sampler.SLICE_ELEMENTS)
    # What a step's rows may hold (False: the host knows that no row does, and the torch
    # stages skip what only such a row needs): a greedy row among sampled ones, a row
    # whose stop ids are suppressed (min_tokens), a forced token, a temperature other than 1.
    greedy_rows: bool = True
    stop_rows: bool = True
    forced_rows: bool = True
    scaled_rows: bool = True

    def __post_init__(self) -> None:
        for name in ("candidate_cap", "max_logprobs", "chunk_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r}: must be an int")
        if self.candidate_cap < 1:
            raise ValueError(f"candidate_cap={self.candidate_cap!r}: must be >= 1")
        if self.chunk_rows < 0:
            raise ValueError(f"chunk_rows={self.chunk_rows!r}: must be >= 0 (0: no chunks)")
        if not 0 <= self.max_logprobs <= self.candidate_cap:
            raise ValueError(f"max_logprobs={self.max_logprobs!r}: must lie in [0, candidate_cap={self.candidate_cap}]")
        if self.stages not in STAGES:
            raise ValueError(f"stages={self.stages!r}: must be one of {STAGES}")
        if self.top_k not in TOP_K_MODES:
            raise ValueError(f"top_k={self.top_k!r}: must be one of {TOP_K_MODES}")
        for name in ("top_p", "logprobs", "greedy_rows", "stop_rows", "forced_rows", "scaled_rows"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a bool")
        if self.stages == "greedy" and not self.greedy_rows:
            raise ValueError("stages='greedy' with greedy_rows=False: the argmax alone serves greedy rows only")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}: must be one of {LOGPROBS_MODES}")
