"""A small continuous-batching decode loop around StepEngine.

Per step: admit arrived requests (a KV-cache slot, a draft-info slot and a
row of the columnar request table each), schedule decodes first (1 + drafts
tokens each), then prefill chunks with the rest of the token budget; run the
model's forward straight into the engine's static hidden-state source
(zero-copy); build the ledger from the request table (docs/contract.md §5: no per-step
rebuild from Python objects) and let `engine.run` sample / verify; emit,
finish (EOS, stop ids, max_tokens, a failed row) and free the slots.

A step is atomic: whatever raises inside it (the model, the engine, this
loop's own bookkeeping, a KeyboardInterrupt), everything it changed is put
back before the exception leaves, so the next `step()` runs it again as if it
had never started. Requests leave through one door (`_release`): finished,
failed or aborted, they give back their table row, KV-cache slot and
draft-info slot.

Drafts come from an n-gram prompt-lookup drafter: the longest recent n-gram
of the request's history that occurred before proposes the tokens that
followed it. Verification is strict, so drafts change speed, never tokens.
"""
from __future__ import annotations

import bisect
import dataclasses
import time
from collections import OrderedDict, deque
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

import numpy as np
import torch

from engine.models.protocol import CausalLM, ForwardBatch, PrefixCopy
from engine.host.params import SamplingParams
from engine.step.prompt_logprobs import PromptLogprob
from engine.host.persistent_batch import DraftSlots, RequestTable
from engine.step.checkpoint import EngineCheckpoint
from engine.step.config import EngineConfig
from engine.step.outputs import StepOutput, TokenLogprob
from engine.step.step_engine import StepEngine
from profiling.ranges import stage


