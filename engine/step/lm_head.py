"""The LM head of a step: the strategy a StepEngine is built with.

The engine owns the ledger, the static buffers, the one graph per bucket and
the host side of every step. Its `LMHead` owns what depends on where the
vocabulary lives and how it is sampled: the weight, the device part from the
gathered hidden rows to the sampled tokens, what the host decides before a
step (`plan`), and the prompt logprobs.

- `LocalHead`: the whole head on this device by torch ops (`StepEngine(weight, config)`).
- `engine.step.kernel_head.KernelHead`: the same with the Triton kernels.
- `engine.parallel.shard_heads`: either over one rank's vocabulary shard.

The torch head's step of a bucket (`StepBody`), a function of the static buffers alone:

    gather       the sample rows of the hidden-state source    -> buffers.hidden
    bitmask      unrestricted rows' words reset to all ones (steps that apply it)
    drafts       each row's draft (the caller's or the pool's)  -> buffers.resolved_drafts
    LM head      logits and the sampler's stages (engine.sampling.sampler) -> buffers.out
    hidden check rows whose hidden state is not finite fail
    verify       the rows' draws against their drafts           -> buffers.num_accepted
    draft pool   next step's proposals into the write slots
    counts       steps with controls: the emitted tokens into the penalty counts

It reads its inputs from `buffers.inputs.<field>` (staged by the host before
the replay) and writes only static tensors, so a CUDA graph can capture it and
the CPU "replay" can call it again over the same addresses (graphs/replay.py).
"""
from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.host.ledger import SamplerInputs
from engine.host.step_fields import READ_FROM_POOL
from engine.invariance import choose_block_gemm, lm_head_candidates, warn_not_invariant
from engine.ops import BlockGemm, gather, get_logits
from engine.sampling.rows import expand_rows, suppressed_scores
from engine.sampling.sampler import RowError, SamplerConfig, controlled_scores, fail_rows, sample
from engine.sampling.verify import accept_strict, draft_in_top_k, target_probs, verify_rejection
from engine.step.control_state import SamplingControls
from engine.step.engine_config import EngineConfig, EngineStats
from engine.step.prompt_logprobs import PromptRowResults, compute_prompt_logprobs
from engine.step.staging import StepArrays, type_name
from engine.step.static_buffers import StepBuffers


@dataclass(frozen=True)
class StepKind:
    """What one step of the torch head runs: its sampler variant (`SamplerConfig.stages`,
    `top_k`, `top_p`, `logprobs`), whether it applies the control state (and counts the
    emitted tokens) and whether it applies the token bitmask."""

    sampler: SamplerConfig
    controls: bool
    masked: bool


@dataclass(frozen=True)
class StepBody:
    """The torch head's step, called with the bucket (`GraphReplayer`'s step function).

    `head.logits_and_sample(bucket)` is the LM head's part: from `buffers.hidden` to
    `buffers.out`. `head.kind` says, per step on the CPU and once for a captured graph,
    whether the step applies the token bitmask (verification must see the same masked
    distribution; rows outside `masked_rows` are unrestricted) and the controls, whose
    emitted tokens it then counts."""

    buffers: StepBuffers
    config: EngineConfig
    head: LocalHead
    controls: SamplingControls | None = None

    def __call__(self, bucket: int) -> None:
        b, kind = self.buffers, self.head.kind
        rows = bucket * b.rows_per_req
        gather(b.source, b.inputs.selected_token_indices[:rows], out=b.hidden[:rows])  # [rows, H]
        if kind.masked:  # the staged words of the restricted rows; every other row unrestricted
            b.token_bitmask[:rows].masked_fill_(~b.inputs.masked_rows[:rows, None], -1)
        if self.config.max_draft_tokens:
            resolve_drafts(b, bucket)  # before the head: the penalties count a row's earlier drafts
        self.head.logits_and_sample(bucket)
        fail_non_finite_hidden(b, rows)
        if self.config.max_draft_tokens:
            verify_and_store_drafts(b, self.config, bucket, b.token_bitmask if kind.masked else None)
        if kind.controls:
            self.controls.count(b, self.config, bucket)


