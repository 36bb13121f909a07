"""`StepEngine.step(hidden, seqs)` over a persistent request table keyed by request id."""
from __future__ import annotations

import operator
from operator import attrgetter
from typing import Hashable, Sequence

import numpy as np

from engine.host.ledger import SamplerInputs, prepare_sampler_inputs
from engine.host.params import SeqMeta
from engine.host.control_slots import ControlHook
from engine.host.request_table import LazyLookup, RequestState, RequestTable
from engine.host.stop_ids import StopIds
from engine.step.engine_config import EngineConfig
from engine.step.prompt_logprobs import PromptLogprobAccumulator


_REQUEST_ID, _PARAMS, _PROMPT_LEN = attrgetter("request_id"), attrgetter("params"), attrgetter("prompt_len")
# SeqMeta fields that change per step, one `attrgetter` each: a column straight from a map
# costs less than tuples of all of them, transposed. prompt_len is read only when a prefill
# needs it; the slots only when the engine verifies drafts.
_STEP_COUNTS = tuple(attrgetter(name) for name in ("seqlen_q", "seqlen_k", "num_generated"))
_IS_PROMPT = attrgetter("is_prompt")
_FORCED_TOKEN = attrgetter("forced_token")
_SLOTS = (attrgetter("mtp_read_slot"), attrgetter("mtp_write_slot"))


def _refuse_token_constraints(ids: tuple, params: tuple) -> None:
    """The SeqMeta path keeps no output tokens, so it cannot serve bad words or
    structured output: ValueError naming the first request that asks."""
    for request_id, p in zip(ids, params):
        field = "bad_words" if p.bad_words else (p.structured[0] if p.structured else None)
        if field is not None:
            raise ValueError(f"request {request_id!r}: params.{field}: StepEngine.step(hidden, seqs) applies no "
                             "token constraints; use PersistentBatch(engine, tokenizer=) and engine.run")


