"""StepEngine: one step of the tail, top to bottom.

    step(hidden, seqs, drafts)
      -> ledger         which rows, positions, parameters (host, numpy)
      -> validate       everything, before any buffer is touched
      -> stage + copy   one packed host-to-device copy into the static buffers
      -> replay         the bucket's captured graph: gather -> logits -> sample
                        -> verify drafts -> write next drafts into the pool
      -> exact rows     rows whose kept set reached past the candidates (eager)
      -> output copy    truncated to the real rows, copied out before the next replay
      -> prompt logprobs  chunked, eager, outside the graph
      -> StepOutput

A row whose hidden state or logits are not finite, or whose controls leave no
token, fails only its own request (docs/contract.md §2): the sampler marks it
inside the graph (`RowError`, copied out with the results), the request emits
nothing and `StepOutput.errors` says why. Every check of the inputs runs
before anything is staged, partial prompt logprobs are committed only once
the step has succeeded, and a step that raises anyway leaves the host state
as it found it; `checkpoint()` / `rollback()` let a caller undo a step that
returned.

`EngineConfig(use_graphs=False)` runs the same step function over the same
static buffers without a graph; a step with more requests than the largest
bucket runs eagerly over them, the largest bucket's worth of requests at a
time. With `batch_invariant=True` (the default) all three give identical
tokens: the LM head runs in fixed row blocks and the sampler's arithmetic is
per row.
"""
from __future__ import annotations

import copy
import dataclasses
import operator
import time
from dataclasses import dataclass, field
from typing import Hashable, NamedTuple, Sequence

import numpy as np
import torch

from engine.host.ledger import SamplerInputs
from engine.host.persistent_batch import SeqMetaFront
from engine.step.invariance import choose_block_gemm, lm_head_candidates, warn_not_invariant
from engine.ops import gather, get_logits
from engine.host.params import SamplingParams, SeqMeta
from engine.step.staging import StepArrays
from engine.step.prompt_logprobs import (
    DEFAULT_CHUNK_ROWS,
    PromptLogprob,
    PromptLogprobAccumulator,
    PromptRowResults,
    compute_prompt_logprobs,
)
from engine.sampling.sampler import RowError, SamplerConfig, fail_rows, raw_log_normaliser, sample, sample_exact
from graphs.step_fields import SampleOutput
from engine.sampling.verify import accept_strict, draft_in_top_k, target_probs, verify_rejection
from graphs.buckets import BucketTable
from graphs.replay import CaptureReport, GraphReplayer, ReplayCounts
from graphs.static_buffers import StepBuffers
from graphs.step_fields import READ_FROM_POOL
from profiling.ranges import stage

VERIFY_MODES = ("strict", "rejection")
# StepOutput.errors causes of a failed sample row (`RowError` codes).
ROW_ERROR_CAUSES = {
    RowError.LOGITS_NOT_FINITE: "logits row not finite (NaN or inf)",
    RowError.NOTHING_LEFT: "no token left after the sampling controls (EOS/stop suppression)",
    RowError.HIDDEN_NOT_FINITE: "hidden state not finite",
}
DRAFT_MASS_TOLERANCE = 1e-3  # |sum(exp(draft_logprobs)) - 1| accepted per draft (float32 sums)


