"""StepEngine: one step of the tail, top to bottom.

    step(hidden, seqs, drafts)
      -> ledger         which rows, positions, parameters (host, numpy)     engine.host.ledger
      -> drafts         checked and laid out on the rows                    staging.py
      -> validate       everything, before any buffer is touched            staging.py
      -> stage + copy   one packed host-to-device copy into the static buffers
      -> replay         the bucket's captured graph: gather -> LM head      lm_head.py
                        -> sample -> verify drafts -> draft-pool writes
      -> collect        output copy, rescoring                              step_output.py
      -> prompt logprobs  chunked, eager, outside the graph                 lm_head.py
      -> StepOutput                                                         step_output.py

A row whose hidden state or logits are not finite, or whose controls leave no
token, fails only its own request (docs/contract.md §2): the sampler marks it
inside the graph (`RowError`, copied out with the results), the request emits
nothing and `StepOutput.errors` says why. Every check of the inputs runs
before anything is staged, partial prompt logprobs are committed only once
the step has succeeded, and a step that raises anyway leaves the host state
as it found it; `checkpoint()` / `rollback()` let a caller undo a step that
returned.

`EngineConfig(use_graphs=False)` runs the same step function over the same
static buffers without a graph (so does an engine never `capture()`d, with a
warning); a step with more requests than the largest bucket runs eagerly over
them, the largest bucket's worth of requests at a time. With
`batch_invariant=True` (the default) all of these give identical tokens: the
LM head runs in fixed row blocks and the sampler's arithmetic is per row.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import time
import warnings
import weakref
from typing import Hashable, Sequence, TypeVar

import numpy as np
import torch

from engine.host.control_slots import NoControls
from engine.host.ledger import SamplerInputs
from engine.host.request_table import RequestTable
from engine.host.params import SeqMeta
from engine.host.step_fields import STEP_FIELDS
from engine.host.stop_ids import StopIds
from engine.ops import upload
from engine.sampling.token_bitmask import bitmask_words
from engine.step.step_output import CollectedRows, StepOutput, assemble, collect, row_errors
from engine.step.engine_config import EngineCheckpoint, EngineConfig, EngineStats
from engine.step.control_state import ControlWrites, SamplingControls
from engine.step.kernel_head import local_head
from engine.step.lm_head import LMHead
from engine.step.prompt_logprobs import PromptLogprobAccumulator, PromptLogprobUpdate
from engine.step.seq_front import SeqMetaFront
from engine.step.staging import (StepArrays, StepDrafts, check_hidden_states, check_ledger, check_token_bitmask,
                                 is_same_view)
from engine.step.static_buffers import StepBuffers
from engine.trace import stage
from graphs.replay import BucketTable, CaptureProgress, CaptureReport, GraphReplayer, show_capture_progress


def check_vocab_fits_sampler(lm_head: torch.Tensor | LMHead, config: EngineConfig) -> None:
    """A vocabulary smaller than the top-N the sampler allocates for cannot be captured: refuse
    it here, before any work, naming the field and the fix."""
    # A weight that is not a float matrix is refused by the head itself, naming its dtype or shape.
    vocab = lm_head.vocab_size if isinstance(lm_head, LMHead) else (
        lm_head.shape[0] if isinstance(lm_head, torch.Tensor) and lm_head.dim() == 2
        and lm_head.dtype.is_floating_point else None)
    top_n = config.sampler.max_logprobs
    if vocab is not None and top_n > vocab:
        raise ValueError(f"EngineConfig.sampler.max_logprobs={top_n}: exceeds the LM head's vocabulary V={vocab}; "
                         f"build it with EngineConfig(sampler=SamplerConfig(max_logprobs={vocab})) "
                         "(from engine import SamplerConfig)")


class StepEngine:
    """The captured tail of an inference step (docs/contract.md §4, §6).

    `lm_head_weight` is the LM head's weight [vocab, hidden] on the engine's
    device (a `LocalHead` computes the logits, or with `EngineConfig.kernels` "triton" a
    `KernelHead`), or the `LMHead` strategy that
    holds it (`engine.parallel.sharded_head`: one rank's vocabulary shard)."""

    def __init__(self, lm_head_weight: torch.Tensor | LMHead, config: EngineConfig | None = None):
        config = config or EngineConfig()
        self.config = config
        self.device = config.resolved_device()
        check_vocab_fits_sampler(lm_head_weight, config)
        self.head = lm_head_weight if isinstance(lm_head_weight, LMHead) else local_head(lm_head_weight, config)
        self.weight = self.head.weight  # [V, H], or this rank's [V_rank, H] shard
        self.vocab_size, self.hidden_size = self.head.vocab_size, self.head.hidden_size
        self.logits_kernel, self.batch_invariant_verified = self.head.logits_kernel, self.head.batch_invariant_verified
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
            step_fields=STEP_FIELDS,
            max_reqs=config.max_num_reqs,
            max_draft_tokens=config.max_draft_tokens,
            max_source_rows=config.max_source_rows,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            max_logprobs=config.sampler.max_logprobs,
            max_stop_ids=config.max_stop_ids,
            source_dtype=config.source_dtype or self.head.dtype,
            device=self.device,
            pool_slots=config.pool_slots,
            draft_probs=config.verify_mode == "rejection" and config.max_draft_tokens > 0,
            token_bitmask_words=bitmask_words(self.vocab_size) if self.head.applies_token_bitmask else 0,
            # Room for a control write of every slot and a step's token bitmask, carried with its copy.
            carried_bytes=(ControlWrites.nbytes(config.max_control_slots, config.max_logit_bias,
                                                bitmask_words(self.vocab_size)) if self.head.supports_controls else 0)
            + (config.max_num_reqs * (1 + config.max_draft_tokens) * bitmask_words(self.vocab_size) * 4
               if self.head.applies_token_bitmask else 0),
        )
        self.head.attach(self.buffers)
        # [max_source_rows, H]: a model that writes its last-layer rows here (batch order,
        # from row 0) makes `step(engine.source, seqs)` zero-copy.
        self.source = self.buffers.source
        # Sampling controls (penalties, logit bias, allowed tokens): state only when the config asks.
        self.controls: SamplingControls | None = None
        if config.max_control_slots and self.head.supports_controls:
            self.controls = SamplingControls(config, self.vocab_size, self.buffers.max_rows, self.device,
                                             keep_unprocessed=self.head.controls_in_place,
                                             counted_index=self.buffers.output_area.counted_index,
                                             steps_carry_writes=True)
            self.head.attach_controls(self.controls)
        # What the request tables ask when a request joins, changes or leaves.
        self.control_hook = self.controls or NoControls(
            "this engine has no sampling-control state (EngineConfig.max_control_slots=0)"
            if not config.max_control_slots else f"{type(self.head).__name__} does not apply sampling controls")
        static = {**self.buffers.static_tensors(), **self.head.static_tensors(),
                  **(self.controls.static_tensors() if self.controls else {})}
        # One step function, one graph per bucket.
        self.replayer = GraphReplayer(self.head.step_body(self.buffers, config, self.controls), self.buckets, static,
                                      self.device, check_addresses_each_replay=config.check_addresses_each_replay)
        # Partial prompt logprobs belong to the request table of the front whose steps make them
        # (a PersistentBatch's, the step() front's): two fronts may reuse one request id.
        self._prompt_stores: weakref.WeakKeyDictionary[RequestTable, PromptLogprobAccumulator] = (
            weakref.WeakKeyDictionary())
        self.prompt_logprobs = PromptLogprobAccumulator()  # the step() front's
        self.stats = EngineStats(logits_kernel="plain" if self.logits_kernel is None else self.logits_kernel.name)
        # drafts.step_arrays(inputs, stop_ids, *, draft_tokens, ...): everything a step stages, its drafts checked.
        self.drafts = StepDrafts(self.vocab_size, config)
        # The ids suppressed while a request is short of min_tokens, [max_stop_ids] int64 -1 padded:
        # stop_rule.for_request(request_id, params) for one request, stop_rule.matrix(seqs) [n, max_stop_ids].
        self.stop_rule = StopIds(config.max_stop_ids, self.vocab_size, config.eos_token_id)
        # step(hidden, seqs): SeqMeta lists over a persistent table keyed by request id.
        self.seq_front = SeqMetaFront(config, self.stop_rule, self.control_hook, capacity=2 * config.max_num_reqs,
                                      prompt_logprobs=self.prompt_logprobs)
        self._prompt_stores[self.seq_front.table] = self.prompt_logprobs
        self._warned_uncaptured = False

    def prompt_logprobs_of(self, table: RequestTable) -> PromptLogprobAccumulator:
        """The partial prompt logprobs of the requests of `table` (one per front), made on first use."""
        store = self._prompt_stores.get(table)
        if store is None:
            store = self._prompt_stores[table] = PromptLogprobAccumulator()
        return store

    def _prompt_store(self, inputs: SamplerInputs) -> PromptLogprobAccumulator:
        """The store of the front that prepared `inputs` (the step() front's for a SeqMeta step)."""
        return self.prompt_logprobs if inputs.prepared is None else self.prompt_logprobs_of(inputs.prepared.table)

    # -- undoing a step ---------------------------------------------------------

    def checkpoint(self, *, prompt_logprobs: bool = True) -> EngineCheckpoint:
        """The host state that spans steps: the prompt-logprob accumulators of
        every front (partial prompt logprobs of requests between prompt chunks), the
        engine's and its head's stats and the replayer's counters. `rollback`
        restores it, so a caller whose own code failed after `run`/`step`
        returned can undo the step. Not covered: device state, i.e. the static
        buffers (every step rewrites what it reads) and the draft-info pool,
        whose slots the caller's take-once bookkeeping owns. The penalty counts
        are covered: a rollback takes back what the last step counted.
        `prompt_logprobs=False` leaves the accumulators out (`run`'s own mark: a step
        commits them only once it has succeeded)."""
        return EngineCheckpoint(
            partial_prompt_logprobs={table: dict(store.partial) for table, store in self._prompt_stores.items()}
            if prompt_logprobs else {},
            stats=copy_counters(self.stats),
            head_stats=None if self.head.stats is None else copy_counters(self.head.stats),
            replayer_counts=self.replayer.counts(),
            control_steps=None if self.controls is None else self.controls.steps,
        )

    def rollback(self, checkpoint: EngineCheckpoint) -> None:
        """Restore the state `checkpoint()` returned (see there). Every check runs first:
        a checkpoint it cannot return to (more than one step of penalty counts since)
        raises ValueError with nothing restored."""
        if self.controls is not None and checkpoint.control_steps is not None:
            self.controls.check_rollback(checkpoint.control_steps)
        for table, snapshot in checkpoint.partial_prompt_logprobs.items():
            self.prompt_logprobs_of(table).restore(snapshot)
        restore_counters(self.stats, checkpoint.stats)
        if checkpoint.head_stats is not None:
            restore_counters(self.head.stats, checkpoint.head_stats)
        self.replayer.restore_counts(checkpoint.replayer_counts)
        if self.controls is not None and checkpoint.control_steps is not None:
            self.controls.rollback_to(checkpoint.control_steps)

    # -- setting up -------------------------------------------------------------

    def capture(self, progress: bool | CaptureProgress = False) -> CaptureReport:
        """Capture one graph per bucket (largest first); on CPU, run each once under the
        capture safety check. Reports buckets, seconds, pool bytes. `progress`: True draws
        a bar on stderr; a callable hears (graphs captured, graphs to capture, bucket)."""
        hear = functools.partial(show_capture_progress, device=self.device) if progress is True else progress
        report = self.replayer.capture(progress=hear or False)
        return dataclasses.replace(report, logits_kernel=self.stats.logits_kernel)

    # -- one step -----------------------------------------------------------------

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
            arrays = self.drafts.step_arrays(
                inputs,
                stop_ids,
                draft_tokens=draft_tokens,
                draft_logprobs=draft_logprobs,
                next_drafts=next_drafts,
                next_draft_logprobs=next_draft_logprobs,
            )
            arrays.control_slots = self.seq_front.control_slots(inputs)
        return self.run(hidden_states, inputs, arrays, host_start=start)

    def finish(self, request_id: Hashable) -> None:
        """A request of `step(hidden, seqs)` ended (vLLM's finished request ids): everything
        the engine holds for it (its row, control slot and counts, partial prompt logprobs)
        is freed, and its id may come back as a new request (docs/contract.md §5)."""
        self.seq_front.finish(request_id)

    def validate(self, hidden_states: torch.Tensor, inputs: SamplerInputs) -> None:
        """Every check of a step that needs no device work: after it, nothing may raise but a bug."""
        check_hidden_states(hidden_states, inputs, hidden_size=self.hidden_size, device=self.device,
                            source=self.buffers.source)
        if inputs.prepared is None:  # a persistent batch checked its requests where they entered (`add`)
            check_ledger(inputs, vocab_size=self.vocab_size, max_logprobs=self.config.sampler.max_logprobs)
        if inputs.is_prompt.any():  # only prompt chunks continue or start accumulated values
            self._prompt_store(inputs).check(inputs)

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
        if inputs.prepared is not None:  # a persistent batch's step: refused once any of its requests changed
            inputs.prepared.check()
        self.validate(hidden_states, inputs)
        check_token_bitmask(arrays.token_bitmask, inputs.num_sample_rows, self.vocab_size,
                            applies=self.head.applies_token_bitmask)
        if inputs.num_reqs == 0:
            return StepOutput.empty()
        mark = self.checkpoint(prompt_logprobs=False)
        try:
            output, prompt = self._sample(hidden_states, inputs, arrays, host_start)
        except BaseException:
            self.rollback(mark)
            raise
        if prompt is not None:
            # Partial prompt logprobs change only once the step has succeeded.
            self._prompt_store(inputs).commit(prompt)
        if inputs.prepared is not None:
            inputs.prepared.mark_run()
        return output

    def _sample(self, hidden_states: torch.Tensor, inputs: SamplerInputs, arrays: StepArrays,
                host_start: float) -> tuple[StepOutput, PromptLogprobUpdate | None]:
        """Stage, replay, collect, prompt logprobs, assemble: the validated step
        (`run` rolls it back if it raises), with the accumulator update to commit."""
        n = inputs.num_reqs
        bucket = self.buckets.bucket_for(n)
        # Above the largest bucket: run eagerly over the same static buffers, a
        # slice at a time. Rows are independent (batch-invariant logits, per-row
        # sampling), so this equals one big step.
        parts = self.buckets.parts(n)
        controlled = arrays.control_slots is not None  # a request holds a control slot
        self.head.plan(inputs, arrays, self.buffers.rows_per_req * sum([p for _, _, p in parts]), self.stats)
        replayer = self.replayer
        if bucket is None:
            replayer.record_eager_fallback(n)
            self.stats.eager_fallbacks += 1
        replayed = bucket is not None and self._replays(replayer)
        want_logprobs = bool((inputs.num_logprobs >= 0).any())
        want_top = bool((inputs.num_logprobs > 0).any())
        results = []
        if controlled:
            self.controls.start_step()
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
            if controlled:
                self.controls.replayed(self.buffers.rows_for(part_bucket))
            results.append(collect(self.buffers, self.config, part_bucket, part,
                                   want_top=want_top, want_logprobs=want_logprobs, counted=controlled,
                                   scores_after=self.head.scores_after))
            if controlled:
                self.controls.collected(results[-1].counted_index)
            host_start = time.perf_counter()
        if bucket is not None:
            self.stats.bucket_histogram[bucket] = self.stats.bucket_histogram.get(bucket, 0) + 1
        self.stats.steps += 1
        result = CollectedRows.concatenate(results)
        errors = row_errors(inputs, result.error)
        prompt = None
        if bool((inputs.is_prompt & (inputs.num_prompt_logprobs >= 0)).any()):
            with stage("prompt logprobs"):
                prompt_rows = self.head.prompt_logprobs(hidden_states, inputs)
                prompt = self._prompt_store(inputs).update(
                    inputs, prompt_rows, np.fromiter((e is not None for e in errors), bool, count=n))
            errors = [e if e is not None or p is None else f"request {rid!r}: {p}"
                      for e, p, rid in zip(errors, prompt.errors, inputs.request_ids)]
        if controlled:
            # Requests whose prompt logprobs failed emit nothing: what the graph counted for them goes back.
            failed = arrays.control_slots[np.fromiter((e is not None for e in errors), bool, count=n)]
            counted_slots, _ = self.controls.counted_tokens()
            self.controls.finish_step(np.isin(counted_slots, failed[failed > 0]))
        handed_over = prompt.handed_over if prompt is not None else [None] * n
        return assemble(inputs, result, handed_over, errors, bucket, replayed), prompt

    def _replays(self, replayer: GraphReplayer) -> bool:
        """Whether a bucketed step replays `replayer`'s graphs: with use_graphs, once
        they are captured. Until then it runs eagerly, and says so once."""
        if not self.config.use_graphs:
            return False
        if not replayer.captured and not self._warned_uncaptured:
            self._warned_uncaptured = True
            warnings.warn(
                "EngineConfig(use_graphs=True) but this engine's graphs were never captured: its steps run "
                "eagerly; call engine.capture() before the first step, or set EngineConfig(use_graphs=False)",
                RuntimeWarning,
                stacklevel=5,
            )
        return replayer.captured

    @torch.no_grad()
    def stage_step(self, hidden_states: torch.Tensor, arrays: StepArrays, bucket: int) -> None:
        """The host part of a step: stage the per-step arrays, the control writes
        staged since the last step and the token bitmask, and issue the one
        host-to-device copy (plus the caller's rows when not zero-copy, and
        rejection mode's draft distributions)."""
        b = self.buffers
        sample_rows = arrays.selected_token_indices
        with stage("staging copy"):
            if not is_same_view(hidden_states, b.source):
                # Not zero-copy: bring only the sample rows into the static
                # source and point the gather at them.
                index = upload(torch.as_tensor(sample_rows, dtype=torch.int64), hidden_states.device)
                b.source[: len(sample_rows)].copy_(hidden_states[index])
                sample_rows = np.arange(len(sample_rows), dtype=np.int64)
                self.stats.source_copies += 1
            if arrays.draft_probs:
                for row, q in arrays.draft_probs.items():
                    b.draft_probs[row : row + len(q)].copy_(upload(q, self.device))
            carried = []
            # The control writes staged since the last step (`ControlWrites.pending`), if any.
            writes = self.controls.writes.pending() if self.controls is not None and self.controls.writes.staged else None
            if writes is not None:
                carried.append(writes)
            mask = arrays.token_bitmask
            if mask is not None:
                # Only steps that restrict a row carry it.
                carried.append(np.ascontiguousarray(mask, dtype=np.int32).reshape(-1).view(np.uint8))
                arrays = dataclasses.replace(arrays, masked_rows=(mask != -1).any(1))  # a row of -1 words: unrestricted
            twins = b.load(arrays if sample_rows is arrays.selected_token_indices
                           else dataclasses.replace(arrays, selected_token_indices=sample_rows), bucket, carried=carried)
            # Device work queued behind the copy: the writes into their slots, the mask into its buffer.
            if writes is not None:
                self.controls.apply_writes(twins[0])
            if mask is not None:
                b.token_bitmask[: len(mask)].copy_(twins[-1].view(torch.int32).view(len(mask), -1))


Counters = TypeVar("Counters")


def copy_counters(counters: Counters) -> Counters:
    """A copy of a stats dataclass whose dict fields are copied too (cheap
    enough for every step, unlike deepcopy)."""
    out = copy.copy(counters)
    for name, value in vars(out).items():
        if isinstance(value, dict):
            setattr(out, name, dict(value))
    return out


def restore_counters(counters: Counters, saved: Counters) -> None:
    """Put `saved`'s values back into `counters`, in place: whoever holds
    `counters` sees them, and `saved` stays as it was for another rollback."""
    vars(counters).update(vars(copy_counters(saved)))
