"""How a StepEngine is set up (`EngineConfig`), what it counts (`EngineStats`), and the host
state that spans its steps, for undoing one (`EngineCheckpoint`, `StepEngine.checkpoint`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Hashable

import torch

from engine.ops import default_block_rows
from engine.sampling.sampler import SamplerConfig
from engine.step.prompt_logprobs import DEFAULT_CHUNK_ROWS, PromptLogprob
from graphs.replay import BucketTable, ReplayCounts

VERIFY_MODES = ("strict", "rejection")
# How a local LM head runs its step: "torch" (torch ops: the CPU path, and on CUDA the reference),
# "triton" (fused Triton kernels, one graph per bucket), "auto" (triton on CUDA, torch elsewhere).
KERNELS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class EngineConfig:
    max_num_reqs: int = 64
    max_draft_tokens: int = 0
    verify_mode: str = "strict"  # "strict": accept drafts equal to the draws; "rejection": Leviathan et al.
    # Draft-info pool slots incl. padding slot 0; None: max_num_reqs + 1. 1: no pool, drafts
    # come only from the caller (`draft_tokens`), every write slot is 0 and nothing is written.
    draft_pool_slots: int | None = None
    top_k_space_verify: bool = False  # verify in each request's top-k space (requests need top_k > 0)
    buckets: tuple[int, ...] | None = None  # None: the default rule of graphs/replay.py
    device: str = "auto"  # "auto": cuda when available, else cpu
    use_graphs: bool = True  # replay captured graphs (call StepEngine.capture() first); False: run eagerly
    max_source_rows: int = 8192  # rows of the static hidden-state source
    source_dtype: torch.dtype | None = None  # None: the LM-head weight's dtype
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    # On the CPU, lighter steps where the requests need less of the sampler, picked on the
    # host per step: the argmax alone when every request is greedy, no threshold passes when
    # no sampled request has top-k, top-p or min-p. Results do not depend on the choice
    # (each row's definitions are the same), only speed. False: every stage every step.
    sampler_variants: bool = True
    # The per-row token bitmask stage (structured output, bad words; docs/contract.md §2);
    # on the CPU only steps that restrict a row run it. False: no bitmask buffer, and a step
    # with a bitmask is refused.
    token_bitmask: bool = True
    batch_invariant: bool = True  # LM head in fixed row blocks: tokens independent of the bucket
    # Rows per LM-head GEMM in batch-invariant mode, for the sampled rows and the
    # prompt logprobs alike. None: `engine.ops.default_block_rows` of the device.
    logits_block_rows: int | None = None
    eos_token_id: int | None = None
    max_stop_ids: int = 8  # EOS plus stop_token_ids per request, for min_tokens suppression
    prompt_logprobs_chunk_rows: int = DEFAULT_CHUNK_ROWS
    compaction_keep_tokens: int | None = None
    # Sampling controls (docs/contract.md §2): per-request state for this many
    # requests at once (penalties, logit_bias, allowed_token_ids), handed out to
    # the requests that use them. 0: nothing allocated, the step as without them.
    max_control_slots: int = 0
    max_logit_bias: int = 1024  # logit_bias entries per request, as vLLM
    max_allowed_token_ids: int = 1024  # allowed_token_ids per request, as vLLM
    seed_base: int = 0  # salts the seeds of requests that bring none
    check_addresses_each_replay: bool = False  # debug: verify static addresses before every replay
    # The local head's implementation (`KERNELS`). "triton" off CUDA runs the kernels in
    # Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported): for tests.
    kernels: str = "auto"

    def __post_init__(self) -> None:
        def positive(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"EngineConfig.{name}={value!r}: must be an int >= {minimum}")

        for name in ("max_num_reqs", "max_source_rows", "max_stop_ids", "prompt_logprobs_chunk_rows",
                     "max_logit_bias", "max_allowed_token_ids"):
            positive(name)
        positive("max_control_slots", 0)
        if self.logits_block_rows is not None:
            positive("logits_block_rows")
        positive("max_draft_tokens", 0)
        if self.verify_mode not in VERIFY_MODES:
            raise ValueError(f"EngineConfig.verify_mode={self.verify_mode!r}: must be one of {VERIFY_MODES}")
        if self.draft_pool_slots is not None:
            positive("draft_pool_slots", 1)
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as err:
                raise ValueError(f"EngineConfig.device={self.device!r}: {err}") from None
        if self.eos_token_id is not None and (isinstance(self.eos_token_id, bool) or not isinstance(self.eos_token_id, int) or self.eos_token_id < 0):
            raise ValueError(f"EngineConfig.eos_token_id={self.eos_token_id!r}: must be None or an int >= 0")
        if self.compaction_keep_tokens is not None:
            positive("compaction_keep_tokens")
        if not isinstance(self.sampler, SamplerConfig):
            raise ValueError(f"EngineConfig.sampler={self.sampler!r}: must be a SamplerConfig")
        if not isinstance(self.sampler_variants, bool):
            raise ValueError(f"EngineConfig.sampler_variants={self.sampler_variants!r}: must be a bool")
        if self.kernels not in KERNELS:
            raise ValueError(f"EngineConfig.kernels={self.kernels!r}: must be one of {KERNELS}")
        BucketTable(self.max_num_reqs, self.buckets)  # raises naming the bad bucket

    @cached_property
    def block_rows(self) -> int:
        if self.logits_block_rows is not None:
            return self.logits_block_rows
        return default_block_rows(self.resolved_device())

    @cached_property
    def pool_slots(self) -> int:
        if self.max_draft_tokens == 0:
            return 1
        return self.draft_pool_slots if self.draft_pool_slots is not None else self.max_num_reqs + 1

    @cached_property
    def draft_pool(self) -> bool:
        """Whether drafts may come from the draft-info pool (slot 0 padding plus real slots)."""
        return self.pool_slots > 1

    def resolved_kernels(self) -> str:
        """ "triton" or "torch": `kernels`, with "auto" triton on CUDA, torch elsewhere."""
        if self.kernels != "auto":
            return self.kernels
        return "triton" if self.resolved_device().type == "cuda" else "torch"

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class EngineStats:
    steps: int = 0
    replays: int = 0
    eager_steps: int = 0  # use_graphs=False, or graphs never captured
    eager_fallbacks: int = 0  # above the largest bucket
    source_copies: int = 0  # steps whose hidden states were copied into the static source
    greedy_steps: int = 0  # CPU steps sampled by the argmax alone (EngineConfig.sampler_variants)
    plain_steps: int = 0  # CPU steps sampled without threshold passes (no filtered request)
    bucket_histogram: dict[int, int] = field(default_factory=dict)
    host_seconds: float = 0.0  # ledger + validation + staging, summed
    logits_kernel: str = "plain"  # the LM head's verified block GEMM, e.g. "onednn[16]"; "plain": one GEMM



@dataclass(frozen=True)
class EngineCheckpoint:
    """The host state of a StepEngine that spans steps (see `StepEngine.checkpoint`)."""

    # Per front's request table: its requests' partial prompt logprobs.
    partial_prompt_logprobs: dict[object, dict[Hashable, list[PromptLogprob]]]
    stats: EngineStats  # a copy of the engine's stats
    head_stats: object | None  # a copy of its LM head's own counters (`LMHead.stats`), if any
    replayer_counts: ReplayCounts  # `StepEngine.replayer`'s
    control_steps: int | None = None  # `SamplingControls.steps`, None without controls