class TokenLogprob(NamedTuple):
    """Logprob of one emitted token: its value, its rank, and the top-N alternatives."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class EngineConfig:
    max_num_reqs: int = 64
    max_draft_tokens: int = 0
    verify_mode: str = "strict"  # "strict": accept drafts equal to the draws; "rejection": Leviathan et al.
    # Draft-info pool slots incl. padding slot 0; None: max_num_reqs + 1. 1: no pool, drafts
    # come only from the caller (`draft_tokens`), every write slot is 0 and nothing is written.
    draft_pool_slots: int | None = None
    top_k_space_verify: bool = False  # verify in each request's top-k space (requests need top_k > 0)
    buckets: tuple[int, ...] | None = None  # None: the default rule of graphs/buckets.py
    device: str = "auto"  # "auto": cuda when available, else cpu
    use_graphs: bool = True
    max_source_rows: int = 8192  # rows of the static hidden-state source
    source_dtype: torch.dtype | None = None  # None: the LM-head weight's dtype
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    # A second set of graphs samples with this many candidates per row instead of
    # sampler.candidate_cap; a step uses it when every request is greedy or has
    # 1 <= top_k <= it. Results do not depend on the candidate count (rows whose
    # answer might lie past the candidates are redone exactly), only speed: a
    # top-32 of a 49k vocabulary costs a quarter of a top-1024. 0 = off.
    small_candidate_cap: int = 32
    batch_invariant: bool = True  # LM head in fixed row blocks: tokens independent of the bucket
    # Rows per LM-head GEMM in batch-invariant mode. Every block streams the
    # whole weight once, so wider blocks mean fewer weight reads for big
    # buckets and more wasted rows for small ones. None: 16 on CPU, 64 on
    # CUDA (one block covers bucket 64: the weight is read once).
    logits_block_rows: int | None = None
    eos_token_id: int | None = None
    max_stop_ids: int = 8  # EOS plus stop_token_ids per request, for min_tokens suppression
    prompt_logprobs_chunk_rows: int = DEFAULT_CHUNK_ROWS
    compaction_keep_tokens: int | None = None
    seed_base: int = 0  # salts the seeds of requests that bring none
    check_addresses_each_replay: bool = False  # debug: verify static addresses before every replay

    def __post_init__(self) -> None:
        def positive(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"EngineConfig.{name}={value!r}: must be an int >= {minimum}")

        for name in ("max_num_reqs", "max_source_rows", "max_stop_ids", "prompt_logprobs_chunk_rows"):
            positive(name)
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
        small = self.small_candidate_cap
        if isinstance(small, bool) or not isinstance(small, int) or (
            small and not self.sampler.max_logprobs <= small < self.sampler.candidate_cap
        ):
            raise ValueError(
                f"EngineConfig.small_candidate_cap={small!r}: must be 0 (off) or an int in "
                f"[sampler.max_logprobs={self.sampler.max_logprobs}, sampler.candidate_cap={self.sampler.candidate_cap})"
            )
        BucketTable(self.max_num_reqs, self.buckets)  # raises naming the bad bucket

    @property
    def block_rows(self) -> int:
        if self.logits_block_rows is not None:
            return self.logits_block_rows
        return 64 if self.resolved_device().type == "cuda" else 16

    @property
    def pool_slots(self) -> int:
        if self.max_draft_tokens == 0:
            return 1
        return self.draft_pool_slots if self.draft_pool_slots is not None else self.max_num_reqs + 1

    @property
    def draft_pool(self) -> bool:
        """Whether drafts may come from the draft-info pool (slot 0 padding plus real slots)."""
        return self.pool_slots > 1

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass(frozen=True)
class _DraftLayout:
    row_to_req: np.ndarray  # the ledger arrays this layout was derived from (identity-checked)
    sample_offsets: np.ndarray
    row_drafts: np.ndarray  # [rows] READ_FROM_POOL where a row verifies a draft, -1 on last rows
    draft_rows: np.ndarray  # rows that verify a draft
    draft_req: np.ndarray  # their request
    draft_step: np.ndarray  # their local step (= draft index)


@dataclass
class StepOutput:
    """Per request, in batch order."""

    request_ids: tuple[Hashable, ...]
    tokens: list[list[int]]  # emitted this step; empty for a non-last prefill chunk
    logprobs: list[list[TokenLogprob] | None]  # one per emitted token, None when not requested
    prompt_logprobs: list[list[PromptLogprob] | None]  # docs/contract.md §1.1: None / [] / the full list
    seeds: list[int]  # the seed each request sampled with
    num_accepted: list[int]  # drafts accepted per request (0 without drafts)
    bucket: int | None  # graph bucket used, None for an eager fallback
    replayed: bool  # True when a captured graph ran
    # None, or "request {id!r}: <cause>" for a request that failed this step
    # (non-finite hidden state or logits, no token left after the sampling
    # controls, non-finite prompt logprobs). A failed request emits nothing:
    # tokens [], logprobs [] (None when not requested), prompt_logprobs None,
    # num_accepted 0, and its accumulated prompt logprobs are dropped.
    errors: list[str | None] = field(default_factory=list)


@dataclass
class EngineStats:
    steps: int = 0
    replays: int = 0
    eager_steps: int = 0  # use_graphs=False
    eager_fallbacks: int = 0  # above the largest bucket
    source_copies: int = 0  # steps whose hidden states were copied into the static source
    exact_rows: int = 0  # rows redone over the full vocabulary
    small_candidate_steps: int = 0  # steps sampled with EngineConfig.small_candidate_cap candidates
    bucket_histogram: dict[int, int] = field(default_factory=dict)
    host_seconds: float = 0.0  # ledger + validation + staging, summed
    logits_kernel: str = "plain"  # the LM head's verified block GEMM, e.g. "mkl_packed[16]"; "plain": one GEMM


@dataclass(frozen=True)
class EngineCheckpoint:
    """The host state of a StepEngine that spans steps (see `StepEngine.checkpoint`)."""

    partial_prompt_logprobs: dict[Hashable, list[PromptLogprob]]
    stats: dict[str, object]  # deep copies of the engine's `stats_attributes`
    replayer_counts: tuple[ReplayCounts, ...]  # one per replayer, in `all_replayers` order


class StepEngine:
    """The captured tail of an inference step (docs/contract.md §4, §6)."""

    def __init__(self, lm_head_weight: torch.Tensor, config: EngineConfig | None = None):
        config = config or EngineConfig()
        if not isinstance(lm_head_weight, torch.Tensor):
            raise ValueError(f"lm_head_weight: a {_type_name(lm_head_weight)}, expected a torch.Tensor [vocab, hidden]")
        if not lm_head_weight.is_floating_point():
            raise ValueError(f"lm_head_weight: dtype {lm_head_weight.dtype}, expected a floating-point tensor")
        if lm_head_weight.dim() != 2:
            raise ValueError(f"lm_head_weight: shape {tuple(lm_head_weight.shape)} is not [vocab, hidden]")
        self.config = config
        self.device = config.resolved_device()
        if lm_head_weight.device.type != self.device.type:
            raise ValueError(
                f"lm_head_weight is on {lm_head_weight.device} but the engine runs on {self.device}: "
                "move the weight or set EngineConfig.device"
            )
        # The engine only reads the head: an nn.Parameter's autograd must not
        # record every step (nor refuse `.numpy()` on what comes out).
        self.weight = lm_head_weight.detach()
        # The LM head's block GEMM, probed here (engine.step.invariance): the configured block on
        # MKL-packed weights where there are any (CPU fp32), else the first that holds. A
        # zero-stride stand-in (the sharded engine's) is never read: nothing to probe.
        self.logits_kernel, self.batch_invariant_verified = None, False
        if config.batch_invariant and 0 not in self.weight.stride():
            self.logits_kernel, self.batch_invariant_verified = choose_block_gemm(lm_head_candidates(self.weight, config.block_rows))
            if not self.batch_invariant_verified:
                warn_not_invariant(f"the LM head {tuple(self.weight.shape)} {self.weight.dtype} on {self.device}")
        self.vocab_size, self.hidden_size = lm_head_weight.shape
        if config.eos_token_id is not None and config.eos_token_id >= self.vocab_size:
            raise ValueError(f"EngineConfig.eos_token_id={config.eos_token_id}: outside the vocabulary ({self.vocab_size})")
        self.buckets = BucketTable(config.max_num_reqs, config.buckets)
        max_rows = config.max_num_reqs * (1 + config.max_draft_tokens)
        if config.max_source_rows < max_rows:
            raise ValueError(
                f"EngineConfig.max_source_rows={config.max_source_rows}: must hold at least one step's "
                f"sample rows, max_num_reqs * (1 + max_draft_tokens) = {max_rows}"
            )
        self.buffers = StepBuffers.allocate(
            max_reqs=config.max_num_reqs,
            max_draft_tokens=config.max_draft_tokens,
            max_source_rows=config.max_source_rows,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            max_logprobs=config.sampler.max_logprobs,
            max_stop_ids=config.max_stop_ids,
            source_dtype=config.source_dtype or lm_head_weight.dtype,
            device=self.device,
            pool_slots=config.pool_slots,
            draft_probs=config.verify_mode == "rejection" and config.max_draft_tokens > 0,
        )
        def replayer(sampler: SamplerConfig) -> GraphReplayer:
            return GraphReplayer(
                lambda bucket: self._device_step(bucket, sampler),
                self.buckets,
                self.buffers.static_tensors(),
                self.device,
                check_addresses_each_replay=config.check_addresses_each_replay,
            )

        self.replayer = replayer(config.sampler)
        # Steps whose requests all need few candidates (see EngineConfig.small_candidate_cap).
        self.small_replayer = (
            replayer(dataclasses.replace(config.sampler, candidate_cap=config.small_candidate_cap))
            if config.small_candidate_cap else None
        )
        self.prompt_logprobs = PromptLogprobAccumulator()
        self.stats = EngineStats()
        # What checkpoint() / rollback() save and restore besides the accumulator.
        self.stats_attributes: tuple[str, ...] = ("stats",)
        self.all_replayers: list[GraphReplayer] = [r for r in (self.replayer, self.small_replayer) if r is not None]
        self._last_draft_layout: _DraftLayout | None = None
        # step(hidden, seqs): SeqMeta lists over a persistent table keyed by request id.
        self.seq_front = SeqMetaFront(self, capacity=2 * config.max_num_reqs)
        self.stats.logits_kernel = "plain" if self.logits_kernel is None else self.logits_kernel.name

    # -- undoing a step ---------------------------------------------------------

    def checkpoint(self) -> EngineCheckpoint:
        """The host state that spans steps: the prompt-logprob accumulator
        (partial prompt logprobs of requests between prompt chunks), the
        engine stats and the replayers' counters. `rollback` restores it, so
        a caller whose own code failed after `run`/`step` returned can undo
        the step. Not covered: device state, i.e. the static buffers (every
        step rewrites what it reads) and the draft-info pool, whose slots the
        caller's take-once bookkeeping owns."""
        return EngineCheckpoint(
            partial_prompt_logprobs=self.prompt_logprobs.snapshot(),
            stats={name: _copied(getattr(self, name)) for name in self.stats_attributes},
            replayer_counts=tuple(r.counts() for r in self.all_replayers),
        )

    def rollback(self, checkpoint: EngineCheckpoint) -> None:
        """Restore the state `checkpoint()` returned (see there)."""
        self.prompt_logprobs.restore(checkpoint.partial_prompt_logprobs)
        for name, value in checkpoint.stats.items():
            setattr(self, name, _copied(value))
        for replayer, counts in zip(self.all_replayers, checkpoint.replayer_counts):
            replayer.restore_counts(counts)

    # -- the hidden-state source ------------------------------------------------

    @property
    def source(self) -> torch.Tensor:
        """[max_source_rows, H]: a model that writes its last-layer rows here
        (batch order, from row 0) makes `step(engine.source, seqs)` zero-copy."""
        return self.buffers.source

    def _is_source(self, hidden: torch.Tensor) -> bool:
        src = self.buffers.source
        return (
            hidden.data_ptr() == src.data_ptr()
            and hidden.stride() == src.stride()
            and hidden.dtype == src.dtype
            and hidden.device == src.device
        )

    # -- capture ------------------------------------------------------------------

    def capture(self, progress: bool = False) -> CaptureReport:
        """Capture one graph per bucket (largest first); on CPU, run each once
        under the capture safety check. Reports buckets, seconds, pool bytes."""
        report = dataclasses.replace(self.replayer.capture(progress=progress), logits_kernel=self.stats.logits_kernel)
        if self.small_replayer is None:
            return report
        small = self.small_replayer.capture(progress=progress)
        pools = None if report.pool_bytes is None else report.pool_bytes + (small.pool_bytes or 0)
        return dataclasses.replace(report, seconds=report.seconds + small.seconds, pool_bytes=pools, graphs_per_bucket=2)

    def _replayer_for(self, inputs: SamplerInputs) -> GraphReplayer:
        """The small-candidate graphs when every request is greedy or has 1 <= top_k <= their cap."""
        cap = self.config.small_candidate_cap
        if self.small_replayer is None:
            return self.replayer
        top_k = inputs.top_ks
        if np.all((inputs.temperatures == 0) | ((top_k >= 1) & (top_k <= cap))):
            self.stats.small_candidate_steps += 1
            return self.small_replayer
        return self.replayer

    def _device_step(self, bucket: int, sampler: SamplerConfig) -> None:
        """The captured part: reads and writes only the static buffers."""
        b = self.buffers
        rows = b.rows_for(bucket)
        gather(b.source, b.inputs.selected_token_indices[:rows], out=b.hidden[:rows])
        get_logits(
            b.hidden[:rows],
            self.weight,
            out=b.logits[:rows],
            batch_invariant=self.config.batch_invariant,
            block_rows=self.config.block_rows,
            kernel=self.logits_kernel,
        )
        params = b.params(bucket)
        sample(b.logits[:rows], params, sampler, out=b.outputs(rows))
        self._fail_non_finite_hidden(rows)
        if self.config.max_draft_tokens:
            self._verify_and_store_drafts(bucket)

    def _fail_non_finite_hidden(self, rows: int) -> None:
        """Inside the graph: rows whose gathered hidden state holds a NaN or
        inf fail with that cause (their logits are not finite either; the
        hidden state is where the fault is)."""
        b = self.buffers
        fail_rows(b.outputs(rows), ~torch.isfinite(b.hidden[:rows]).all(-1), RowError.HIDDEN_NOT_FINITE)

    def _verify_and_store_drafts(self, bucket: int) -> None:
        """Inside the graph: resolve each row's draft, verify, then write the
        draft head's proposals for the next step into each request's write slot."""
        b, f = self.buffers, self.buffers.inputs
        rows, k = b.rows_for(bucket), self.config.max_draft_tokens
        staged = f.row_drafts[:rows]
        # Read before this step's writes: a request that reads and writes the
        # same slot verifies last step's proposals. Resolved into a static
        # buffer so a later eager re-verification reads the same drafts.
        from_pool = b.pool_tokens[f.mtp_info_read_rows[:rows]]
        torch.where(staged == READ_FROM_POOL, from_pool, staged, out=b.resolved_drafts[:rows])
        self._verify(bucket)
        if not self.config.draft_pool:
            return  # no pool: every write slot is 0, there is nothing to write
        # Slot 0 is padding and never written: writes aimed at it land in the extra slot.
        slots = f.mtp_info_write_slots[:bucket]
        slots = torch.where(slots > 0, slots, torch.full_like(slots, self.config.pool_slots))
        pool_rows = (slots[:, None] * k + torch.arange(k, device=slots.device)).flatten()  # [bucket * k]
        b.pool_tokens.index_copy_(0, pool_rows, f.next_draft_tokens[:bucket, :k].flatten())
        b.pool_logprobs.index_copy_(0, pool_rows, f.next_draft_logprobs[:bucket, :k].flatten())

    def _verify(self, bucket: int) -> None:
        """num_accepted (and, in rejection mode, the emitted token per row) from
        the rows' draws and their resolved drafts."""
        b, cfg = self.buffers, self.config
        rows = b.rows_for(bucket)
        params = b.params(bucket)
        drafts = b.resolved_drafts[:rows]  # [rows] int64, -1 = none
        k_req = params.top_ks.to(torch.int64) if cfg.top_k_space_verify else None
        if cfg.verify_mode == "strict":
            allowed = None
            if k_req is not None:
                allowed = draft_in_top_k(b.logits[:rows], drafts, k_req[params.row_to_req], cfg.sampler.candidate_cap)
            accept_strict(b.out.tokens[:rows], drafts, params.row_to_req, params.local_step, bucket,
                          draft_allowed=allowed, out=b.num_accepted[:bucket])
            return
        p = target_probs(b.logits[:rows], params)  # [rows, V] f64
        # Rows without staged probabilities count their draft as one-hot q.
        one_hot = torch.zeros_like(b.draft_probs[:rows]).scatter_(1, drafts.clamp(min=0)[:, None], 1.0)
        q = torch.where(b.inputs.has_draft_probs[:rows, None], b.draft_probs[:rows], one_hot)
        position = params.sample_positions[params.row_to_req] + params.local_step
        verify_rejection(p, drafts, q, params.seeds, position, params.row_to_req, params.local_step, bucket,
                         b.emitted[:rows], row_tokens=b.out.tokens[:rows], top_k_space=k_req,
                         max_top_k=cfg.sampler.candidate_cap if k_req is not None else None,
                         out=b.num_accepted[:bucket])

    # -- one step -----------------------------------------------------------------

    def stop_id_matrix(self, seqs: Sequence[SeqMeta]) -> np.ndarray:
        """[n, max_stop_ids] int64: EOS (unless ignore_eos) and stop ids, -1 padded."""
        matrix = np.full((len(seqs), self.config.max_stop_ids), -1, dtype=np.int64)
        for i, seq in enumerate(seqs):
            matrix[i] = self.stop_ids_for(seq.request_id, seq.params)
        return matrix

    def stop_ids_for(self, request_id: Hashable, params: SamplingParams) -> np.ndarray:
        """[max_stop_ids] int64: the ids suppressed while a request is short of
        min_tokens: EOS (unless ignore_eos) and its stop ids, -1 padded."""
        width = self.config.max_stop_ids
        row = np.full(width, -1, dtype=np.int64)
        ids = list(params.stop_token_ids)
        eos = self.config.eos_token_id
        if eos is not None and not params.ignore_eos:
            ids.insert(0, eos)
        if not ids:
            return row
        if len(ids) > width:
            raise ValueError(
                f"request {request_id!r}: params.stop_token_ids: {len(ids)} stop ids (with EOS) "
                f"but EngineConfig.max_stop_ids={width}"
            )
        if max(ids) >= self.vocab_size:
            raise ValueError(
                f"request {request_id!r}: params.stop_token_ids={params.stop_token_ids}: "
                f"outside the vocabulary ({self.vocab_size})"
            )
        row[: len(ids)] = ids
        return row

    def step(
        self,
        hidden_states: torch.Tensor,
        seqs: Sequence[SeqMeta],
        draft_tokens: Sequence[Sequence[int] | None] | None = None,
        draft_logprobs: Sequence[np.ndarray | torch.Tensor | None] | None = None,
        *,
        next_drafts: Sequence[Sequence[int] | None] | None = None,
        next_draft_logprobs: Sequence[Sequence[float] | None] | None = None,
    ) -> StepOutput:
        """Sample the step of `seqs` from `hidden_states` ([rows, H], batch order).

        Drafts (decode requests with seqlen_q = 1 + k): `draft_tokens[i]` gives
        the k drafts request i verifies; when it (or the whole argument) is
        None, they are read from the draft-info pool at the request's
        `mtp_read_slot` (slot 0: padding, nothing to accept).
        `draft_logprobs[i]` ([k, V] log-probabilities, rejection mode): the
        draft distribution each draft was drawn from; None = one-hot.
        `next_drafts[i]` / `next_draft_logprobs[i]`: up to max_draft_tokens
        proposals of a draft head for request i's next step, written into its
        `mtp_write_slot` inside the graph."""
        start = time.perf_counter()
        with stage("ledger"):
            inputs, stop_ids = self.seq_front.ledger(seqs)
            arrays = self.step_arrays(
                inputs,
                stop_ids,
                draft_tokens=draft_tokens,
                draft_logprobs=draft_logprobs,
                next_drafts=next_drafts,
                next_draft_logprobs=next_draft_logprobs,
            )
        return self.run(hidden_states, inputs, arrays, host_start=start)

    def step_arrays(
        self,
        inputs: SamplerInputs,
        stop_ids: np.ndarray,
        *,
        draft_tokens: Sequence[Sequence[int] | None] | np.ndarray | None = None,
        draft_logprobs: Sequence[np.ndarray | torch.Tensor | None] | None = None,
        next_drafts: Sequence[Sequence[int] | None] | None = None,
        next_draft_logprobs: Sequence[Sequence[float] | None] | None = None,
    ) -> StepArrays:
        """Everything the step stages, validated (names the request and field).
        `draft_tokens` may also be an [n, max_draft_tokens] array (vectorised)."""
        n, rows, k = inputs.num_reqs, inputs.num_sample_rows, self.config.max_draft_tokens
        for name, value in (("draft_tokens", draft_tokens), ("draft_logprobs", draft_logprobs),
                            ("next_drafts", next_drafts), ("next_draft_logprobs", next_draft_logprobs)):
            if value is not None and len(value) != n:
                raise ValueError(f"{name}: {len(value)} entries for {n} requests")
        arrays = StepArrays.from_inputs(inputs, stop_ids)
        if k == 0:
            for name, value in (("draft_tokens", draft_tokens), ("next_drafts", next_drafts)):
                if value is not None and any(v for v in value):
                    raise ValueError(f"{name}: drafts given but EngineConfig.max_draft_tokens=0")
            return arrays
        drafts_per_req = inputs.sample_counts - 1  # 0 for a prefill chunk (one sample row)
        layout = self._draft_layout(inputs)
        arrays.row_drafts = layout.row_drafts.copy()
        arrays.mtp_info_read_rows = inputs.mtp_info_read_rows
        arrays.mtp_info_write_slots = inputs.mtp_info_write_slots
        limit = self.config.pool_slots
        pool = (f"the draft-info pool has slots 0..{limit - 1} (EngineConfig.draft_pool_slots)" if limit > 1 else
                "EngineConfig(draft_pool_slots=1) has no draft-info pool: drafts come only from draft_tokens")
        for name, slots, bound in (("mtp_read_slot", arrays.mtp_info_read_rows, limit * k),
                                   ("mtp_write_slot", arrays.mtp_info_write_slots, limit)):
            if len(slots) and slots.max() >= bound:
                j = int(np.argmax(slots))
                req = int(inputs.row_to_req[j]) if name == "mtp_read_slot" else j
                raise ValueError(f"request {inputs.request_ids[req]!r}: {name}={int(slots[j]) * limit // bound}: {pool}")
        if limit == 1 and next_drafts is not None and any(next_drafts):
            raise ValueError(f"next_drafts: given but {pool}, nothing to write them into")
        if isinstance(draft_tokens, np.ndarray):
            # The hot path: [n, >= k] array, row i's first drafts_per_req[i] entries used.
            rows_with = layout.draft_rows
            if len(rows_with) and draft_tokens.dtype.kind not in "iu":
                i = int(layout.draft_req[0])
                raise ValueError(f"request {inputs.request_ids[i]!r}: draft_tokens: an array of dtype "
                                 f"{draft_tokens.dtype} ({draft_tokens[i].tolist()}), expected integer token ids")
            values = draft_tokens[layout.draft_req, layout.draft_step]
            if len(values) and (values.min() < 0 or values.max() >= self.vocab_size):
                bad = int(np.flatnonzero((values < 0) | (values >= self.vocab_size))[0])
                i = int(inputs.row_to_req[rows_with[bad]])
                raise ValueError(f"request {inputs.request_ids[i]!r}: draft_tokens={draft_tokens[i].tolist()}: "
                                 f"outside [0, {self.vocab_size})")
            arrays.row_drafts[rows_with] = values
            draft_tokens = None
        for i in range(n if draft_tokens is not None else 0):
            drafts = draft_tokens[i]
            if drafts is None:
                continue
            lo = int(inputs.sample_offsets[i])
            arrays.row_drafts[lo : lo + int(drafts_per_req[i])] = self._checked_tokens(
                inputs.request_ids[i], "draft_tokens", drafts, int(drafts_per_req[i]))
        if draft_logprobs is not None and any(q is not None for q in draft_logprobs):
            if self.config.verify_mode != "rejection":
                raise ValueError("draft_logprobs: only used by EngineConfig(verify_mode='rejection')")
            arrays.has_draft_probs = np.zeros(rows, dtype=bool)
            arrays.draft_probs = {}
            for i, q in enumerate(draft_logprobs):
                if q is None:
                    continue
                probs = self._checked_draft_logprobs(inputs.request_ids[i], q, int(drafts_per_req[i]))
                lo = int(inputs.sample_offsets[i])
                arrays.has_draft_probs[lo : lo + len(probs)] = True
                arrays.draft_probs[lo] = probs
        if next_drafts is not None:
            arrays.next_draft_tokens = np.full((n, k), -1, dtype=np.int64)
            arrays.next_draft_logprobs = np.zeros((n, k), dtype=np.float32)
            for i, proposal in enumerate(next_drafts):
                if not proposal:
                    continue
                if len(proposal) > k:
                    raise ValueError(f"request {inputs.request_ids[i]!r}: next_drafts has {len(proposal)} tokens, "
                                     f"max_draft_tokens={k}")
                arrays.next_draft_tokens[i, : len(proposal)] = self._checked_tokens(
                    inputs.request_ids[i], "next_drafts", proposal, len(proposal))
                if next_draft_logprobs is not None and next_draft_logprobs[i] is not None:
                    values = np.asarray(next_draft_logprobs[i], np.float32)
                    if values.shape != (len(proposal),) or np.isnan(values).any() or np.isposinf(values).any():
                        raise ValueError(f"request {inputs.request_ids[i]!r}: next_draft_logprobs={values.tolist()}: "
                                         f"expected {len(proposal)} log-probabilities (finite or -inf), one per proposal")
                    arrays.next_draft_logprobs[i, : len(proposal)] = values
        return arrays

    def _draft_layout(self, inputs: SamplerInputs) -> _DraftLayout:
        """Which rows verify a draft, and of which request and step; reused
        while the ledger hands out the same row layout (steady-state decode
        shares its arrays from step to step)."""
        cached = self._last_draft_layout
        if cached is not None and cached.row_to_req is inputs.row_to_req and cached.sample_offsets is inputs.sample_offsets:
            return cached
        # Every row verifies a draft (by default from the pool) except each
        # request's last row, which has none.
        row_drafts = np.full(inputs.num_sample_rows, READ_FROM_POOL, dtype=np.int64)
        row_drafts[inputs.sample_offsets + inputs.sample_counts - 1] = -1
        draft_rows = np.flatnonzero(row_drafts == READ_FROM_POOL)
        layout = _DraftLayout(inputs.row_to_req, inputs.sample_offsets, row_drafts, draft_rows,
                              inputs.row_to_req[draft_rows], inputs.local_step[draft_rows])
        self._last_draft_layout = layout
        return layout

    def _checked_draft_logprobs(self, request_id: Hashable, q: np.ndarray | torch.Tensor, count: int) -> torch.Tensor:
        """The draft distributions [count, V] f32 (probabilities) of a request's
        `draft_logprobs`, checked: float, the right shape, no NaN or +inf,
        each row's probabilities summing to 1."""
        if isinstance(q, (list, tuple)):
            q = np.asarray(q)
        floating = ((isinstance(q, torch.Tensor) and q.is_floating_point())
                    or (isinstance(q, np.ndarray) and q.dtype.kind == "f"))
        if not floating:
            raise ValueError(f"request {request_id!r}: draft_logprobs: a {_type_name(q)} of dtype "
                             f"{getattr(q, 'dtype', None)}, expected a float tensor [{count}, {self.vocab_size}]")
        q = torch.as_tensor(q).to(torch.float32)
        if tuple(q.shape) != (count, self.vocab_size):
            raise ValueError(f"request {request_id!r}: draft_logprobs: shape {tuple(q.shape)}, "
                             f"expected [{count}, {self.vocab_size}] (one log-distribution per draft)")
        probs = q.exp()
        mass = probs.sum(-1, dtype=torch.float64)  # [count]: NaN or inf when a logprob is NaN or +inf
        if not bool(torch.isfinite(mass).all()):
            bad = "nan" if bool(torch.isnan(q).any()) else "inf"
            raise ValueError(f"request {request_id!r}: draft_logprobs holds {bad}: log-probabilities are finite or -inf")
        off = torch.nonzero((mass - 1).abs() > DRAFT_MASS_TOLERANCE).flatten()
        if len(off):
            j = int(off[0])
            raise ValueError(f"request {request_id!r}: draft_logprobs[{j}]: the probabilities sum to "
                             f"{float(mass[j]):.6g}, not 1 (pass log-probabilities, e.g. log_softmax)")
        return probs

    def _checked_tokens(self, request_id: Hashable, name: str, tokens: Sequence[int], count: int) -> np.ndarray:
        tokens = list(tokens)
        for token in tokens:
            # operator.index takes ints, numpy and 0-d integer torch scalars;
            # a float or a string is a caller's bug, never truncated.
            try:
                if isinstance(token, (bool, np.bool_)):
                    raise TypeError
                operator.index(token)
            except TypeError:
                raise ValueError(f"request {request_id!r}: {name}={tokens!r}: {token!r} is not an int token id") from None
        values = np.asarray([operator.index(t) for t in tokens], dtype=np.int64)
        if len(values) != count:
            raise ValueError(f"request {request_id!r}: {name} has {len(values)} tokens but the request "
                             f"verifies {count} this step (seqlen_q - 1 for a decode)")
        if count and (values.min() < 0 or values.max() >= self.vocab_size):
            raise ValueError(f"request {request_id!r}: {name}={values.tolist()}: outside [0, {self.vocab_size})")
        return values

    def _validate(self, hidden: torch.Tensor, inputs: SamplerInputs) -> None:
        """Every check of a step that needs no device work: after it, nothing may raise but a bug."""
        if not isinstance(hidden, torch.Tensor):
            raise ValueError(f"hidden_states: a {_type_name(hidden)}, expected a torch.Tensor [rows, {self.hidden_size}]")
        if not hidden.is_floating_point():
            raise ValueError(f"hidden_states: dtype {hidden.dtype}, expected a floating-point tensor (the model's last-layer rows)")
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states: shape {tuple(hidden.shape)}, expected [rows, {self.hidden_size}]")
        if hidden.device.type != self.device.type:
            raise ValueError(f"hidden_states: on {hidden.device}, the engine runs on {self.device}")
        if hidden.shape[0] < inputs.num_output_rows:
            fix = " (the engine's static source: raise EngineConfig.max_source_rows)" if self._is_source(hidden) else ""
            raise ValueError(
                f"hidden_states: {hidden.shape[0]} rows{fix}, but the batch's ledger needs "
                f"{inputs.num_output_rows} (requests {list(inputs.request_ids)[:4]}"
                f"{'...' if inputs.num_reqs > 4 else ''})"
            )
        targets = inputs.prompt_token_targets
        if targets is not None and len(targets) and targets.max() >= self.vocab_size:
            bad = int(np.flatnonzero(targets >= self.vocab_size)[0])
            req = int(np.searchsorted(np.cumsum(inputs.prompt_row_counts), bad, side="right"))
            raise ValueError(
                f"request {inputs.request_ids[req]!r}: prompt_tokens: token {int(targets[bad])} "
                f"is outside the vocabulary ({self.vocab_size})"
            )
        top_n = int(inputs.num_logprobs.max(initial=-1))
        if top_n > self.config.sampler.max_logprobs:
            req = int(np.argmax(inputs.num_logprobs))
            raise ValueError(
                f"request {inputs.request_ids[req]!r}: params.logprobs={top_n}: more than "
                f"SamplerConfig.max_logprobs={self.config.sampler.max_logprobs}"
            )
        self.prompt_logprobs.check(inputs)

    @torch.no_grad()  # hidden states that require grad must not make the static buffers record autograd
    def run(
        self,
        hidden_states: torch.Tensor,
        inputs: SamplerInputs,
        arrays: StepArrays,
        *,
        host_start: float | None = None,
    ) -> StepOutput:
        """The step from a prepared ledger and its staged arrays (the decode
        loop's path: it builds `inputs` from its request table). Validates
        before touching anything; should the step still raise part way (a
        bug, a KeyboardInterrupt), the host state is rolled back, so the
        engine is as if it had not started."""
        host_start = time.perf_counter() if host_start is None else host_start
        self._validate(hidden_states, inputs)
        n = inputs.num_reqs
        if n == 0:
            return StepOutput((), [], [], [], [], [], None, False, [])
        mark = self.checkpoint()
        try:
            bucket = self.buckets.bucket_for(n)
            if bucket is not None:
                parts = [(0, n, bucket)]
            else:
                # Above the largest bucket: run eagerly over the same static
                # buffers, the largest bucket's worth of requests at a time. Rows
                # are independent (batch-invariant logits, per-row sampling), so
                # this equals one big step.
                self.replayer.record_eager_fallback(n)
                self.stats.eager_fallbacks += 1
                largest = self.buckets.largest
                parts = [(a, min(a + largest, n), self.buckets.bucket_for(min(a + largest, n) - a)) for a in range(0, n, largest)]
            replayer = self._replayer_for(inputs)
            replayed = bucket is not None and self.config.use_graphs and replayer.captured
            want_logprobs = bool((inputs.num_logprobs >= 0).any())
            want_top = bool((inputs.num_logprobs > 0).any())
            results = []
            for a, b, part_bucket in parts:
                part = arrays if len(parts) == 1 else arrays.requests(a, b, inputs.sample_offsets, inputs.sample_counts)
                self.stage_step(hidden_states, part, part_bucket)
                self.stats.host_seconds += time.perf_counter() - host_start
                with stage("replay" if replayed else "eager step"):
                    if replayed:
                        replayer.replay(part_bucket)
                        self.stats.replays += 1
                    else:
                        replayer.run_eager(part_bucket)
                        if bucket is not None:  # a fallback slice is counted as eager_fallbacks
                            self.stats.eager_steps += 1
                results.append(self._collect(part_bucket, part, want_top=want_top, want_logprobs=want_logprobs))
                host_start = time.perf_counter()
            if bucket is not None:
                self.stats.bucket_histogram[bucket] = self.stats.bucket_histogram.get(bucket, 0) + 1
            self.stats.steps += 1
            result = {key: np.concatenate([r[key] for r in results]) for key in results[0]}
            errors = self._row_errors(inputs, result["error"])
            prompt = None
            if bool((inputs.is_prompt & (inputs.num_prompt_logprobs >= 0)).any()):
                with stage("prompt logprobs"):
                    prompt_rows = self._prompt_logprobs(hidden_states, inputs)
                    prompt = self.prompt_logprobs.update(
                        inputs, prompt_rows, np.fromiter((e is not None for e in errors), bool, count=n))
                errors = [e if e is not None or p is None else f"request {rid!r}: {p}"
                          for e, p, rid in zip(errors, prompt.errors, inputs.request_ids)]
            handed_over = prompt.handed_over if prompt is not None else [None] * n
            output = self._assemble(inputs, result, handed_over, errors, bucket, replayed)
        except BaseException:
            self.rollback(mark)
            raise
        if prompt is not None:
            # Partial prompt logprobs change only once the step has succeeded.
            self.prompt_logprobs.commit(prompt)
        return output

    def _row_errors(self, inputs: SamplerInputs, row_error: np.ndarray) -> list[str | None]:
        """Per request, "request {id!r}: <cause>" of its first failed sample
        row, or None. A non-last prompt chunk's token is discarded, so that
        no token was left for it fails nothing."""
        errors: list[str | None] = [None] * inputs.num_reqs
        for r in np.flatnonzero(row_error):
            i = int(inputs.row_to_req[r])
            code = RowError(int(row_error[r]))
            if errors[i] is not None or (code == RowError.NOTHING_LEFT and inputs.is_prompt[i] and not inputs.is_last_chunk[i]):
                continue
            errors[i] = f"request {inputs.request_ids[i]!r}: {ROW_ERROR_CAUSES[code]}"
        return errors

    @torch.no_grad()
    def stage_step(self, hidden_states: torch.Tensor, arrays: StepArrays, bucket: int) -> None:
        """The host part of a step: stage the per-step arrays and issue the one
        host-to-device copy (plus the caller's rows when not zero-copy)."""
        b = self.buffers
        sample_rows = arrays.selected_token_indices
        with stage("staging copy"):
            if not self._is_source(hidden_states):
                # Not zero-copy: bring only the sample rows into the static
                # source and point the gather at them.
                index = _upload(torch.as_tensor(sample_rows, dtype=torch.int64), hidden_states.device)
                b.source[: len(sample_rows)].copy_(hidden_states[index])
                sample_rows = np.arange(len(sample_rows), dtype=np.int64)
                self.stats.source_copies += 1
            if arrays.draft_probs:
                for row, q in arrays.draft_probs.items():
                    b.draft_probs[row : row + len(q)].copy_(_upload(q, self.device))
            b.load(
                bucket=bucket,
                selected_token_indices=sample_rows,
                row_to_req=arrays.row_to_req,
                local_step=arrays.local_step,
                eos_suppression_rows=arrays.eos_suppression_rows,
                temperatures=arrays.temperatures,
                top_ks=arrays.top_ks,
                top_ps=arrays.top_ps,
                min_ps=arrays.min_ps,
                seeds=arrays.seeds,
                sample_positions=arrays.sample_positions,
                stop_ids=arrays.stop_ids,
                row_drafts=arrays.row_drafts,
                mtp_info_read_rows=arrays.mtp_info_read_rows,
                has_draft_probs=arrays.has_draft_probs,
                mtp_info_write_slots=arrays.mtp_info_write_slots,
                next_draft_tokens=arrays.next_draft_tokens,
                next_draft_logprobs=arrays.next_draft_logprobs,
            )

    def _collect(self, bucket: int, arrays: StepArrays, *, want_top: bool, want_logprobs: bool = True) -> dict[str, np.ndarray]:
        """After the replay: redo flagged rows exactly, re-verify if needed,
        and copy the real rows out before the next replay overwrites them."""
        b = self.buffers
        rows, capacity, n = len(arrays.row_to_req), b.rows_for(bucket), len(arrays.temperatures)
        params, out = b.params(bucket), b.outputs(capacity)
        with stage("exact rows"):
            flags = out.needs_exact[:rows].cpu()
            if bool(flags.any()):
                index = torch.nonzero(flags).flatten()
                sample_exact(b.logits[:capacity], params, self.config.sampler, index, out,
                             compute_logprobs=want_logprobs)
                self.stats.exact_rows += len(index)
                if self.config.max_draft_tokens:
                    self._verify(bucket)  # the drafts were checked against the fast path's draws
        with stage("output copy"):
            result = _host_results(b.outputs(rows), want_top=want_top)
            k = self.config.max_draft_tokens
            result["num_accepted"] = b.num_accepted[:n].to("cpu", copy=True).numpy() if k else np.zeros(n, np.int64)
            if k and self.config.verify_mode == "rejection":
                emitted = b.emitted[:rows].to("cpu", copy=True).numpy()
                # A failed row emits nothing: no residual draw to rescore.
                changed = np.flatnonzero((emitted >= 0) & (emitted != result["tokens"]) & (result["error"] == 0))
                if len(changed):
                    # A residual draw is not the row's own draw: its logprob and rank differ.
                    self._rescore(b.logits[changed], emitted[changed], result, changed)
                result["tokens"] = np.where(emitted >= 0, emitted, result["tokens"])
        return result

    def _rescore(self, logits: torch.Tensor, tokens: np.ndarray, result: dict, rows: np.ndarray) -> None:
        """Raw logprob and rank of `tokens` at `rows` (rejection mode's residual draws)."""
        raw = logits.to(torch.float32)
        token_t = torch.as_tensor(tokens, device=raw.device)[:, None]
        value = raw.gather(1, token_t)  # [rows, 1]
        lse = raw_log_normaliser(raw, raw.amax(-1))  # the sampler's own normaliser
        result["logprob"][rows] = (value.squeeze(1).to(torch.float64) - lse).cpu().numpy()
        result["rank"][rows] = ((raw > value).sum(-1) + 1).cpu().numpy()

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: SamplerInputs) -> PromptRowResults:
        """The step's prompt-logprob rows (none when no prompt chunk asks)."""
        return compute_prompt_logprobs(
            hidden,
            self.weight,
            inputs,
            # Top-k-space mode (docs/contract.md §2.1): a target outside the request's top-k reads -inf.
            top_k=inputs.top_ks if self.config.top_k_space_verify else None,
            chunk_rows=self.config.prompt_logprobs_chunk_rows,
            batch_invariant=self.config.batch_invariant,
            kernel=self.logits_kernel,  # the block GEMM the probe verified, as the sampled rows use
        )

    def _assemble(
        self,
        inputs: SamplerInputs,
        result: dict[str, np.ndarray],
        prompt_lp: list[list[PromptLogprob] | None],
        errors: list[str | None],
        bucket: int | None,
        replayed: bool,
    ) -> StepOutput:
        tokens, logprobs, num_accepted = [], [], []
        drawn = result["tokens"]
        for i in range(inputs.num_reqs):
            if errors[i] is not None:
                # A failed request emits nothing; its placeholder rows stay inside.
                num_accepted.append(0)
                tokens.append([])
                logprobs.append([] if inputs.num_logprobs[i] >= 0 else None)
                continue
            lo = int(inputs.sample_offsets[i])
            # Row j's token is keyed by the position it produces, exactly as in
            # plain decoding; rows past the first rejected draft emit nothing.
            accepted = int(result["num_accepted"][i]) if not inputs.is_prompt[i] else 0
            num_accepted.append(accepted)
            if inputs.is_prompt[i] and not inputs.is_last_chunk[i]:
                emitted = range(0)  # the token sampled for a non-last chunk is discarded
            else:
                emitted = range(lo, lo + accepted + 1)
            tokens.append([int(drawn[r]) for r in emitted])
            n_top = int(inputs.num_logprobs[i])
            if n_top < 0:
                logprobs.append(None)
                continue
            logprobs.append(
                [
                    TokenLogprob(
                        int(result["tokens"][r]),
                        float(result["logprob"][r]),
                        int(result["rank"][r]),
                        tuple(zip(result["top_ids"][r, :n_top].tolist(), result["top_logprobs"][r, :n_top].tolist()))
                        if n_top
                        else (),
                    )
                    for r in emitted
                ]
            )
        return StepOutput(
            request_ids=inputs.request_ids,
            tokens=tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
            seeds=[int(s) for s in inputs.seeds],
            num_accepted=num_accepted,
            bucket=bucket,
            replayed=replayed,
            errors=errors,
        )


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A per-step host tensor on `device`. To CUDA from pinned memory, non_blocking: a copy
    from pageable memory makes the host wait for the stream to drain. The caching host
    allocator keeps the pinned block until the copy has run, so nothing overwrites it."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _host_results(out: SampleOutput, *, want_top: bool) -> dict[str, np.ndarray]:
    """Copy the real rows of the outputs to the host. A copy also on CPU, where
    `.cpu()` would return the static buffer itself and the next step would
    overwrite the results under the caller's feet."""
    names = ("tokens", "logprob", "rank", "error") + (("top_ids", "top_logprobs") if want_top else ())
    return {name: getattr(out, name).to("cpu", copy=True).numpy() for name in names}


def _type_name(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _copied(stats: object) -> object:
    """A copy of a stats dataclass whose dict fields are copied too (cheap
    enough for every step, unlike deepcopy)."""
    out = copy.copy(stats)
    for name, value in vars(out).items():
        if isinstance(value, dict):
            setattr(out, name, dict(value))
    return out
