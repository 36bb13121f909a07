"""The captured step: one bucket's device work, a function of the static buffers alone.

    gather       the sample rows of the hidden-state source    -> buffers.hidden
    drafts       each row's draft (the caller's or the pool's)  -> buffers.resolved_drafts
    LM head      logits and the sampler's stages (engine.sampling.sampler) -> buffers.out
    hidden check rows whose hidden state is not finite fail
    verify       the rows' draws against their drafts           -> buffers.num_accepted
    draft pool   next step's proposals into the write slots
    counts       controls graphs: the emitted tokens into the penalty counts

It reads its inputs from `buffers.inputs.<field>` (staged by the host before
the replay) and writes only static tensors, so a CUDA graph can capture it and
the CPU "replay" can call it again over the same addresses (graphs/replay.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.host.step_fields import READ_FROM_POOL
from engine.ops import gather
from engine.sampling.errors import RowError, fail_rows
from engine.sampling.rows import expand_rows
from engine.sampling.sampler import controlled_scores
from engine.sampling.suppression import suppressed_scores
from engine.sampling.verify import accept_strict, draft_in_top_k, target_probs, verify_rejection
from engine.step.engine_config import EngineConfig
from engine.step.control_state import SamplingControls
from engine.sampling.sampler_config import SamplerConfig
from engine.step.static_buffers import StepBuffers


@dataclass(frozen=True)
class StepKind:
    """What one step of the torch head runs: its sampler variant (`SamplerConfig.stages`,
    `top_k`, `top_p`, `logprobs`), whether it applies the control state (and counts the
    emitted tokens) and whether it applies the token bitmask."""

    sampler: SamplerConfig
    controls: bool
    masked: bool


class StepKindSource(Protocol):
    """The head whose step this is: `kind` says what the step runs."""

    kind: StepKind

    def logits_and_sample(self, bucket: int) -> None:
        """From `buffers.hidden` to the sampler's `buffers.out`."""


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
    head: StepKindSource
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
    # same slot verifies last step's proposals. Resolved into a static
    # buffer so a later eager re-verification reads the same drafts.
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
    given). Also run eagerly after the exact rows changed some draws."""
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
