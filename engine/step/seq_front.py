"""`StepEngine.step(hidden, seqs)` over a persistent request table keyed by request id."""
from __future__ import annotations

import operator
from operator import attrgetter
from typing import Sequence

import numpy as np

from engine.host.ledger import SamplerInputs, prepare_sampler_inputs
from engine.host.params import SeqMeta
from engine.host.control_slots import ControlHook
from engine.host.request_table import LazyLookup, RequestTable
from engine.host.stop_ids import StopIds
from engine.step.config import EngineConfig


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
    operations. When a new request finds no free row, the requests absent
    from the step longest give theirs up. Results are identical to
    `prepare_sampler_inputs(seqs)` (which stays the pure reference).
    """

    def __init__(self, config: EngineConfig, stop_rule: StopIds, controls: ControlHook, capacity: int):
        self.config = config
        self.stop_rule = stop_rule
        self.controls = controls
        self._reset(capacity)

    def _reset(self, capacity: int) -> None:
        if hasattr(self, "table"):  # a larger table replaces this one: its control slots go back
            for request_id in list(self.table.row_of):
                self.table.remove(request_id)
        self.table = RequestTable(capacity, seed_base=self.config.seed_base, stop_rule=self.stop_rule,
                                  controls=self.controls)
        self.params_id = np.zeros(capacity, np.int64)  # id() of the SamplingParams each row was written from
        self.last_seen = np.zeros(capacity, np.int64)  # the step that last named each row
        self.clock = 0
        self._last_ids: tuple = ()
        self._last_params: tuple = ()
        self._last_rows = np.zeros(0, np.int64)

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
            self._reset(2 * n)
        ids, params = tuple(map(_REQUEST_ID, seqs)), tuple(map(_PARAMS, seqs))
        if ids != self._last_ids or not all(map(operator.is_, params, self._last_params)):
            _refuse_token_constraints(ids, params)
        self.clock += 1
        if ids == self._last_ids:
            rows = self._last_rows
            if not all(map(operator.is_, params, self._last_params)):
                self._sync_params(ids, params, rows)
        else:
            rows = self._rows(ids, params, seqs)
            self._sync_params(ids, params, rows)
        self.last_seen[rows] = self.clock
        table = self.table
        seqlen_q, seqlen_k, generated = (np.fromiter(map(get, seqs), np.int32, n) for get in _STEP_COUNTS)
        is_prompt = np.fromiter(map(_IS_PROMPT, seqs), bool, n)
        read_slot = write_slot = None
        config = self.config
        if config.max_draft_tokens:
            read_slot, write_slot = (np.fromiter(map(get, seqs), np.int32, n) for get in _SLOTS)
        prompt_len = np.fromiter(map(_PROMPT_LEN, seqs), np.int32, n) if is_prompt.any() else None
        table.set_step_columns(rows, num_generated=generated, mtp_write_slot=write_slot, prompt_len=prompt_len)
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

    def _rows(self, ids: tuple, params: tuple, seqs: Sequence[SeqMeta]) -> np.ndarray:
        """[n] int64 rows of the step's requests, adding those the table lacks."""
        row_of = self.table.row_of
        found = list(map(row_of.get, ids))
        if None not in found:
            return np.array(found, np.int64)
        missing = [i for i, row in enumerate(found) if row is None]
        self._make_room(len({ids[i] for i in missing}), [row for row in found if row is not None])
        for i in missing:
            row = row_of.get(ids[i])  # a request named twice in the step was added by its first entry
            if row is None:
                row = self.table.add(ids[i], params[i], seqs[i].prompt_tokens, prompt_len=seqs[i].prompt_len,
                                     mtp_write_slot=seqs[i].mtp_write_slot, num_generated=seqs[i].num_generated)
                self.params_id[row] = id(params[i])
            found[i] = row
        return np.array(found, np.int64)

    def _make_room(self, needed: int, in_step: list[int]) -> None:
        """Evict the requests absent from this step that were named longest ago
        until `needed` rows are free."""
        table = self.table
        short = needed - (table.capacity - len(table))
        if short <= 0:
            return
        held = np.fromiter(table.row_of.values(), np.int64, len(table))
        absent = np.setdiff1d(held, np.asarray(in_step, np.int64))
        for row in absent[np.argsort(self.last_seen[absent], kind="stable")[:short]]:
            table.remove(table.request_ids[row])
            self.params_id[row] = 0
