"""ShardedStepEngine: the StepEngine's step over a vocab-sharded LM head.

    step(hidden, seqs on the driver / None or seqs on followers)
      -> driver: ledger, stop ids, drafts         (engine.host.ledger, once per step)
      -> broadcast: header check + packed ledger  (cp_broadcast)
      -> strategy: "candidates" when the batch allows it, else "gather" (counted)
      -> stage + copy, replay the bucket's graph of that strategy:
           gather -> local logits -> collectives -> sample   (vocab_parallel)
      -> exact rows over all-gathered logits, prompt logprobs (gathered, eager)
      -> StepOutput, the same on every rank

Every rank holds the full hidden states (tensor-parallel layers end with an
all-reduce) and its `[V_rank, H]` shard. The host side after the broadcast
(staging, replay, exact rows, output assembly, strict draft verification)
is StepEngine's own code: this class only swaps the device step, the exact
rows, the eager fallback and the prompt logprobs for their sharded versions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from engine.host.ledger import SamplerInputs, prepare_sampler_inputs
from engine.ops import DEFAULT_BLOCK_ROWS, gather
from engine.host.params import SeqMeta
from engine.parallel.cp_broadcast import LedgerBroadcaster, StepPlan, batch_fingerprint, config_fingerprint
from engine.parallel.vocab_parallel import STRATEGIES, VocabParallelSampler, VocabShards, candidate_ineligibility
from engine.step.prompt_logprobs import PromptRowResults
from engine.step.staging import StepArrays
from engine.step.step_engine import EngineConfig, StepEngine, StepOutput
from graphs.replay import CaptureReport, GraphReplayer
from profiling.ranges import stage


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
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        shards = VocabShards.split(vocab_size, tp)
        if lm_head_shard.dim() != 2 or lm_head_shard.shape[0] != shards.sizes[rank]:
            raise ValueError(
                f"lm_head_shard: shape {tuple(lm_head_shard.shape)}, rank {rank} of tp={tp} holds "
                f"{shards.sizes[rank]} vocabulary rows (VocabShards.split({vocab_size}, {tp}))"
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
        # StepEngine sizes its static buffers (full-vocabulary logits: the
        # gather strategy's target) from the head's shape: hand it a
        # zero-stride [V, H] stand-in (which nothing packs or reads), then keep
        # only this rank's shard.
        full_shape = torch.empty((), dtype=lm_head_shard.dtype, device=lm_head_shard.device).expand(
            vocab_size, lm_head_shard.shape[1]
        )
        super().__init__(full_shape, config)
        self.weight = lm_head_shard.detach()
        self.parallel, self.group, self.rank, self.tp, self.shards = parallel, group, rank, tp, shards
        self.vocab_parallel = VocabParallelSampler(
            shards,
            rank,
            max_rows=self.buffers.max_rows,
            k_cap=parallel.k_cap,
            max_stop_ids=config.max_stop_ids,
            sampler=config.sampler,
            full_logits=self.buffers.logits,
            group=group,
        )
        static = {**self.buffers.static_tensors(), **self.vocab_parallel.static_tensors()}
        # One replayer per strategy: a captured graph fixes its collectives.
        self.replayers = {
            strategy: GraphReplayer(
                lambda bucket, strategy=strategy: self._sharded_device_step(bucket, strategy),
                self.buckets,
                static,
                self.device,
                check_addresses_each_replay=config.check_addresses_each_replay,
            )
            for strategy in STRATEGIES
        }
        self.replayer = self.replayers[parallel.strategy]
        self.small_replayer = None  # the sharded step samples through vocab_parallel; no small-candidate variant
        self._strategy = parallel.strategy
        self.broadcaster = LedgerBroadcaster(group, src=parallel.src)
        self.config_fingerprint = config_fingerprint(vocab_size, tp, self.hidden_size, config, parallel)
        self.parallel_stats = ParallelStats()
        self.stats_attributes = (*self.stats_attributes, "parallel_stats")
        self.all_replayers = [self.replayers[s] for s in STRATEGIES]

    def capture(self, progress: bool = False) -> list[CaptureReport]:
        """Capture both strategies' graphs, gather first (every rank must
        capture together: each capture run issues the step's collectives)."""
        return [self.replayers[s].capture(progress=progress) for s in STRATEGIES]

    # -- the device step ------------------------------------------------------------

    def _sharded_device_step(self, bucket: int, strategy: str) -> None:
        """The captured part: local logits of this shard, the strategy's
        collectives, the draw, then StepEngine's in-graph verification."""
        b, vp = self.buffers, self.vocab_parallel
        rows = b.rows_for(bucket)
        gather(b.source, b.inputs.selected_token_indices[:rows], out=b.hidden[:rows])
        vp.local_logits_of(
            b.hidden[:rows], self.weight, batch_invariant=self.config.batch_invariant, block_rows=self.config.block_rows
        )
        if strategy == "gather":
            vp.sample_gathered(rows, b.params(bucket), b.outputs(rows))
        else:
            vp.sample_candidates(rows, b.params(bucket), b.outputs(rows))
        self._fail_non_finite_hidden(rows)
        if self.config.max_draft_tokens:
            self._verify_and_store_drafts(bucket)

    # -- one step -----------------------------------------------------------------

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
            inputs = prepare_sampler_inputs(
                seqs,
                max_draft_tokens=self.config.max_draft_tokens,
                compaction_keep_tokens=self.config.compaction_keep_tokens,
                seed_base=self.config.seed_base,
            )
            self._validate(hidden_states, inputs)
            stop_ids = self.stop_id_matrix(seqs)
            arrays = self.step_arrays(inputs, stop_ids, draft_tokens=draft_tokens)
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
        self._choose_strategy(inputs)
        return self.run(hidden_states, inputs, arrays, host_start=start)

    def _choose_strategy(self, inputs: SamplerInputs) -> None:
        """Same decision on every rank: it reads only the broadcast plan."""
        strategy = self.parallel.strategy
        if strategy == "candidates":
            reason = candidate_ineligibility(inputs.temperatures, inputs.top_ks, self.parallel.k_cap, self.vocab_size)
            if reason is not None:
                strategy = "gather"
                self.parallel_stats.candidate_fallbacks += 1
                self.parallel_stats.last_fallback_reason = reason
        self._strategy = strategy
        self.replayer = self.replayers[strategy]
        n, largest = inputs.num_reqs, self.buckets.largest
        parts = [self.buckets.bucket_for(min(n - a, largest)) for a in range(0, n, largest)]
        rows = sum(self.buffers.rows_for(p) for p in parts)
        if strategy == "gather":
            self.parallel_stats.gather_steps += 1
        else:
            self.parallel_stats.candidate_steps += 1
        self.parallel_stats.exchanged_bytes += self.vocab_parallel.exchanged_bytes(strategy, rows)

    def _collect(self, bucket: int, arrays: StepArrays, *, want_top: bool, want_logprobs: bool = True) -> dict:
        """StepEngine's collection; after a candidate step with flagged rows the
        full logits it redoes them over are gathered first. Every rank sees the
        same flags (they derive from the merged data), so all gather together."""
        if self._strategy == "candidates":
            rows = len(arrays.row_to_req)
            if bool(self.buffers.out.needs_exact[:rows].any()):
                capacity = self.buffers.rows_for(bucket)
                self.vocab_parallel.all_gather_logits(capacity)
                self.parallel_stats.exact_gathers += 1
                self.parallel_stats.exchanged_bytes += self.vocab_parallel.exchanged_bytes("gather", capacity)
        return super()._collect(bucket, arrays, want_top=want_top, want_logprobs=want_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: SamplerInputs) -> PromptRowResults:
        return self.vocab_parallel.prompt_logprobs(
            hidden,
            self.weight,
            inputs,
            chunk_rows=self.config.prompt_logprobs_chunk_rows,
            batch_invariant=self.config.batch_invariant,
            # The unsharded engine's prompt logprobs use get_logits' default
            # row blocks, not logits_block_rows: the same blocks, the same bits.
            block_rows=DEFAULT_BLOCK_ROWS,
        )
