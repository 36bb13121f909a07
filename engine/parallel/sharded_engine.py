"""ShardedStepEngine: the StepEngine's step over a vocab-sharded LM head.

    step(hidden, seqs on the driver / None or seqs on followers)
      -> driver: ledger, stop ids, drafts         (engine.host.ledger, once per step)
      -> broadcast: header check + packed ledger  (cp_broadcast)
      -> StepEngine.run with a VocabParallelHead:
           strategy: "candidates" when the batch allows it, else "gather" (counted)
           replay the bucket's graph of that strategy:
             gather -> local logits -> collectives -> sample   (vocab_parallel)
           exact rows over all-gathered logits, prompt logprobs (gathered, eager)
      -> StepOutput, the same on every rank

Every rank holds the full hidden states (tensor-parallel layers end with an
all-reduce) and its `[V_rank, H]` shard. Everything after the broadcast
(staging, replay, exact rows, output assembly, strict draft verification) is
StepEngine's own code; what depends on the sharded vocabulary is the
`VocabParallelHead` strategy the engine is built with.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from engine.host.ledger import SamplerInputs, prepare_sampler_inputs
from engine.host.params import SeqMeta
from engine.parallel.cp_broadcast import LedgerBroadcaster, StepPlan, batch_fingerprint, config_fingerprint
from engine.parallel.vocab_parallel import STRATEGIES, VocabParallelSampler, VocabShards, candidate_ineligibility
from engine.step.engine_config import EngineConfig, EngineStats
from engine.step.lm_head import LMHead, checked_head_weight
from engine.step.step_output import StepOutput
from engine.step.prompt_logprobs import PromptRowResults
from engine.step.staging import StepArrays
from engine.step.static_buffers import StepBuffers
from engine.step.step_engine import StepEngine
from engine.trace import stage
from graphs.replay import CaptureReport


@dataclass(frozen=True)
class ParallelConfig:
    strategy: str = "candidates"  # "gather" or "candidates" (falls back to gather per step)
    k_cap: int = 64  # largest top_k the candidate strategy serves
    src: int = 0  # the driver rank

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"ParallelConfig.strategy={self.strategy!r}: must be one of {STRATEGIES}")
        if isinstance(self.k_cap, bool) or not isinstance(self.k_cap, int) or self.k_cap < 1:
            raise ValueError(f"ParallelConfig.k_cap={self.k_cap!r}: must be an int >= 1")


@dataclass
class ParallelStats:
    gather_steps: int = 0
    candidate_steps: int = 0
    candidate_fallbacks: int = 0  # steps asked to use candidates that the batch did not allow
    last_fallback_reason: str | None = None
    exact_gathers: int = 0  # full-logit gathers for rows the candidate path flagged
    exchanged_bytes: int = 0  # received by this rank from the step collectives, summed


class VocabParallelHead(LMHead):
    """Rank `dist.get_rank(group)`'s shard of a vocab-parallel LM head, one graph set
    per strategy (a captured graph fixes its collectives): "gather" all-gathers
    full logits rows into the engine's `buffers.logits` and samples them as the
    unsharded engine does; "candidates" exchanges each shard's top candidates
    and block masses only. Its LM-head GEMM runs `get_logits`' own blocks of
    `EngineConfig.block_rows` rows, for the sampled rows and the prompt
    logprobs alike."""

    graph_sets = STRATEGIES
    flags_exact_rows = True  # the candidate exchange leaves ties past its candidates to the reference path

    def __init__(self, lm_head_shard: torch.Tensor, vocab_size: int, config: EngineConfig, parallel: ParallelConfig,
                 group: dist.ProcessGroup | None) -> None:
        self.rank, self.tp = dist.get_rank(group), dist.get_world_size(group)
        self.shards = VocabShards.split(vocab_size, self.tp)
        self.weight = checked_head_weight(lm_head_shard, config.resolved_device(), "lm_head_shard")
        if self.weight.shape[0] != self.shards.sizes[self.rank]:
            raise ValueError(
                f"lm_head_shard: shape {tuple(self.weight.shape)}, rank {self.rank} of tp={self.tp} holds "
                f"{self.shards.sizes[self.rank]} vocabulary rows (VocabShards.split({vocab_size}, {self.tp}))"
            )
        if parallel.strategy == "candidates":
            if config.sampler.logprobs_mode != "raw":
                raise ValueError(
                    f"ParallelConfig.strategy='candidates' with SamplerConfig.logprobs_mode="
                    f"{config.sampler.logprobs_mode!r}: processed logprobs of greedy rows span the whole row; use 'gather'"
                )
            if config.max_draft_tokens and (config.verify_mode != "strict" or config.top_k_space_verify):
                raise ValueError(
                    f"ParallelConfig.strategy='candidates' with EngineConfig.verify_mode={config.verify_mode!r}, "
                    f"top_k_space_verify={config.top_k_space_verify}: only strict verification works on candidates; use 'gather'"
                )
        self.config, self.parallel, self.group = config, parallel, group
        self.vocab_size, self.hidden_size = vocab_size, self.weight.shape[1]
        self.dtype = self.weight.dtype
        self.stats = ParallelStats()
        self.buffers: StepBuffers | None = None
        self.sampler: VocabParallelSampler | None = None

    def attach(self, buffers: StepBuffers) -> None:
        self.buffers = buffers
        self.sampler = VocabParallelSampler(
            self.shards,
            self.rank,
            max_rows=buffers.max_rows,
            k_cap=self.parallel.k_cap,
            max_stop_ids=self.config.max_stop_ids,
            sampler=self.config.sampler,
            full_logits=buffers.logits,  # the gather strategy's target, and the exact rows'
            group=self.group,
        )

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return self.sampler.static_tensors()

    def logits_and_sample(self, bucket: int, graphs: str) -> None:
        """Local logits of this shard, then the strategy's collectives and the draw."""
        b, vp = self.buffers, self.sampler
        rows = b.rows_for(bucket)
        vp.local_logits_of(b.hidden[:rows], self.weight, batch_invariant=self.config.batch_invariant,
                           block_rows=self.config.block_rows)
        if graphs == "gather":
            vp.sample_gathered(rows, b.params(bucket), b.outputs(rows))
        else:
            vp.sample_candidates(rows, b.params(bucket), b.outputs(rows))

    def graphs_for(self, inputs: SamplerInputs, rows: int, stats: EngineStats) -> str:
        """The configured strategy, or "gather" where the batch does not allow
        candidates. The same decision on every rank: it reads only the broadcast plan."""
        strategy = self.parallel.strategy
        if strategy == "candidates":
            reason = candidate_ineligibility(inputs.temperatures, inputs.top_ks, self.parallel.k_cap, self.vocab_size)
            if reason is not None:
                strategy = "gather"
                self.stats.candidate_fallbacks += 1
                self.stats.last_fallback_reason = reason
        if strategy == "gather":
            self.stats.gather_steps += 1
        else:
            self.stats.candidate_steps += 1
        self.stats.exchanged_bytes += self.sampler.exchanged_bytes(strategy, rows)
        return strategy

    def before_exact_rows(self, graphs: str, bucket: int, flagged: bool) -> None:
        """After a candidate step with flagged rows the full logits they are redone
        over are gathered first. Every rank sees the same flags (they derive from
        the merged data), so all gather together."""
        if graphs == "candidates" and flagged:
            capacity = self.buffers.rows_for(bucket)
            self.sampler.all_gather_logits(capacity)
            self.stats.exact_gathers += 1
            self.stats.exchanged_bytes += self.sampler.exchanged_bytes("gather", capacity)

    def prompt_logprobs(self, hidden_states: torch.Tensor, inputs: SamplerInputs) -> PromptRowResults:
        return self.sampler.prompt_logprobs(
            hidden_states,
            self.weight,
            inputs,
            chunk_rows=self.config.prompt_logprobs_chunk_rows,
            batch_invariant=self.config.batch_invariant,
            block_rows=self.config.block_rows,
        )


