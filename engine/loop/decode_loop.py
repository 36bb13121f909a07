"""A small continuous-batching decode loop around StepEngine.

Per step: admit arrived requests (a KV-cache slot and a persistent-batch row each),
schedule decodes (1 + n-gram drafts each) then prefill chunks within the token budget
(requests.py `schedule`), run the model straight into the engine's static source, let the persistent
batch build the ledger and `engine.run` sample and verify, then emit, finish (EOS, stop ids,
stop strings, max_tokens, a failed row) and free the slots. A request with `n > 1` runs as
n siblings `(request_id, j)` with their own seeds, sharing the prompt's prefill. A step is
atomic: whatever raises inside it, everything it changed is put back first, so the next
`step()` runs it again as if it had never started. Requests leave through one door
(`_release`): finished, failed or aborted, they give back their row and KV-cache slot.
"""
from __future__ import annotations

import bisect
import dataclasses
import time
from collections import OrderedDict, deque
from typing import Callable, Hashable, Sequence

import numpy as np
import torch

from engine.host.params import SamplingParams
from engine.loop.loop_config import LoopConfig, engine_config_for
from engine.loop.detokenize import output_decoder
from engine.host.token_ids import check_request_id
from engine.loop.requests import (Completion, RunningRequest, ScheduledRequest, StepEvent, StepUndo,
                                  choose_shared_prefix, common_prefix_length, drop_oldest_finished, fresh_seed,
                                  schedule, sibling_seed)
from engine.loop.stats import LoopStats
from engine.loop.stop_strings import OutputText, StopMatch
from engine.loop.submission import Submission, check_submission
from engine.models.protocol import CausalLM, ChatTokenizer, ForwardBatch, PrefixCopy
from engine.parallel.launch import agreed_seed_base, join_group, rank_head
from engine.step.batch import BatchStep, PersistentBatch
from engine.step.engine_config import EngineConfig
from engine.step.lm_head import LMHead
from engine.step.step_output import StepOutput
from engine.step.step_engine import StepEngine
from engine.trace import stage, step_range