@dataclass(frozen=True)
class LoopConfig:
    max_num_reqs: int = 16  # running requests (also the engine's largest bucket)
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

    def __post_init__(self) -> None:
        if not isinstance(self.prefix_sharing, bool):
            raise ValueError(f"LoopConfig.prefix_sharing={self.prefix_sharing!r}: must be a bool")
        for name, minimum in (("max_num_reqs", 1), ("token_budget", 1), ("max_draft_tokens", 0),
                              ("ngram_max", 1), ("default_max_tokens", 1), ("min_shared_prefix", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"LoopConfig.{name}={value!r}: must be an int >= {minimum}")
        if self.token_budget < self.max_num_reqs * (1 + self.max_draft_tokens):
            raise ValueError(
                f"LoopConfig.token_budget={self.token_budget}: must cover one decode step of every running "
                f"request, max_num_reqs * (1 + max_draft_tokens) = {self.max_num_reqs * (1 + self.max_draft_tokens)}"
            )


def propose_ngram_drafts(history: np.ndarray, k: int, ngram_max: int) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the history's last
    n tokens (n = ngram_max down to 1) and propose the k tokens after it."""
    length = len(history)
    for n in range(min(ngram_max, length - 1), 0, -1):
        tail = history[length - n :]
        # Windows starting before the tail itself; the latest match wins.
        windows = np.lib.stride_tricks.sliding_window_view(history[: length - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return history[start : start + k].tolist()
    return []


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _check_request_id(request_id: Hashable) -> None:
    if request_id is None:
        raise ValueError("request_id=None: must not be None")
    try:
        hash(request_id)
    except TypeError:
        raise ValueError(f"request_id={request_id!r}: must be hashable") from None


def _checked_prompt(request_id: Hashable, prompt_tokens: object, vocab_size: int) -> np.ndarray:
    """[prompt_len] int64 from a flat sequence of int ids in [0, vocab_size). Nothing is
    coerced: a float, a bool, a string or a nested list is a caller's bug, not a token."""
    where = f"request {request_id!r}: prompt_tokens"
    if isinstance(prompt_tokens, torch.Tensor):
        if prompt_tokens.dtype.is_floating_point or prompt_tokens.dtype.is_complex or prompt_tokens.dtype == torch.bool:
            raise ValueError(f"{where}: a tensor of {prompt_tokens.dtype}, not of integer token ids")
        prompt_tokens = prompt_tokens.detach().cpu().numpy()
    if isinstance(prompt_tokens, np.ndarray):
        if not np.issubdtype(prompt_tokens.dtype, np.integer):
            raise ValueError(f"{where}: a numpy array of {prompt_tokens.dtype}, not of integer token ids")
        if prompt_tokens.ndim != 1:
            raise ValueError(f"{where}: shape {prompt_tokens.shape}, must be 1-D")
        tokens = prompt_tokens.tolist()  # Python ints: range checks below cannot overflow
    elif isinstance(prompt_tokens, SequenceABC) and not isinstance(prompt_tokens, (str, bytes, bytearray)):
        tokens = list(prompt_tokens)
        for i, token in enumerate(tokens):
            if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
                raise ValueError(f"{where}[{i}]={token!r}: must be an int token id, not a {type(token).__name__}")
    else:
        raise ValueError(
            f"{where}={prompt_tokens!r}: must be a sequence of int token ids, not a {type(prompt_tokens).__name__}"
        )
    if not tokens:
        raise ValueError(f"request {request_id!r}: prompt is empty (at least one token is needed)")
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise ValueError(f"{where}[{i}]={int(token)}: outside [0, {vocab_size})")
    return np.asarray(tokens, dtype=np.int64)


@dataclass
class Completion:
    request_id: Hashable
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
    seed: int | None = None
    finish_reason: str | None = None  # "stop" (EOS / stop id), "length", "abort" or "error"
    error: str | None = None  # finish_reason "error": the engine's message, naming the request and the cause
    text: str | None = None  # filled by callers that hold a tokenizer


@dataclass
class _Running:
    request_id: Hashable
    prompt: np.ndarray  # [prompt_len] int64
    params: SamplingParams
    max_tokens: int
    kv_slot: int
    completion: Completion
    draft_slot: int = 0  # draft-info write slot (0 = none: speculation off)
    table_row: int = -1  # row of the loop's RequestTable
    stop_ids: np.ndarray | None = None  # [max_stop_ids] ids suppressed before min_tokens (checked at submit)
    prefilled: int = 0  # prompt tokens already in the KV cache
    drafts: list[int] = field(default_factory=list)  # being verified this step

    @property
    def generated(self) -> list[int]:
        return self.completion.tokens

    def mark(self) -> tuple:
        """What a step may change in this request; `restore` puts it back."""
        c = self.completion
        return (self.prefilled, len(c.tokens), None if c.logprobs is None else len(c.logprobs),
                c.prompt_logprobs, c.seed, c.finish_reason, c.error)

    def restore(self, mark: tuple) -> None:
        c = self.completion
        self.prefilled, num_tokens, num_logprobs, c.prompt_logprobs, c.seed, c.finish_reason, c.error = mark
        del c.tokens[num_tokens:]
        if num_logprobs is not None:
            del c.logprobs[num_logprobs:]

    def cached_tokens(self) -> np.ndarray:
        """The tokens whose keys and values this request's cache slot holds, in order."""
        if self.prefilled < len(self.prompt):
            return self.prompt[: self.prefilled]
        # The last generated token is never fed back; rejected drafts sit past the end.
        return np.concatenate([self.prompt, np.asarray(self.generated[:-1], dtype=np.int64)])


@dataclass(frozen=True)
class _Scheduled:
    """One request's part of a step."""

    req: _Running
    is_prompt: bool
    seqlen_q: int
    seqlen_k: int  # context length after this step
    tokens: np.ndarray  # [seqlen_q] query tokens


@dataclass
class _StepUndo:
    """What one step may change, taken before it starts (`DecodeLoop._rollback`)."""

    stats: LoopStats
    engine: EngineCheckpoint
    running: list[_Running]
    retained: OrderedDict[int, np.ndarray]
    marks: list[tuple[_Running, tuple]]  # the step's requests, admitted ones included
    # Admitted this step: (arrival step, request, the tokens of the retained cache whose
    # slot it took, None for a slot fresh from the model).
    admitted: list[tuple[int, _Running, np.ndarray | None]] = field(default_factory=list)


@dataclass
class LoopStats:
    # The loop's clock, which arrival steps are counted in: steps run, idle ones included
    # (`run` skips a stretch of idle steps before a future arrival in one go).
    steps: int = 0
    tokens_generated: int = 0
    prefill_tokens: int = 0  # prompt tokens computed by the model
    shared_prefix_tokens: int = 0  # prompt tokens copied from another request's cache instead
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    forward_seconds: float = 0.0
    engine_seconds: float = 0.0
    schedule_seconds: float = 0.0


@dataclass(frozen=True)
class StepEvent:
    """Streaming output: what one request emitted in one step."""

    request_id: Hashable
    new_tokens: list[int]
    finished: bool


class DecodeLoop:
    """Waiting queue, running set, token budget, chunked prefill mixed with decode."""

    def __init__(
        self,
        model: CausalLM,
        config: LoopConfig | None = None,
        *,
        engine_config: EngineConfig | None = None,
        capture: bool = True,
    ):
        self.model = model
        self.config = config or LoopConfig()
        cfg = self.config
        engine_config = engine_config or EngineConfig()
        # The engine serves this loop: its largest bucket, draft count and
        # source size follow the loop; everything else (device, graphs,
        # sampler) comes from the caller's config.
        engine_config = dataclasses.replace(
            engine_config,
            max_num_reqs=cfg.max_num_reqs,
            max_draft_tokens=cfg.max_draft_tokens,
            max_source_rows=max(cfg.token_budget, cfg.max_num_reqs * (1 + cfg.max_draft_tokens)),
            eos_token_id=model.eos_token_id,
            buckets=None,
        )
        self.engine = StepEngine(model.lm_head_weight, engine_config)
        if capture:
            self.engine.capture()
        self.draft_slots = DraftSlots(cfg.max_num_reqs + 1) if cfg.max_draft_tokens else None
        self.table = RequestTable(cfg.max_num_reqs, seed_base=engine_config.seed_base)
        self.stop_ids = np.full((cfg.max_num_reqs, engine_config.max_stop_ids), -1, dtype=np.int64)  # per table row
        self.shares_prefixes = cfg.prefix_sharing and isinstance(model, PrefixCopy)
        # Finished requests' caches kept as prefix donors: kv slot -> the tokens it holds,
        # least recently used first; when the model has no free slot left, the first one
        # hands its slot to a request being admitted.
        self.retained: OrderedDict[int, np.ndarray] = OrderedDict()
        self.waiting: deque[tuple[int, _Running]] = deque()  # (arrival step, request), by arrival
        self.running: list[_Running] = []
        self.finished: dict[Hashable, Completion] = {}
        self._known: set[Hashable] = set()
        self.stats = LoopStats()

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
        which it may be admitted."""
        _check_request_id(request_id)
        if request_id in self._known:
            raise ValueError(f"request {request_id!r}: request_id was already submitted")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        prompt = _checked_prompt(request_id, prompt_tokens, self.model.vocab_size)
        if isinstance(arrival_step, bool) or not isinstance(arrival_step, (int, np.integer)) or arrival_step < 0:
            raise ValueError(f"request {request_id!r}: arrival_step={arrival_step!r}: must be an int >= 0")
        arrival_step = int(arrival_step)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.config.default_max_tokens
        # The last generated token is never fed back, so the cache needs one
        # slot less than prompt + max_tokens; drafts may run max_draft past it.
        needed = len(prompt) + max_tokens - 1 + self.config.max_draft_tokens
        if needed > self.model.max_context:
            raise ValueError(
                f"request {request_id!r}: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) needs a "
                f"context of {needed} but the model's max_context is {self.model.max_context}"
            )
        stop_ids = self.engine.stop_ids_for(request_id, params)  # raises for too many or out-of-vocabulary ids
        if params.min_tokens and len(np.unique(stop_ids[stop_ids >= 0])) == self.model.vocab_size:
            # Every id is suppressed until min_tokens: the first step would have nothing to sample.
            raise ValueError(
                f"request {request_id!r}: params.stop_token_ids={params.stop_token_ids} with EOS cover the whole "
                f"vocabulary ({self.model.vocab_size} ids) while min_tokens={params.min_tokens}: no token could be sampled"
            )
        top_n = params.num_logprobs
        if top_n > self.engine.config.sampler.max_logprobs:
            raise ValueError(
                f"request {request_id!r}: params.logprobs={top_n}: more than max_logprobs="
                f"{self.engine.config.sampler.max_logprobs}"
            )
        completion = Completion(
            request_id,
            prompt.tolist(),
            logprobs=[] if params.logprobs is not None else None,
        )
        self._known.add(request_id)
        # Kept in arrival order (stable for equal steps), so a late arrival
        # submitted early never blocks the queue in front of an early one.
        position = bisect.bisect_right([arrival for arrival, _ in self.waiting], arrival_step)
        request = _Running(request_id, prompt, params, max_tokens, -1, completion, stop_ids=stop_ids)
        self.waiting.insert(position, (arrival_step, request))

    def abort(self, request_id: Hashable) -> Completion:
        """Stop a queued or running request (between steps): it gives back its table
        row, KV-cache slot and draft-info slot, and its completion so far is returned
        (and kept in `finished`) with finish_reason "abort". A request that was waiting
        for it to prefill a shared prefix computes that prefix itself."""
        _check_request_id(request_id)
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

    def _aborted(self, req: _Running) -> Completion:
        req.completion.finish_reason = "abort"
        self.finished[req.request_id] = req.completion
        return req.completion

    # -- one step -------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self, undo: _StepUndo) -> None:
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
            if self.draft_slots is not None:
                req.draft_slot = self.draft_slots.allocate()
            req.table_row = self.table.add(req.request_id, req.params, req.prompt, mtp_write_slot=req.draft_slot)
            self.stop_ids[req.table_row] = req.stop_ids
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

    def _unadmit(self, arrival: int, req: _Running, evicted: np.ndarray | None) -> None:
        """Undo `_admit` for one request of a failed step: back to the front of the queue."""
        if req.table_row >= 0:
            self.table.remove(req.request_id)
            self.stop_ids[req.table_row] = -1
            req.table_row = -1
        if req.draft_slot:
            self.draft_slots.release(req.draft_slot)
            req.draft_slot = 0
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

    def _schedule(self) -> list[_Scheduled]:
        """This step's work in batch order: decodes first, then prefill chunks."""
        cfg = self.config
        budget = cfg.token_budget
        batch = []
        for req in self.running:
            if req.prefilled < len(req.prompt):
                continue
            drafts: list[int] = []
            if cfg.max_draft_tokens:
                room = req.max_tokens - len(req.generated) - 1  # drafts past max_tokens are wasted
                k = min(cfg.max_draft_tokens, max(room, 0))
                if k:
                    history = np.concatenate([req.prompt, np.asarray(req.generated, dtype=np.int64)])
                    drafts = propose_ngram_drafts(history, k, cfg.ngram_max)
            req.drafts = drafts
            q = 1 + len(drafts)
            # The first query token is the last generated one, not yet in the cache.
            seqlen_k = len(req.prompt) + len(req.generated) + len(drafts)
            batch.append(_Scheduled(req, False, q, seqlen_k, np.asarray([req.generated[-1], *drafts], dtype=np.int64)))
            budget -= q
        for req in self.running:
            if req.prefilled >= len(req.prompt) or budget <= 0:
                continue
            if req.prefilled == 0 and self.shares_prefixes and not self._share_prefix(req):
                continue  # waits for the request ahead of it to prefill the prefix they share
            chunk = min(len(req.prompt) - req.prefilled, budget)
            seqlen_k = req.prefilled + chunk
            req.drafts = []
            batch.append(_Scheduled(req, True, chunk, seqlen_k, req.prompt[req.prefilled : seqlen_k]))
            budget -= chunk
        return batch

    def _share_prefix(self, req: _Running) -> bool:
        """Before a request's first prefill chunk: copy the longest prefix of its prompt (at
        least `min_shared_prefix` tokens) that another running request's or a retained
        cache holds. Returns False when none holds one yet but a request ahead of it is
        prefilling a longer one: this one waits a step rather than compute the same
        positions. Waiting only ever points ahead in the running order, and budget goes out
        in that order, so the wait ends."""
        if req.params.num_prompt_logprobs >= 0:
            return True  # its prompt logprobs need every prompt position's logits
        limit = len(req.prompt) - 1  # the last prompt token is computed: its logits give the first token
        floor = self.config.min_shared_prefix
        best, source, coming, ahead = 0, None, False, True
        for other in self.running:
            if other is req:
                ahead = False
                continue
            held = other.cached_tokens()
            cached = min(common_prefix_length(req.prompt, held), limit)
            if cached >= floor and cached > best:
                best, source = cached, other.kv_slot
            if ahead and len(held) < len(other.prompt):  # still prefilling: what it will hold
                coming |= min(common_prefix_length(req.prompt, other.prompt), limit) >= max(floor, cached + 1)
        for slot, held in self.retained.items():
            cached = min(common_prefix_length(req.prompt, held), limit)
            if cached >= floor and cached > best:
                best, source = cached, slot
        if best:
            if source in self.retained:
                self.retained.move_to_end(source)
            self.model.copy_prefix(source, req.kv_slot, best)
            req.prefilled = best
            self.stats.shared_prefix_tokens += best
            return True
        return not coming

    def step(self) -> list[StepEvent]:
        """Admit, schedule, forward, sample; returns what each request emitted.

        Atomic: when anything raises, `_rollback` undoes what the step changed before
        the exception propagates (see the module docstring)."""
        undo = _StepUndo(
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
        return events

    def _step(self, undo: _StepUndo) -> tuple[list[StepEvent], list[_Running]]:
        t0 = time.perf_counter()
        with stage("schedule"):
            self._admit(undo)
            batch = self._schedule()
        if not batch:
            self.stats.steps += 1
            return [], []
        rows = np.fromiter((s.req.table_row for s in batch), dtype=np.int64, count=len(batch))
        is_prompt = np.fromiter((s.is_prompt for s in batch), dtype=bool, count=len(batch))
        seqlen_q = np.fromiter((s.seqlen_q for s in batch), dtype=np.int32, count=len(batch))
        seqlen_k = np.fromiter((s.seqlen_k for s in batch), dtype=np.int32, count=len(batch))
        token_ids = torch.from_numpy(np.concatenate([s.tokens for s in batch]))
        forward_batch = ForwardBatch.of([s.req.kv_slot for s in batch], seqlen_q, seqlen_k)
        t1 = time.perf_counter()
        with stage("model forward"):
            # Straight into the engine's static source: no copy between the
            # model's last layer and the captured gather.
            self.model.forward(token_ids, forward_batch.positions(), forward_batch, out=self.engine.source)
        t2 = time.perf_counter()
        with stage("ledger"):
            inputs = self.table.ledger(rows, is_prompt, seqlen_q, seqlen_k,
                                       max_draft_tokens=self.config.max_draft_tokens)
            drafts = [None if s.is_prompt else s.req.drafts for s in batch] if self.config.max_draft_tokens else None
            arrays = self.engine.step_arrays(inputs, self.stop_ids[rows], draft_tokens=drafts)
        out = self.engine.run(self.engine.source, inputs, arrays, host_start=t2)
        t3 = time.perf_counter()
        events, left = self._apply(batch, out)
        self.stats.schedule_seconds += (t1 - t0) + (time.perf_counter() - t3)
        self.stats.forward_seconds += t2 - t1
        self.stats.engine_seconds += t3 - t2
        self.stats.steps += 1
        return events, left

    def _rollback(self, undo: _StepUndo) -> None:
        """Put back what a failed step changed. The model's cache may hold keys and values
        the step wrote past each request's context: the next owner of those positions
        writes them before anything reads them."""
        self.engine.rollback(undo.engine)
        for req, mark in undo.marks:
            req.restore(mark)
            self.finished.pop(req.request_id, None)
        self.table.set_generated(np.array([r.table_row for r in undo.running], dtype=np.int64),
                                 np.array([len(r.generated) for r in undo.running], dtype=np.int32))
        self.running = undo.running
        self.retained = undo.retained
        for arrival, req, evicted in reversed(undo.admitted):
            self._unadmit(arrival, req, evicted)
        self.stats = undo.stats

    def _apply(self, batch: list[_Scheduled], out: StepOutput) -> tuple[list[StepEvent], list[_Running]]:
        """Emit the step's tokens and finish requests; returns the events and the requests
        that finished (their slots are released once the step is committed)."""
        events = []
        emitted = np.zeros(len(batch), dtype=np.int32)
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
            new = []
            for j, token in enumerate(out.tokens[i]):
                new.append(token)
                completion.tokens.append(token)
                if completion.logprobs is not None:
                    completion.logprobs.append(out.logprobs[i][j])
                if self._stops(req, token):
                    completion.finish_reason = "stop"
                    break
                if len(completion.tokens) >= req.max_tokens:
                    completion.finish_reason = "length"
                    break
            emitted[i] = len(new)
            self.stats.tokens_generated += len(new)
            finished = completion.finish_reason is not None
            events.append(StepEvent(req.request_id, new, finished))
        self.table.record_emitted(np.array([s.req.table_row for s in batch]), emitted)
        left = [r for r in self.running if r.completion.finish_reason is not None]
        if left:
            self.running = [r for r in self.running if r.completion.finish_reason is None]
            for req in left:
                self.finished[req.request_id] = req.completion
        return events, left

    def _release(self, req: _Running, *, keep_cache: bool) -> None:
        """Give back what a request that left holds: its table row, its draft-info slot,
        any prompt logprobs the engine holds for it, and its KV-cache slot (kept as a
        prefix donor when `keep_cache` and the model shares prefixes)."""
        self.table.remove(req.request_id)
        self.stop_ids[req.table_row] = -1
        if self.draft_slots is not None:
            self.draft_slots.release(req.draft_slot)
        self.engine.prompt_logprobs.discard(req.request_id)
        if keep_cache and self.shares_prefixes:
            self.retained[req.kv_slot] = req.cached_tokens()
        else:
            self.model.free_slot(req.kv_slot)

    def _stops(self, req: _Running, token: int) -> bool:
        """Does `token`, just appended, end the request? Not while it is among
        the first min_tokens (the engine suppresses EOS and stop ids there;
        other model stop ids are simply not honoured yet)."""
        if len(req.generated) <= req.params.min_tokens:
            return False
        if token in req.params.stop_token_ids:
            return True
        return not req.params.ignore_eos and token in self.model.stop_token_ids

    def run(self, on_step: Callable[[list[StepEvent]], None] | None = None) -> dict[Hashable, Completion]:
        """Step until every submitted request finished."""
        while self.has_work():
            if not self.running and self.waiting[0][0] > self.stats.steps:
                # Nothing runs before the next arrival: move the clock there instead of
                # running the idle steps one by one.
                self.stats.steps = self.waiting[0][0]
            events = self.step()
            if on_step:
                on_step(events)
        self.release_retained()
        return self.finished


def generate(
    model: CausalLM,
    prompts: Iterable[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    config: LoopConfig | None = None,
    engine_config: EngineConfig | None = None,
) -> list[Completion]:
    """Run every prompt to completion; completions in prompt order."""
    prompts = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"params: {len(params)} entries for {len(prompts)} prompts")
    loop = DecodeLoop(model, config, engine_config=engine_config)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    done = loop.run()
    return [done[i] for i in range(len(prompts))]