class SeqMetaFront:
    """`StepEngine.step(hidden, seqs)` over a persistent table keyed by request id.

    A request gets a row the first time a step names it; its parameter
    columns and stop ids are rewritten only when its `SamplingParams` object
    changes (identity, not equality: `prompt_logprobs=True` equals `1`
    but asks for fewer alternatives). Each step reads only the `SeqMeta`
    fields that change per step, so a steady batch costs a few vectorised
    operations. Results are identical to `prepare_sampler_inputs(seqs)`
    (which stays the pure reference).

    A request's life (docs/contract.md §5): it lives from the first step that
    names it until `finish(request_id)`, or until a step names its id with the
    first chunk of a prompt (`is_prompt`, `seqlen_k == seqlen_q`): that is a new
    request under a reused id, which starts from nothing. A request holding state
    the step cannot rebuild from its `SeqMeta` (a control slot with its penalty
    counts, partial prompt logprobs) is never dropped; the row of one holding
    none is a cache, given up when a new request needs it (the requests absent
    from the step longest first) and rebuilt from its next `SeqMeta`; a step of
    more requests than the table has rows gets a table twice its size while no
    request holds state. A step that needs more rows than that leaves is
    refused, naming the table and its size.
    """

    def __init__(self, config: EngineConfig, stop_rule: StopIds, controls: ControlHook, capacity: int,
                 prompt_logprobs: PromptLogprobAccumulator):
        self.config = config
        self.stop_rule = stop_rule
        self.controls = controls
        self.prompt_logprobs = prompt_logprobs
        self.clock = 0
        self._new_table(capacity)

    def _new_table(self, capacity: int) -> None:
        self.table = RequestTable(capacity, seed_base=self.config.seed_base, stop_rule=self.stop_rule,
                                  controls=self.controls)
        self.params_id = np.zeros(capacity, np.int64)  # id() of the SamplingParams each row was written from
        self.last_seen = np.zeros(capacity, np.int64)  # the step that last named each row
        self._last_ids: tuple = ()
        self._last_params: tuple = ()
        self._last_rows = np.zeros(0, np.int64)

    def _grow(self, n: int) -> None:
        """A table for a step of `n` requests, more than this one's rows: 2 n rows, when no
        request holds state (each row is then a cache its next SeqMeta rebuilds);
        ValueError naming the table and its size otherwise (nothing changed)."""
        table = self.table
        held = np.fromiter(table.row_of.values(), np.int64, len(table))
        stateful = held[self._holds_state(held)]
        if len(stateful):
            raise ValueError(
                f"request {table.request_ids[stateful[0]]!r}: StepEngine.step: the step names {n} requests, more "
                f"than the {table.capacity} rows of the request table (2 x EngineConfig.max_num_reqs), and "
                f"{len(stateful)} live requests hold state there (penalty counts, partial prompt logprobs) that "
                "is never dropped; call engine.finish(request_id) for requests that ended, step fewer requests, "
                "or build the engine with a larger max_num_reqs")
        for request_id in list(table.row_of):
            table.remove(request_id)
        self._new_table(2 * n)

    def finish(self, request_id: Hashable) -> None:
        """The request ended: free its row, control slot (and counts) and partial prompt
        logprobs; the id may come back as a new request. An id the front holds no row
        for held no state (nothing to free)."""
        self.prompt_logprobs.discard(request_id)
        if request_id in self.table.row_of:
            self._drop(self.table.row_of[request_id], RequestState.FINISHED)

    def _drop(self, row: int, ended: RequestState) -> None:
        self.table.remove(self.table.request_ids[row], ended=ended)
        self.params_id[row] = 0
        self._last_ids, self._last_params, self._last_rows = (), (), np.zeros(0, np.int64)

    def ledger(self, seqs: Sequence[SeqMeta]) -> tuple[SamplerInputs, np.ndarray]:
        """The step's ledger and its stop ids ([n, max_stop_ids] int64)."""
        n = len(seqs)
        types = set(map(type, seqs))
        if n == 0 or (types != {SeqMeta} and not all(issubclass(t, SeqMeta) for t in types)):
            # The pure path: the empty batch, or the TypeError naming what is not a SeqMeta.
            config = self.config
            return (prepare_sampler_inputs(seqs, max_draft_tokens=config.max_draft_tokens,
                                           compaction_keep_tokens=config.compaction_keep_tokens,
                                           seed_base=self.table.seed_base, draft_pool=config.draft_pool),
                    self.table.stop_ids[:0])
        if n > self.table.capacity:
            self._grow(n)
        ids, params = tuple(map(_REQUEST_ID, seqs)), tuple(map(_PARAMS, seqs))
        if ids != self._last_ids or not all(map(operator.is_, params, self._last_params)):
            _refuse_token_constraints(ids, params)
        self.clock += 1
        seqlen_q, seqlen_k, generated = (np.fromiter(map(get, seqs), np.int32, n) for get in _STEP_COUNTS)
        is_prompt = np.fromiter(map(_IS_PROMPT, seqs), bool, n)
        # A prompt's first chunk (nothing cached before it) begins a request: under an id the
        # table holds, a new request under a reused id.
        first_chunk = is_prompt & (seqlen_q == seqlen_k)
        steady = ids == self._last_ids and not first_chunk.any()
        rows = self._last_rows if steady else self._rows(ids, params, seqs, first_chunk)
        self.last_seen[rows] = self.clock
        table = self.table
        read_slot = write_slot = None
        config = self.config
        if config.max_draft_tokens:
            read_slot, write_slot = (np.fromiter(map(get, seqs), np.int32, n) for get in _SLOTS)
        prompt_len = np.fromiter(map(_PROMPT_LEN, seqs), np.int32, n) if is_prompt.any() else None
        table.set_step_columns(rows, num_generated=generated, mtp_write_slot=write_slot, prompt_len=prompt_len)
        # After the step's columns: a parameter change is judged at the step's num_generated
        # (penalties switched on after generation are refused).
        if not steady or not all(map(operator.is_, params, self._last_params)):
            self._sync_params(ids, params, rows)
        forced = list(map(_FORCED_TOKEN, seqs))
        forced_tokens = None if forced.count(None) == n else np.array([-1 if t is None else t for t in forced], np.int64)
        inputs = table.ledger(rows, is_prompt, seqlen_q, seqlen_k, read_slot, max_draft_tokens=config.max_draft_tokens,
                              compaction_keep_tokens=config.compaction_keep_tokens, draft_pool=config.draft_pool,
                              prompt_tokens=LazyLookup(attrgetter("prompt_tokens"), seqs), forced_tokens=forced_tokens)
        self._last_ids, self._last_params, self._last_rows = ids, params, rows
        return inputs, table.stop_ids_of(rows)

    def control_slots(self, inputs: SamplerInputs) -> np.ndarray | None:
        """The control slots of the step `ledger` just built (see `RequestTable.control_slots_of`)."""
        return self.table.control_slots_of(self._last_rows, inputs) if inputs.num_reqs else None

    def _sync_params(self, ids: tuple, params: tuple, rows: np.ndarray) -> None:
        """Rewrite the rows whose SamplingParams object is not the one they were written from."""
        pid = np.fromiter(map(id, params), np.int64, len(params))
        for i in np.flatnonzero(self.params_id[rows] != pid):
            self.table.update(ids[i], params[i])
            self.params_id[rows[i]] = pid[i]

    def _rows(self, ids: tuple, params: tuple, seqs: Sequence[SeqMeta], first_chunk: np.ndarray) -> np.ndarray:
        """[n] int64 rows of the step's requests, adding those the table lacks and
        starting afresh those named with a prompt's first chunk. A request added here
        is taken out again should a later one be refused."""
        row_of = self.table.row_of
        for i in np.flatnonzero(first_chunk):
            if row_of.get(ids[i]) is not None:
                self.prompt_logprobs.discard(ids[i])
                self._drop(row_of[ids[i]], RequestState.FINISHED)
        found = list(map(row_of.get, ids))
        if None not in found:
            return np.array(found, np.int64)
        missing = [i for i, row in enumerate(found) if row is None]
        self._make_room(len({ids[i] for i in missing}), [row for row in found if row is not None], len(set(ids)))
        added = []
        try:
            for i in missing:
                row = row_of.get(ids[i])  # a request named twice in the step was added by its first entry
                if row is None:
                    row = self.table.add(ids[i], params[i], seqs[i].prompt_tokens, prompt_len=seqs[i].prompt_len,
                                         mtp_write_slot=seqs[i].mtp_write_slot, num_generated=seqs[i].num_generated)
                    self.params_id[row] = id(params[i])
                    added.append(ids[i])
                found[i] = row
        except BaseException:
            for request_id in added:
                self._drop(row_of[request_id], RequestState.REMOVED)
            raise
        return np.array(found, np.int64)

    def _holds_state(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows)] bool: rows whose request holds what its next SeqMeta cannot rebuild."""
        pending = set(self.prompt_logprobs.pending)
        ids = self.table.request_ids[rows]
        return (self.table.control_slot[rows] > 0) | np.fromiter((i in pending for i in ids), bool, len(rows))

    def _make_room(self, needed: int, in_step: list[int], distinct: int) -> None:
        """Give up the rows of requests absent from this step that hold no state, named
        longest ago first, until `needed` rows are free; ValueError (nothing given up)
        when that is not enough."""
        table = self.table
        short = needed - (table.capacity - len(table))
        if short <= 0:
            return
        held = np.fromiter(table.row_of.values(), np.int64, len(table))
        absent = np.setdiff1d(held, np.asarray(in_step, np.int64))
        droppable = absent[~self._holds_state(absent)]
        if len(droppable) < short:
            keeping = len(held) - len(droppable)
            raise ValueError(
                f"StepEngine.step: the step names {distinct} requests, {needed} new to the request table, but the "
                f"table holds {table.capacity} rows (2 x EngineConfig.max_num_reqs) and {keeping} of them belong to "
                "live requests that hold state (penalty counts, partial prompt logprobs), which are never evicted; "
                "call engine.finish(request_id) for requests that ended, or build the engine with a larger "
                "max_num_reqs")
        for row in droppable[np.argsort(self.last_seen[droppable], kind="stable")[:short]]:
            self._drop(int(row), RequestState.REMOVED)