class DecodeLoop:
    """Waiting queue, running set, token budget, chunked prefill mixed with decode."""

    def __init__(
        self,
        model: CausalLM,
        config: LoopConfig | None = None,
        *,
        engine_config: EngineConfig | None = None,
        tokenizer: ChatTokenizer | None = None,
        capture: bool = True,
    ):
        """`tokenizer` (a `ChatTokenizer`): fills `Completion.text`, enables `stop`
        strings, and is what structured output (json_schema / regex / grammar)
        compiles against."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or LoopConfig()
        cfg = self.config
        head: torch.Tensor | LMHead = model.lm_head_weight
        if cfg.tensor_parallel_size > 1:
            # Every rank runs this loop: the group first, then one seed base for all of them.
            device = (engine_config or EngineConfig()).resolved_device()
            join_group(cfg.tensor_parallel_size, device)
            self.config = cfg = dataclasses.replace(cfg, seed_base=agreed_seed_base(cfg.seed_base, device))
        engine_config = engine_config_for(cfg, model, engine_config)
        if cfg.tensor_parallel_size > 1:
            head = rank_head(model.lm_head_weight, engine_config)  # this rank's vocabulary shard
        self.engine = StepEngine(head, engine_config)
        if capture:
            self.engine.capture()
        self.batch = PersistentBatch(self.engine, cfg.max_num_reqs, tokenizer=tokenizer)
        self.shares_prefixes = cfg.prefix_sharing and isinstance(model, PrefixCopy)
        # Finished requests' caches kept as prefix donors: kv slot -> the tokens it holds,
        # least recently used first; when the model has no free slot left, the first one
        # hands its slot to a request being admitted.
        self.retained: OrderedDict[int, np.ndarray] = OrderedDict()
        self.waiting: deque[tuple[int, RunningRequest]] = deque()  # (arrival step, request), by arrival
        self.running: list[RunningRequest] = []
        self.finished: dict[Hashable, Completion] = {}
        self._known: set[Hashable] = set()
        self.families: dict[Hashable, tuple[Hashable, ...]] = {}  # request id of n > 1 -> its samples' ids
        self._handed: dict[Hashable, Completion] | None = None  # what `run` hands back, while it runs
        self.stats = LoopStats()
        self.last_step: BatchStep | None = None  # the ledger and staged arrays of the last step run (`explain()`)

    # -- submission -----------------------------------------------------------------

    def submit(
        self,
        request_id: Hashable,
        prompt_tokens: Sequence[int],
        params: SamplingParams | None = None,
        *,
        arrival_step: int = 0,
    ) -> None:
        """Queue a request; every check runs here, before anything is changed, so a
        bad request never reaches (or disturbs) the running batch. `prompt_tokens`:
        a flat sequence of int token ids (list, tuple, range, integer numpy array or
        tensor); `arrival_step`: the step of the loop's clock (`stats.steps`) from
        which it may be admitted. With `params.n > 1` the request runs as n samples
        keyed `(request_id, j)`, j = 0..n-1 (see `sibling_seed`). A request without
        a seed gets a fresh one here, from the OS's entropy, unless
        `LoopConfig.seed_base` is set (then the engine derives it)."""
        prompt, params, sample_ids, max_tokens, arrival_step = self._checked(request_id, prompt_tokens, params,
                                                                             arrival_step)
        if params.seed is None and self.config.seed_base is None:
            params = dataclasses.replace(params, seed=fresh_seed())
        self._known.add(request_id)
        self._known.update(sample_ids)
        if params.n > 1:
            self.families[request_id] = tuple(sample_ids)
        # Kept in arrival order (stable for equal steps), so a late arrival
        # submitted early never blocks the queue in front of an early one.
        position = bisect.bisect_right([arrival for arrival, _ in self.waiting], arrival_step)
        for j, sample_id in enumerate(sample_ids):
            # A sample without a seed gets the engine's, derived from its own id: siblings differ.
            sample_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else sibling_seed(params.seed, j))
            completion = Completion(sample_id, prompt.tolist(), logprobs=[] if params.logprobs is not None else None)
            request = RunningRequest(sample_id, prompt, sample_params, max_tokens, -1, completion,
                                     family=request_id if params.n > 1 else None)
            if params.stop:
                request.text = OutputText(output_decoder(self.tokenizer, params), params.stop,
                                          params.include_stop_str_in_output)
            self.waiting.insert(position + j, (arrival_step, request))

    def check(self, request_id: Hashable, prompt_tokens: Sequence[int], params: SamplingParams | None = None, *,
              arrival_step: int = 0) -> None:
        """Every check `submit` runs, without queuing anything: a caller with several
        requests checks them all before it submits the first."""
        self._checked(request_id, prompt_tokens, params, arrival_step)

    def _checked(self, request_id: Hashable, prompt_tokens: Sequence[int], params: SamplingParams | None,
                 arrival_step: int) -> Submission:
        return check_submission(request_id, prompt_tokens, params, arrival_step, known=self._known,
                                tokenizer=self.tokenizer, model=self.model, batch=self.batch, config=self.config)

    def forget(self, request_id: Hashable) -> Completion | list[Completion]:
        """Hand over a finished request's completion (all n for a request with n > 1) and
        drop every record of it, so a long-lived loop keeps nothing per finished request.
        A family is handed over whole: the id of one of its samples, `(request_id, j)`,
        is refused (forgetting it alone would leave the family's id unusable).
        **Raises** ValueError for a request that is unknown or has not finished, or a sample id."""
        check_request_id(request_id)
        owner = self._family_of(request_id)
        if owner is not None:
            raise ValueError(f"request {request_id!r}: one of the {len(self.families[owner])} samples of request "
                             f"{owner!r}; forget {owner!r} to hand over all of them")
        family = self.families.get(request_id)
        sample_ids = family or (request_id,)
        unfinished = [sample_id for sample_id in sample_ids if sample_id not in self.finished]
        if unfinished:
            state = "has not finished" if unfinished[0] in self._known else "is unknown"
            raise ValueError(f"request {unfinished[0]!r}: {state}, nothing to forget")
        done = [self.finished.pop(sample_id) for sample_id in sample_ids]
        self._known.difference_update((request_id, *sample_ids))
        self.families.pop(request_id, None)
        return done if family else done[0]

    def _family_of(self, request_id: Hashable) -> Hashable | None:
        """The id of the n > 1 request whose sample `request_id` is, or None."""
        if isinstance(request_id, tuple) and len(request_id) == 2:
            family = self.families.get(request_id[0])
            if family is not None and request_id in family:
                return request_id[0]
        return None

    def abort(self, request_id: Hashable) -> Completion | list[Completion]:
        """Stop a queued or running request (between steps): it gives back its batch
        row and KV-cache slot, and its completion so far is returned
        (and kept in `finished`) with finish_reason "abort". A request that was waiting
        for it to prefill a shared prefix computes that prefix itself.

        The id of a request with n > 1 aborts every sample of it still queued or running
        and returns all n completions in sample order (those that had finished keep their
        finish reason); `(request_id, j)` aborts one sample."""
        check_request_id(request_id)
        if request_id in self.families:
            samples = self.families[request_id]
            live = [sample_id for sample_id in samples if sample_id not in self.finished]
            if not live:
                raise ValueError(f"request {request_id!r}: all {len(samples)} samples already finished, nothing to abort")
            for sample_id in live:
                self._abort_one(sample_id)
            return [self.finished[sample_id] for sample_id in samples]
        return self._abort_one(request_id)

    def _abort_one(self, request_id: Hashable) -> Completion:
        for i, (_, req) in enumerate(self.waiting):
            if req.request_id == request_id:
                del self.waiting[i]
                return self._aborted(req)
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                self._release(req, keep_cache=False)
                return self._aborted(req)
        if request_id in self.finished:
            reason = self.finished[request_id].finish_reason
            raise ValueError(f"request {request_id!r}: already finished (finish_reason={reason!r}), nothing to abort")
        raise ValueError(f"request {request_id!r}: unknown request_id, nothing to abort")

    def _aborted(self, req: RunningRequest) -> Completion:
        req.completion.finish_reason = "abort"
        self._finish(req)
        return req.completion

    def _finish(self, req: RunningRequest) -> None:
        """Hand a request's completion over (`finished`), with its text when the loop has a
        tokenizer (a stop string sets its kept text when it matches)."""
        completion = req.completion
        if self.tokenizer is not None and completion.text is None:
            completion.text = output_decoder(self.tokenizer, req.params).decode(completion.tokens)
        self.finished[req.request_id] = completion
        if self._handed is not None:
            self._handed[req.request_id] = completion

    # -- one step -------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self, undo: StepUndo) -> None:
        while self.waiting and len(self.running) < self.config.max_num_reqs and self.waiting[0][0] <= self.stats.steps:
            try:
                kv_slot, evicted = self._take_slot()
            except RuntimeError:
                # The model's KV cache is full: the request waits for a finished one.
                if not self.running:
                    raise
                return
            arrival, req = self.waiting.popleft()
            req.kv_slot = kv_slot
            undo.admitted.append((arrival, req, evicted))
            undo.marks.append((req, req.mark()))
            req.table_row = self.batch.add(req.request_id, req.prompt, req.params)
            self.running.append(req)

    def _take_slot(self) -> tuple[int, np.ndarray | None]:
        """A KV-cache slot, and the tokens of the retained cache it came from (None for a
        free slot of the model). When the model has none left, the least recently used
        retained cache hands its slot over: the slot stays allocated and changes owner,
        so a failed step can hand it back (`_unadmit`)."""
        try:
            return self.model.allocate_slot(), None
        except RuntimeError:
            if not self.retained:
                raise
            return self.retained.popitem(last=False)

    def _unadmit(self, arrival: int, req: RunningRequest, evicted: np.ndarray | None) -> None:
        """Undo `_admit` for one request of a failed step: back to the front of the queue."""
        if req.table_row >= 0:
            self.batch.remove(req.request_id)
            req.table_row = -1
        if evicted is None:
            self.model.free_slot(req.kv_slot)
        else:
            # The failed step may have written this request's prompt over the start of the
            # donor's cache (a prefix copy, a chunk). Where the two prompts agree those keys
            # and values are the donor's own, so the common prefix is still the donor's.
            self.retained[req.kv_slot] = evicted[: common_prefix_length(evicted, req.prompt)]
        req.kv_slot = -1
        self.waiting.appendleft((arrival, req))

    def release_retained(self) -> None:
        """Give every retained cache's slot back to the model (`run` does this when it returns)."""
        while self.retained:
            self.model.free_slot(self.retained.popitem()[0])

    def _starts_prefill(self, req: RunningRequest) -> bool:
        """Before a request's first prefill chunk: copy the longest shared prefix another
        cache holds (`choose_shared_prefix`); False when it waits for the request ahead of
        it that prefills a longer one."""
        if not self.shares_prefixes:
            return True
        choice = choose_shared_prefix(req, self.running, self.retained, self.config.min_shared_prefix)
        if choice.length:
            if choice.source in self.retained:
                self.retained.move_to_end(choice.source)
            self.model.copy_prefix(choice.source, req.kv_slot, choice.length)
            req.prefilled = choice.length
            self.stats.shared_prefix_tokens += choice.length
        return not choice.wait

    def step(self) -> list[StepEvent]:
        """Admit, schedule, forward, sample; returns what each request emitted.

        Atomic: when anything raises, `_rollback` undoes what the step changed before
        the exception propagates (see the module docstring)."""
        undo = StepUndo(
            stats=dataclasses.replace(self.stats),
            engine=self.engine.checkpoint(),
            running=list(self.running),
            retained=OrderedDict(self.retained),
            marks=[(req, req.mark()) for req in self.running],
        )
        try:
            events, left = self._step(undo)
        except BaseException:
            self._rollback(undo)
            raise
        # The step is committed: hand back what the requests that left held. (Outside the
        # undo: a KV slot given back to the model cannot be taken back.)
        for req in left:
            self._release(req, keep_cache=req.completion.finish_reason in ("stop", "length"))
        drop_oldest_finished(self.finished, self._known, self.families, self.config.max_finished)
        return events

    def _step(self, undo: StepUndo) -> tuple[list[StepEvent], list[RunningRequest]]:
        t0 = time.perf_counter()
        with stage("schedule"):
            self._admit(undo)
            batch = schedule(self.running, self.config, self._starts_prefill)
        if not batch:
            self.stats.steps += 1
            return [], []
        # The step's columns in one pass: query and context lengths, table rows, KV slots.
        seqlen_q, seqlen_k, rows, slots = np.array(
            [(s.seqlen_q, s.seqlen_k, s.req.table_row, s.req.kv_slot) for s in batch], dtype=np.int64).T
        seqlen_q, seqlen_k = seqlen_q.astype(np.int32), seqlen_k.astype(np.int32)
        # The rest of the step under one parent range (a trace's "step"), with its arguments.
        with step_range(self.stats.steps, len(batch), int(seqlen_q.sum()), self.engine.buckets.bucket_for(len(batch))):
            token_ids = torch.from_numpy(np.concatenate([s.tokens for s in batch]))
            forward_batch = ForwardBatch.of(slots, seqlen_q, seqlen_k)
            t1 = time.perf_counter()
            with stage("model forward"):
                # Straight into the engine's static source: no copy between the
                # model's last layer and the captured gather.
                self.model.forward(token_ids, forward_batch.positions(), forward_batch, out=self.engine.source)
            t2 = time.perf_counter()
            with stage("ledger"):
                prepared = self.last_step = self.batch.prepare_rows(rows, seqlen_q, seqlen_k,
                                                                    draft_tokens=self._draft_tokens(batch))
            out = self.engine.run(self.engine.source, prepared.inputs, prepared.arrays, host_start=t2)
            t3 = time.perf_counter()
            events, left = self._apply(batch, prepared, out, undo)
        self.stats.schedule_seconds += (t1 - t0) + (time.perf_counter() - t3)
        self.stats.forward_seconds += t2 - t1
        self.stats.engine_seconds += t3 - t2
        self.stats.steps += 1
        return events, left

    def _rollback(self, undo: StepUndo) -> None:
        """Put back what a failed step changed. The model's cache may hold keys and values
        the step wrote past each request's context: the next owner of those positions
        writes them before anything reads them."""
        self.engine.rollback(undo.engine)
        for req, cut_tokens, cut_logprobs in reversed(undo.cuts):
            req.completion.tokens.extend(cut_tokens)
            if cut_logprobs is not None:
                req.completion.logprobs.extend(cut_logprobs)
        for req, mark in undo.marks:
            req.restore(mark)
            self.finished.pop(req.request_id, None)
        self.batch.set_generated(np.array([r.table_row for r in undo.running], dtype=np.int64),
                                 np.array([len(r.generated) for r in undo.running], dtype=np.int32))
        self.running = undo.running
        self.retained = undo.retained
        for arrival, req, evicted in reversed(undo.admitted):
            self._unadmit(arrival, req, evicted)
        self.stats = undo.stats

    def _draft_tokens(self, batch: list[ScheduledRequest]) -> np.ndarray | None:
        """[n, max_draft_tokens] int64: row i's first seqlen_q - 1 entries are request i's
        drafts (the rest is never read); None without speculation."""
        k = self.config.max_draft_tokens
        if not k:
            return None
        drafts = np.zeros((len(batch), k), dtype=np.int64)
        for i, scheduled in enumerate(batch):
            proposed = scheduled.req.drafts
            drafts[i, : len(proposed)] = proposed
        return drafts

    def _apply(
        self, batch: list[ScheduledRequest], prepared: BatchStep, out: StepOutput, undo: StepUndo
    ) -> tuple[list[StepEvent], list[RunningRequest]]:
        """Emit the step's tokens and finish requests; returns the events and the requests
        that finished (their slots are released once the step is committed)."""
        events = []
        model_stops = self.model.stop_token_ids
        for i, scheduled in enumerate(batch):
            req = scheduled.req
            completion = req.completion
            completion.seed = out.seeds[i]
            if scheduled.is_prompt:
                req.prefilled = scheduled.seqlen_k
                self.stats.prefill_tokens += scheduled.seqlen_q
                if out.prompt_logprobs[i] is not None and req.prefilled == len(req.prompt):
                    completion.prompt_logprobs = out.prompt_logprobs[i]
            else:
                self.stats.drafts_proposed += len(req.drafts)
                self.stats.drafts_accepted += out.num_accepted[i]
            if out.errors[i] is not None:
                # A non-finite or unsatisfiable row: this request fails, nobody else notices.
                completion.finish_reason, completion.error = "error", out.errors[i]
                events.append(StepEvent(req.request_id, [], True))
                continue
            new, p = [], req.params
            for j, token in enumerate(out.tokens[i]):
                new.append(token)
                completion.tokens.append(token)
                if completion.logprobs is not None:
                    completion.logprobs.append(out.logprobs[i][j])
                # Not while among the first min_tokens (the engine suppresses EOS and stop ids
                # there; other model stop ids are simply not honoured yet).
                if len(completion.tokens) > p.min_tokens and (
                        token in p.stop_token_ids or not p.ignore_eos and token in model_stops):
                    completion.finish_reason = "stop"
                    completion.stop_reason = token if token in req.params.stop_token_ids else None
                    break
                if len(completion.tokens) >= req.max_tokens:
                    completion.finish_reason = "length"
                    break
            retracted = 0
            if req.text is not None and new:
                # After the step's tokens, not per token: the text of one token can depend on
                # the next (a character split over two), and drafts bring several at once.
                match = req.text.advance(completion.tokens, final=completion.finish_reason is not None)
                if match is not None:
                    before = len(completion.tokens) - len(new)
                    self._cut(req, match, undo)
                    retracted = max(0, before - match.num_tokens)
                    new = new[: max(0, match.num_tokens - before)]
            self.stats.tokens_generated += len(new) - retracted
            finished = completion.finish_reason is not None
            events.append(StepEvent(req.request_id, new, finished, retracted))
        # Past a request's stop, out.tokens may hold more than it emitted: it leaves anyway.
        self.batch.record(prepared, out)
        left = [r for r in self.running if r.completion.finish_reason is not None]
        if left:
            self.running = [r for r in self.running if r.completion.finish_reason is None]
            for req in left:
                self._finish(req)
        return events, left

    def _cut(self, req: RunningRequest, match: StopMatch, undo: StepUndo) -> None:
        """Finish a request on a stop string: keep the text before it (through it when
        included) and the tokens that produced that text (engine/loop/stop_strings.py).
        What is cut may predate this step, so it goes into the undo record."""
        completion = req.completion
        cut_tokens = completion.tokens[match.num_tokens :]
        cut_logprobs = None if completion.logprobs is None else completion.logprobs[match.num_tokens :]
        undo.cuts.append((req, cut_tokens, cut_logprobs))
        del completion.tokens[match.num_tokens :]
        if completion.logprobs is not None:
            del completion.logprobs[match.num_tokens :]
        completion.finish_reason, completion.stop_reason, completion.text = "stop", match.stop, match.text

    def _release(self, req: RunningRequest, *, keep_cache: bool) -> None:
        """Give back what a request that left holds: its batch row (and all the batch
        holds for it), and its KV-cache slot (kept as a prefix donor when
        `keep_cache` and the model shares prefixes)."""
        self.batch.remove(req.request_id)  # its row, slots, constraint and partial prompt logprobs
        if keep_cache and self.shares_prefixes:
            self.retained[req.kv_slot] = req.cached_tokens()
        else:
            self.model.free_slot(req.kv_slot)

    def run(self, on_step: Callable[[list[StepEvent]], None] | None = None) -> dict[Hashable, Completion]:
        """Step until every submitted request finished. Returns the completions `finished`
        held when it started and every one that finished while it ran (also those that
        `LoopConfig.max_finished` has dropped from `finished` since)."""
        self._handed = dict(self.finished)
        try:
            while self.has_work():
                if not self.running and self.waiting[0][0] > self.stats.steps:
                    # Nothing runs before the next arrival: move the clock there instead of
                    # running the idle steps one by one.
                    self.stats.steps = self.waiting[0][0]
                events = self.step()
                if on_step:
                    on_step(events)
            self.release_retained()
            return self._handed
        finally:
            self._handed = None