def fail_non_finite_hidden(buffers: StepBuffers, rows: int) -> None:
    """Rows whose gathered hidden state holds a NaN or inf fail with that cause
    (their logits are not finite either; the hidden state is where the fault is)."""
    fail_rows(buffers.outputs(rows), ~torch.isfinite(buffers.hidden[:rows]).all(-1), RowError.HIDDEN_NOT_FINITE)


def resolve_drafts(buffers: StepBuffers, bucket: int) -> None:
    """Each row's draft, staged or read from the draft-info pool, into `buffers.resolved_drafts`."""
    b, f = buffers, buffers.inputs
    rows = b.rows_for(bucket)
    staged = f.row_drafts[:rows]
    # Read before this step's writes: a request that reads and writes the
    # same slot verifies last step's proposals.
    from_pool = b.pool_tokens[f.mtp_info_read_rows[:rows]]
    torch.where(staged == READ_FROM_POOL, from_pool, staged, out=b.resolved_drafts[:rows])


def verify_and_store_drafts(buffers: StepBuffers, config: EngineConfig, bucket: int,
                            token_bitmask: torch.Tensor | None = None) -> None:
    """Verify each row's resolved draft, then write the draft head's proposals
    for the next step into each request's write slot."""
    b, f = buffers, buffers.inputs
    k = config.max_draft_tokens
    verify_drafts(b, config, bucket, token_bitmask)
    if not config.draft_pool:
        return  # no pool: every write slot is 0, there is nothing to write
    # Slot 0 is padding and never written: writes aimed at it land in the extra slot.
    slots = f.mtp_info_write_slots[:bucket]
    slots = torch.where(slots > 0, slots, torch.full_like(slots, config.pool_slots))
    pool_rows = (slots[:, None] * k + torch.arange(k, device=slots.device)).flatten()  # [bucket * k]
    b.pool_tokens.index_copy_(0, pool_rows, f.next_draft_tokens[:bucket, :k].flatten())
    b.pool_logprobs.index_copy_(0, pool_rows, f.next_draft_logprobs[:bucket, :k].flatten())


def verify_drafts(buffers: StepBuffers, config: EngineConfig, bucket: int,
                  token_bitmask: torch.Tensor | None = None) -> None:
    """num_accepted (and, in rejection mode, the emitted token per row) from
    the rows' draws and their resolved drafts, against the distributions the
    rows drew from (masked by `token_bitmask` [max_rows, W] int32 when
    given)."""
    b = buffers
    rows = b.rows_for(bucket)
    mask = None if token_bitmask is None else token_bitmask[:rows]
    params = b.params(bucket)
    drafts = b.resolved_drafts[:rows]  # [rows] int64, -1 = none
    k_req = params.top_ks.to(torch.int64) if config.top_k_space_verify else None
    if config.verify_mode == "strict":
        allowed = None
        if k_req is not None:
            # The top-k of the scores the rows drew from: the bitmask and the suppressed stop
            # ids applied (again: a step with controls left them in b.logits already).
            scores, _ = controlled_scores(b.logits[:rows], mask)
            scores = suppressed_scores(scores, expand_rows(params, scores.shape[1]))
            allowed = draft_in_top_k(scores, drafts, k_req[params.row_to_req], config.sampler.candidate_cap)
        accept_strict(b.out.tokens[:rows], drafts, params.row_to_req, params.local_step, bucket,
                      draft_allowed=allowed, out=b.num_accepted[:bucket])
        return
    p = target_probs(b.logits[:rows], params, mask)  # [rows, V] f64
    # Rows without staged probabilities count their draft as one-hot q.
    one_hot = torch.zeros_like(b.draft_probs[:rows]).scatter_(1, drafts.clamp(min=0)[:, None], 1.0)
    q = torch.where(b.inputs.has_draft_probs[:rows, None], b.draft_probs[:rows], one_hot)
    position = params.sample_positions[params.row_to_req] + params.local_step
    verify_rejection(p, drafts, q, params.seeds, position, params.row_to_req, params.local_step, bucket,
                     b.emitted[:rows], row_tokens=b.out.tokens[:rows], top_k_space=k_req,
                     max_top_k=config.sampler.candidate_cap if k_req is not None else None,
                     out=b.num_accepted[:bucket])