class ShardedStepEngine(StepEngine):
    """StepEngine over rank `dist.get_rank(group)`'s shard of a vocab-parallel LM head.

    `lm_head_shard` is rows `shards.starts[rank] : + shards.sizes[rank]` of
    the full head (`VocabShards.split(vocab, tp).shard(weight, rank)`).
    Every rank calls `step` for every step; only the driver needs `seqs`.
    The candidate strategy verifies drafts in strict mode only (rejection
    and top-k-space verification read the full logits row: use "gather").
    """

    def __init__(
        self,
        lm_head_shard: torch.Tensor,
        vocab_size: int,
        config: EngineConfig | None = None,
        parallel: ParallelConfig | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        config = config or EngineConfig()
        parallel = parallel or ParallelConfig()
        head = VocabParallelHead(lm_head_shard, vocab_size, config, parallel, group)
        super().__init__(head, config)
        self.parallel, self.group, self.rank, self.tp, self.shards = parallel, group, head.rank, head.tp, head.shards
        self.broadcaster = LedgerBroadcaster(group, src=parallel.src)
        self.config_fingerprint = config_fingerprint(vocab_size, self.tp, self.hidden_size, config, parallel)

    @property
    def parallel_stats(self) -> ParallelStats:
        return self.head.stats

    def capture(self, progress: bool = False) -> list[CaptureReport]:
        """Capture both strategies' graphs, gather first (every rank must
        capture together: each capture run issues the step's collectives)."""
        return [replayer.capture(progress=progress) for replayer in self.replayers.values()]

    def step(
        self,
        hidden_states: torch.Tensor,
        seqs: Sequence[SeqMeta] | None = None,
        draft_tokens: Sequence[Sequence[int] | None] | None = None,
    ) -> StepOutput:
        """One step on every rank. The driver passes `seqs` (and drafts; None
        reads them from the draft-info pool); a follower may pass its own
        `seqs` to have them checked against the driver's, or None. On
        followers `StepOutput.request_ids` are the requests' keys
        (`cp_broadcast.request_key`)."""
        start = time.perf_counter()
        if self.broadcaster.is_driver and seqs is None:
            raise ValueError(f"rank {self.rank} is the driver: step() needs seqs")

        def build() -> StepPlan:
            for seq in seqs:  # the vocab-parallel head applies no sampling controls: refused, on every rank
                self.control_hook.check_params(seq.request_id, seq.params)
            inputs = prepare_sampler_inputs(
                seqs,
                max_draft_tokens=self.config.max_draft_tokens,
                compaction_keep_tokens=self.config.compaction_keep_tokens,
                seed_base=self.config.seed_base,
            )
            self.validate(hidden_states, inputs)
            stop_ids = self.stop_rule.matrix(seqs)
            arrays = self.drafts.step_arrays(inputs, stop_ids, draft_tokens=draft_tokens)
            row_drafts = arrays.row_drafts if arrays.row_drafts is not None else np.full(inputs.num_sample_rows, -1, np.int64)
            return StepPlan(inputs, stop_ids, row_drafts)

        with stage("ledger broadcast"):
            plan = self.broadcaster.share(
                build if self.broadcaster.is_driver else None,
                hidden_rows=hidden_states.shape[0],
                hidden_size=hidden_states.shape[-1],
                config=self.config_fingerprint,
                batch=batch_fingerprint(seqs) if seqs is not None else 0,
            )
        inputs = plan.inputs
        # Driver and followers stage the same arrays, rebuilt from the plan.
        arrays = StepArrays.from_inputs(inputs, plan.stop_ids)
        if self.config.max_draft_tokens:
            arrays.row_drafts = plan.row_drafts
            arrays.mtp_info_read_rows = inputs.mtp_info_read_rows.astype(np.int64)
            arrays.mtp_info_write_slots = inputs.mtp_info_write_slots.astype(np.int64)
        return self.run(hidden_states, inputs, arrays, host_start=start)