class LMHead(ABC):
    """Where a step's logits come from and how its rows are drawn from them."""

    weight: torch.Tensor  # [V, H] (or the head's part of it), read-only
    vocab_size: int
    hidden_size: int
    dtype: torch.dtype  # the weight's: the default dtype of the hidden-state source
    name: str  # the step's name in capture reports and the dry run
    # Whether a step may restrict rows by a token bitmask (docs/contract.md §2).
    applies_token_bitmask = False
    # Whether the controls rewrite `buffers.logits` in place (the unprocessed logits then
    # live in `SamplingControls.unprocessed`); False: `buffers.logits` stay unprocessed.
    controls_in_place = True
    logits_kernel: BlockGemm | None = None  # the verified block GEMM, None: get_logits' own blocks
    batch_invariant_verified: bool = False
    stats: object | None = None  # the head's own counters, saved and restored with the engine's
    supports_controls = False  # whether `attach_controls` may be called (penalties, logit bias, allowed tokens)

    def hold_weight(self, lm_head_weight: object, config: EngineConfig) -> torch.device:
        """Check and keep the whole head's weight and the config (weight, config,
        vocab_size, hidden_size, dtype); returns the engine's device. **Raises**
        ValueError naming `lm_head_weight` (`checked_head_weight`)."""
        device = config.resolved_device()
        self.weight = checked_head_weight(lm_head_weight, device, "lm_head_weight")
        self.config = config
        self.vocab_size, self.hidden_size = self.weight.shape
        self.dtype = self.weight.dtype
        return device

    @abstractmethod
    def attach(self, buffers: StepBuffers) -> None:
        """Take the engine's static buffers (once, before any step)."""

    def static_tensors(self) -> dict[str, torch.Tensor]:
        """Static tensors of the head's own that the graphs use, by name."""
        return {}

    def attach_controls(self, controls: SamplingControls) -> None:
        """Take the engine's sampling-control state (before any step); the step applies
        it between the logits and the draw."""
        raise NotImplementedError(f"{type(self).__name__} does not apply sampling controls")

    @abstractmethod
    def step_body(self, buffers: StepBuffers, config: EngineConfig,
                  controls: SamplingControls | None) -> Callable[[int], None]:
        """The step of a bucket (`GraphReplayer`'s step function, one graph per bucket):
        gather, drafts, logits, the sampler's stages, the hidden check, verification, counts."""

    def plan(self, inputs: SamplerInputs, arrays: StepArrays, rows: int, stats: EngineStats) -> None:
        """On the host, before the step's replay: what the next step runs, where the head
        decides it per step (the CPU torch head; a captured head runs every stage). `rows`:
        the static rows its buckets run over."""

    @abstractmethod
    def scores_after(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After a step, sample rows `index` [k] int64 as the sampler saw them: their scores
        [k, V] f32 and, when those are the processed scores, the unprocessed logits [k, V]
        f32 (None: the scores are the logits). Rescoring a residual draw reruns the sampler
        on them with the drawn token forced."""

    @abstractmethod
    def prompt_logprobs(self, hidden_states: torch.Tensor, inputs: SamplerInputs) -> PromptRowResults:
        """The step's prompt-logprob rows (eager, outside the graph)."""


def checked_head_weight(weight: object, device: torch.device, name: str) -> torch.Tensor:
    """`weight` as the engine reads it: a floating-point [vocab, hidden] tensor on `device`."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name}: a {type_name(weight)}, expected a torch.Tensor [vocab, hidden]")
    if not weight.is_floating_point():
        raise ValueError(f"{name}: dtype {weight.dtype}, expected a floating-point tensor")
    if weight.dim() != 2:
        raise ValueError(f"{name}: shape {tuple(weight.shape)} is not [vocab, hidden]")
    if weight.device.type != device.type:
        raise ValueError(f"{name} is on {weight.device} but the engine runs on {device}: "
                         "move the weight or set EngineConfig.device")
    # The engine only reads the head: an nn.Parameter's autograd must not
    # record every step (nor refuse `.numpy()` on what comes out).
    return weight.detach()


# Rows the CPU sampler takes at a time: [64, V] temporaries stay in the allocator's
# reuse range, while [256, 128256] ones cost fresh pages every step (measured on 2
# AVX-512 cores, B = 256, V = 128256: top-p 1363 -> 864 ms, plain 234 -> 104 ms).
CPU_CHUNK_ROWS = 64


def full_sampler(sampler: SamplerConfig, on_cpu: bool) -> SamplerConfig:
    """Every stage for every row: what a captured graph runs, and what `sampler_variant`
    lightens per step on a CPU (rows CPU_CHUNK_ROWS at a time there)."""
    return dataclasses.replace(sampler, stages="filters", top_k="radix", top_p=True,
                               chunk_rows=CPU_CHUNK_ROWS if on_cpu else 0)


def sampler_variant(full: SamplerConfig, inputs: SamplerInputs, vocab: int) -> SamplerConfig:
    """The lightest sampler that decides the step's rows (`inputs`, host arrays) as `full`
    does, on the host: logprobs only when a request wants them; the argmax alone when
    every request is greedy and none suppresses its EOS; the draw without threshold
    passes when no sampled request has top-k, top-p or min-p; else the cuts the requests
    ask for, the top-k by a topk where every top-k fits `candidate_cap` (the counting
    radix where one does not). Each also says whether a greedy row sits among sampled
    ones, whether a row suppresses its stop ids, whether one has a forced token, and
    whether a sampled one has a temperature other than 1: what no row has, the torch
    stages skip."""
    greedy = inputs.temperatures == 0
    logprobs = bool((inputs.num_logprobs >= 0).any())
    stops = len(inputs.eos_suppression_rows) > 0
    forced = inputs.forced_tokens is not None
    scaled = bool((inputs.temperatures[~greedy] != 1).any())
    # A greedy request has no filters (as vLLM): its processed logprobs are over every token.
    k_on = ~greedy & (inputs.top_ks > 0) & (inputs.top_ks < vocab)
    top_k = "none" if not k_on.any() else "topk" if inputs.top_ks[k_on].max() <= full.candidate_cap else "radix"
    may = (bool(greedy.any()), stops, forced, scaled)
    if logprobs:
        return _sampler(full, "filters", top_k, True, True, *may)
    if greedy.all() and not stops:  # the argmax alone suppresses nothing
        return _sampler(full, "greedy", "radix", True, False, True, False, forced, True)
    p_on = ~greedy & (inputs.top_ps < 1)
    if not (k_on | p_on | (~greedy & (inputs.min_ps > 0))).any():
        return _sampler(full, "plain", "radix", True, False, *may)
    return _sampler(full, "filters", top_k, bool(p_on.any()), False, *may)


@functools.lru_cache(maxsize=256)  # a few dozen variants, each made once
def _sampler(full: SamplerConfig, stages: str, top_k: str, top_p: bool, logprobs: bool, greedy_rows: bool,
             stop_rows: bool, forced_rows: bool, scaled_rows: bool) -> SamplerConfig:
    return dataclasses.replace(full, stages=stages, top_k=top_k, top_p=top_p, logprobs=logprobs and full.logprobs,
                               greedy_rows=greedy_rows, stop_rows=stop_rows, forced_rows=forced_rows,
                               scaled_rows=scaled_rows)


class LocalHead(LMHead):
    """The whole LM head on this device by torch ops: `weight` [V, H] -> fp32 logits in the
    engine's static `buffers.logits`, sampled there (engine.sampling.sampler).

    One step function per bucket. On CUDA (the reference the kernels are checked against)
    its graph runs every stage for every row: the full sampler, the controls (a row
    without a control slot reads the neutral slot 0) and the token bitmask (rows outside
    `masked_rows` unrestricted). On the CPU nothing is captured, so `plan` picks on the
    host, per step, what the step's rows need (`EngineConfig.sampler_variants`): the
    argmax alone when every request is greedy, the draw without the threshold passes
    when no sampled request filters, the filters a step's requests ask for, logprobs only
    when one wants them, the controls only when a request holds a slot, the bitmask only
    when a row is restricted. Every choice gives the same bits as the full step."""

    supports_controls = True
    applies_token_bitmask = True
    name = "torch"

    def __init__(self, lm_head_weight: torch.Tensor, config: EngineConfig) -> None:
        device = self.hold_weight(lm_head_weight, config)
        # The block GEMM, probed here (engine.invariance): the first kernel of
        # BLOCK_KERNELS (oneDNN's, MKL's packed weights, mm) at the configured block that
        # holds, else at a fallback block size.
        if config.batch_invariant:
            self.logits_kernel, self.batch_invariant_verified = choose_block_gemm(lm_head_candidates(self.weight, config.block_rows))
            if not self.batch_invariant_verified:
                warn_not_invariant(f"the LM head {tuple(self.weight.shape)} {self.weight.dtype} on {device}")
        self.applies_token_bitmask = config.token_bitmask
        # On CPU the sampler takes CPU_CHUNK_ROWS rows at a time; on CUDA, the whole batch.
        self.per_step = device.type == "cpu"
        self.full = full_sampler(config.sampler, self.per_step)
        self.buffers: StepBuffers | None = None
        self.controls: SamplingControls | None = None
        self.kind = StepKind(self.full, controls=False, masked=self.applies_token_bitmask)

    def attach(self, buffers: StepBuffers) -> None:
        self.buffers = buffers

    def attach_controls(self, controls: SamplingControls) -> None:
        self.controls = controls
        self.kind = dataclasses.replace(self.kind, controls=True)

    def step_body(self, buffers: StepBuffers, config: EngineConfig,
                  controls: SamplingControls | None) -> Callable[[int], None]:
        return StepBody(buffers, config, self, controls)

    def plan(self, inputs: SamplerInputs, arrays: StepArrays, rows: int, stats: EngineStats) -> None:
        if not self.per_step:
            return  # captured: every stage for every row
        masked = arrays.token_bitmask is not None
        controls = self.controls is not None and (arrays.control_slots is not None or masked)
        sampler = self.full if masked or controls or not self.config.sampler_variants else self._variant(inputs, stats)
        self.kind = StepKind(sampler, controls=controls, masked=masked)

    def _variant(self, inputs: SamplerInputs, stats: EngineStats) -> SamplerConfig:
        sampler = sampler_variant(self.full, inputs, self.vocab_size)
        stats.greedy_steps += sampler.stages == "greedy"
        stats.plain_steps += sampler.stages == "plain"
        return sampler

    def logits(self, bucket: int) -> None:
        """The lm head: the fp32 logits of the bucket's gathered hidden rows into `buffers.logits`."""
        b = self.buffers
        rows = bucket * b.rows_per_req
        get_logits(
            b.hidden[:rows],
            self.weight,
            out=b.logits[:rows],  # [rows, V] f32
            batch_invariant=self.config.batch_invariant,
            block_rows=self.config.block_rows,
            kernel=self.logits_kernel,
        )

    def logits_and_sample(self, bucket: int) -> None:
        """The logits, then every stage in vLLM's order (engine.sampling.sampler) that the
        step's kind runs; with controls, `buffers.logits` hold the processed scores afterwards
        (what verification reads)."""
        b, kind = self.buffers, self.kind
        rows = bucket * b.rows_per_req
        self.logits(bucket)
        sample(b.logits[:rows], b.params(bucket), kind.sampler, out=b.outputs(rows),
               controls=self.controls.rows(b, bucket) if kind.controls else None,
               token_bitmask=b.token_bitmask[:rows] if kind.masked else None)

    def scores_after(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = self.buffers
        if self.kind.controls:  # processed in place
            return b.logits[index], self.controls.unprocessed[index]
        return b.logits[index], None

    def prompt_logprobs(self, hidden_states: torch.Tensor, inputs: SamplerInputs) -> PromptRowResults:
        return compute_prompt_logprobs(
            hidden_states,
            self.weight,
            inputs,
            # Top-k-space mode (docs/contract.md §2.1): a target outside the request's top-k reads -inf.
            top_k=inputs.top_ks if self.config.top_k_space_verify else None,
            chunk_rows=self.config.prompt_logprobs_chunk_rows,
            batch_invariant=self.config.batch_invariant,
            kernel=self.logits_kernel,  # the block GEMM the probe verified, as the sampled rows use
        )
