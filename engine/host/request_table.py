"""The request table: per-request state kept between steps (docs/contract.md §5).

Requests get a row of the columnar `RequestTable` when they join and give it
back when they leave; a step names its requests by table row and gathers every
column in one fancy-index per dtype group. Nothing per step is rebuilt from
Python objects. The embedding API over it (`PersistentBatch`) and the table
behind `StepEngine.step(hidden, seqs)` (`SeqMetaFront`) are the step's
(engine/step/batch.py, engine/step/seq_front.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from engine.host.control_slots import ControlHook, NoControls, first_control
from engine.host.ledger import (
    SamplerInputs,
    StepSchedule,
    build_ledger,
    draft_read_rows,
    suppression_rows,
    validate_batch,
)
from engine.host.param_records import derive_seeds, neutral_record
from engine.host.params import SEQ_RECORD, SamplingParams, SeqMeta
from engine.host.stop_ids import StopIds

class RequestState(enum.Enum):
    """One request's place in its life (docs/contract.md §5)."""

    QUEUED = "queued"  # added; no step recorded for it yet
    PREFILLING = "prefilling"  # some prompt chunks recorded, no token generated
    DECODING = "decoding"  # at least one token generated
    FINISHED = "finished"  # ended by `finish` (the step() front); everything it held is free
    REMOVED = "removed"  # not in the table (never added, or removed); everything it held is free


@dataclass(frozen=True)
class PreparedRows:
    """The table rows a step was prepared over, with their generations and versions then.

    Every call that uses a prepared step checks it first: `engine.run` (`check`, then
    `mark_run`) and `record` (`check(ran=True)`, then `mark_recorded`). A request removed,
    finished or replaced by a reused id since, or a step run, recorded or rolled back since,
    makes the step stale: ValueError naming the request, nothing changed."""

    table: RequestTable
    rows: np.ndarray  # [n] int64 table rows, batch order
    generations: np.ndarray  # [n] int64
    versions: np.ndarray  # [n] int64
    token: int  # the version this step gives its rows once it ran
    request_ids: tuple  # [n], for messages

    def check(self, *, ran: bool = False) -> None:
        """ValueError naming the first request whose row changed since the step was prepared
        (or, `ran`, since this step ran); changes nothing."""
        table, rows = self.table, self.rows
        expected = self.token if ran else self.versions
        changed = (table.generation[rows] != self.generations) | (table.version[rows] != expected)
        if changed.any():
            table.refuse_stale(self, int(np.flatnonzero(changed)[0]), ran=ran)

    def mark_run(self) -> None:
        """The step ran: `check(ran=True)` now passes, `check()` refuses to run it again."""
        self.table.version[self.rows] = self.token

    def mark_recorded(self) -> None:
        """The step was recorded: every step prepared before is stale, this one included."""
        self.table.bump(self.rows)


class RequestTable:
    """A record (`SEQ_RECORD`) for each of up to `capacity` live requests, the form the ledger
    reads a batch in (its request columns: lengths, counts, parameters), plus their prompt tokens,
    `SamplingParams` and (with a `stop_rule`) stop ids, by table row.

    `controls`: what the engine's sampling-control state says when a request
    joins, changes or leaves (None: no control state, any control is refused)."""

    def __init__(
        self,
        capacity: int,
        *,
        seed_base: int = 0,
        stop_rule: StopIds | None = None,
        controls: ControlHook | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: must be >= 1")
        self.capacity = capacity
        self.seed_base = seed_base
        self.stop_rule = stop_rule
        self._neutral = neutral_record()
        self.cols = np.full(capacity, self._neutral)  # `SEQ_RECORD`s; a request's seed derived when it brought none
        self.prompt_tokens: list[np.ndarray | None] = [None] * capacity
        self.params: list[SamplingParams | None] = [None] * capacity
        width = 0 if stop_rule is None else stop_rule.width
        self.stop_ids = np.full((capacity, width), -1, dtype=np.int64)  # [capacity, max_stop_ids]
        # Sampling controls (penalties, logit bias, allowed tokens): each row's control slot, 0 = none.
        self.controls = controls or NoControls("this request table has no sampling-control state")
        self.control_slot = np.zeros(capacity, dtype=np.int64)
        self.request_ids = np.full(capacity, None, dtype=object)  # fancy-indexed per step
        self.occupied = np.zeros(capacity, dtype=bool)
        self._batch_position = np.zeros(capacity, dtype=np.int32)  # scratch for the duplicate check
        # Per row: whether its control slot has counted every token since the first (joined
        # before generation): only then may penalties, which need those counts, be switched on.
        self.counts_from_start = np.zeros(capacity, dtype=bool)
        # Per row: the generation of the request it holds (a number no other request of this
        # table ever had; 0 = empty) and its version (changed by every step run or recorded
        # and every change of its state), which a prepared step is checked against.
        self.generation = np.zeros(capacity, dtype=np.int64)
        self.version = np.zeros(capacity, dtype=np.int64)
        self._clock = 0  # the last generation or version handed out
        self.ended: list[RequestState | None] = [None] * capacity  # how each row's last request ended
        self.prefilled = np.zeros(capacity, dtype=np.int32)  # prompt tokens recorded as computed
        self.row_of: dict[Hashable, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._steady: _SteadyDecode | None = None  # see _steady_ledger
        self._stop_ids_of: tuple[bytes, np.ndarray] | None = None  # the last stop_ids_of, while no stop ids change

    def __len__(self) -> int:
        return len(self.row_of)

    def add(
        self,
        request_id: Hashable,
        params: SamplingParams,
        prompt_tokens: Sequence[int] | None = None,
        *,
        prompt_len: int | None = None,
        mtp_write_slot: int = 0,
        num_generated: int = 0,
    ) -> int:
        """Validate, then take a row. The prompt's length comes from
        `prompt_tokens`, or from `prompt_len` for a caller that passes each
        step's prompt tokens to `ledger` instead. `num_generated`: tokens the
        request generated before it joined (a penalised request refuses any).
        Nothing is written when validation fails."""
        if request_id in self.row_of:
            raise ValueError(f"request {request_id!r}: request_id is already in the table")
        if not self._free:
            raise RuntimeError(f"request {request_id!r}: request table is full ({self.capacity} rows)")
        if prompt_tokens is not None:
            prompt_len = len(prompt_tokens)
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"request {request_id!r}: prompt_len={prompt_len!r}: must be an int >= 1")
        seq = self._checked(request_id, params, prompt_len, 0, mtp_write_slot, prompt_tokens)
        stop_ids = self._stop_ids(request_id, params)
        needs_slot = self.controls.check(request_id, params, prompt_tokens, num_generated, False)
        # The slot first: should joining raise, no row has been taken (and none leaks).
        slot = self.controls.join(params, prompt_tokens) if needs_slot else 0
        row = self._free.pop()
        self._write(row, seq, stop_ids)
        self.control_slot[row] = slot
        self.counts_from_start[row] = num_generated == 0
        self.prefilled[row] = 0
        self.prompt_tokens[row] = None if prompt_tokens is None else np.asarray(prompt_tokens, dtype=np.int32)
        self.request_ids[row] = request_id
        self.occupied[row] = True
        self.row_of[request_id] = row
        self.generation[row] = self._tick()  # the row's version carries over: the generation tells requests apart
        return row

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def update(self, request_id: Hashable, params: SamplingParams) -> None:
        """New sampling parameters (and stop ids) for a request in the table;
        validated first, nothing is written when that fails."""
        row = self.row(request_id)
        cols = self.cols
        seq = self._checked(request_id, params, int(cols["prompt_len"][row]), int(cols["num_generated"][row]),
                            int(cols["mtp_write_slot"][row]))
        stop_ids = self._stop_ids(request_id, params)
        slot = int(self.control_slot[row])
        generated = int(cols["num_generated"][row])
        needs_slot = self.controls.check(request_id, params, self.prompt_tokens[row], generated, slot > 0)
        if needs_slot and params.has_penalties and generated and not self.counts_from_start[row]:
            # A slot taken after generation (for a logit bias, say) counted from then on only.
            raise ValueError(f"request {request_id!r}: {first_control(params)}: penalties must be set before the "
                             f"first generated token (the request has {generated}; its control slot was taken "
                             "after generation began, so the counts are unknown)")
        self._write(row, seq, stop_ids)
        self.version[row] = self._tick()
        if needs_slot and slot:
            self.controls.rewrite(slot, params)
        elif needs_slot:
            self.control_slot[row] = self.controls.join(params, self.prompt_tokens[row])
            self.counts_from_start[row] = generated == 0
        elif slot:
            self.controls.leave(slot)
            self.control_slot[row] = 0

    def remove(self, request_id: Hashable, *, ended: RequestState = RequestState.REMOVED) -> None:
        """Free the request's row and give back its control slot; the row's generation ends
        (a step prepared with it is refused from now on). `ended`: REMOVED or FINISHED."""
        row = self.row(request_id)
        self.ended[row] = ended
        self.prefilled[row] = 0
        del self.row_of[request_id]
        self._steady = None
        if self.control_slot[row]:
            self.controls.leave(int(self.control_slot[row]))
            self.control_slot[row] = 0
        self.counts_from_start[row] = False
        self.generation[row] = 0
        self.cols[row] = self._neutral
        self.prompt_tokens[row] = None
        self.params[row] = None
        self.stop_ids[row] = -1
        self._stop_ids_of = None
        self.request_ids[row] = None
        self.occupied[row] = False
        self._free.append(row)

    def row(self, request_id: Hashable) -> int:
        try:
            return self.row_of[request_id]
        except (KeyError, TypeError):
            raise ValueError(f"request {request_id!r}: not in the table") from None

    def _checked(
        self,
        request_id: Hashable,
        params: SamplingParams,
        prompt_len: int,
        num_generated: int,
        mtp_write_slot: int,
        prompt_tokens: Sequence[int] | None = None,
    ) -> SeqMeta:
        """A request's columns as a `SeqMeta`, which validates them (naming the
        request and the field). A decode view: prompt logprobs need their
        targets only in a prefill step, whose caller brings the tokens."""
        return SeqMeta(request_id, is_prompt=False, seqlen_q=1, seqlen_k=prompt_len + num_generated,
                       prompt_len=prompt_len, prompt_tokens=prompt_tokens, num_generated=num_generated,
                       params=params, mtp_write_slot=mtp_write_slot)

    def _stop_ids(self, request_id: Hashable, params: SamplingParams) -> np.ndarray | None:
        return None if self.stop_rule is None else self.stop_rule.for_request(request_id, params)

    def _write(self, row: int, seq: SeqMeta, stop_ids: np.ndarray | None) -> None:
        self._steady = None
        self.cols[row] = np.frombuffer(seq.ledger_record, dtype=SEQ_RECORD)[0]
        derive_seeds(self.cols[row:row + 1], [seq.request_id], self.seed_base)
        self.params[row] = seq.params
        if stop_ids is not None:
            self.stop_ids[row] = stop_ids
            self._stop_ids_of = None

    def stop_ids_of(self, rows: np.ndarray) -> np.ndarray:
        """[n, max_stop_ids] int64 stop ids of table rows; a steady batch gets last step's array again."""
        key = rows.tobytes()
        if self._stop_ids_of is None or self._stop_ids_of[0] != key:
            self._stop_ids_of = (key, self.stop_ids[rows])
        return self._stop_ids_of[1]

    def control_slots_of(self, rows: np.ndarray, inputs: SamplerInputs) -> np.ndarray | None:
        """[n] int64 control slots of a step's requests (table rows `rows`), None
        when none has one. A non-last prompt chunk stages slot 0: its token is
        discarded, so it neither needs the controls nor counts."""
        slots = self.control_slot[rows]
        if not slots.any():
            return None
        slots = np.where(inputs.is_prompt & ~inputs.is_last_chunk, 0, slots)
        return slots if slots.any() else None

    def record_emitted(self, rows: np.ndarray, counts: np.ndarray, prefilled: np.ndarray | None = None) -> None:
        """Advance num_generated after a step emitted `counts` tokens per row; `prefilled`
        [n] int32: the prompt tokens computed after the step (0 for a decode)."""
        np.add.at(self.cols["num_generated"], rows, counts)
        if prefilled is not None:
            self.prefilled[rows] = np.maximum(self.prefilled[rows], prefilled)

    def set_generated(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Set num_generated (a caller putting back what a failed step changed)."""
        self.cols["num_generated"][rows] = counts
        self.version[rows] = self._tick()

    def state(self, request_id: Hashable) -> RequestState:
        """Where the request stands: QUEUED (nothing generated, nothing recorded yet),
        PREFILLING or DECODING; REMOVED for an id the table does not hold."""
        row = self.row_of.get(request_id)
        if row is None:
            return RequestState.REMOVED
        if self.cols["num_generated"][row]:
            return RequestState.DECODING
        return RequestState.PREFILLING if self.prefilled[row] else RequestState.QUEUED

    def prepared(self, rows: np.ndarray) -> PreparedRows:
        """The generations and versions of `rows` now, for a step prepared over them."""
        self._clock += 1  # the token: a version no other step gives
        return PreparedRows(self, rows, self.generation[rows], self.version[rows], self._clock,
                            tuple(self.request_ids[rows]))

    def refuse_stale(self, prepared: PreparedRows, i: int, *, ran: bool) -> None:
        """ValueError naming request `i` of a prepared step whose row changed (`PreparedRows.check`)."""
        row = int(prepared.rows[i])
        where = f"request {prepared.request_ids[i]!r}: stale step"
        if self.generation[row] != prepared.generations[i]:
            ended = self.ended[row] or RequestState.REMOVED
            now = (f"it was {ended.value} since the step was prepared" if self.generation[row] == 0 else
                   f"it was removed and table row {row} now holds request {self.request_ids[row]!r}")
            raise ValueError(f"{where}: {now}; prepare the step again")
        if ran:
            raise ValueError(f"{where}: record(step, out) takes the step engine.run just ran, once (this one was "
                             "not run, was recorded already, or the request changed since)")
        raise ValueError(f"{where}: the request changed since the step was prepared (a step run or recorded, "
                         "new parameters, a rollback); prepare the step again")

    def bump(self, rows: np.ndarray) -> None:
        """A new version for `rows` (a step recorded): every step prepared before is stale."""
        self._clock += 1
        self.version[rows] = self._clock

    def set_step_columns(
        self,
        rows: np.ndarray,
        *,
        num_generated: np.ndarray,
        mtp_write_slot: np.ndarray | None = None,
        prompt_len: np.ndarray | None = None,
    ) -> None:
        """Overwrite the columns a `SeqMeta` carries per step (the SeqMeta front);
        None leaves a column as it is. A changed write slot drops the
        steady-decode layout, which carries the write slots over. prompt_len
        only enters prefill rows (is the chunk the last one?), so a decode-only
        step need not bring it."""
        cols = self.cols
        cols["num_generated"][rows] = num_generated
        if mtp_write_slot is not None:
            if self._steady is not None and (cols["mtp_write_slot"][rows] != mtp_write_slot).any():
                self._steady = None
            cols["mtp_write_slot"][rows] = mtp_write_slot
        if prompt_len is not None:
            cols["prompt_len"][rows] = prompt_len

    def ledger(
        self,
        rows: np.ndarray,
        is_prompt: np.ndarray,
        seqlen_q: np.ndarray,
        seqlen_k: np.ndarray,
        mtp_read_slot: np.ndarray | None = None,
        *,
        max_draft_tokens: int = 0,
        compaction_keep_tokens: int | None = None,
        draft_pool: bool = True,
        prompt_tokens: Sequence[Sequence[int] | None] | None = None,
        forced_tokens: np.ndarray | None = None,
    ) -> SamplerInputs:
        """Validate and build the step's ledger from table rows (batch order).
        `forced_tokens`: [n] int64 per request, -1 none (None: no request has one).
        `prompt_tokens`: this step's prompt tokens per request, read only for
        prompt-logprob targets; None: those given to `add`. `draft_pool`: see
        `validate_batch`."""
        rows = np.asarray(rows)
        steady = self._steady
        if (
            steady is not None
            and forced_tokens is None
            and steady.max_draft_tokens == max_draft_tokens
            and compaction_keep_tokens is None
            # Byte comparisons: a few hundred ns where np.array_equal costs µs.
            and rows.tobytes() == steady.rows
            and np.asarray(seqlen_q, dtype=np.int32).tobytes() == steady.seqlen_q
            and not np.asarray(is_prompt).any()
        ):
            return self._steady_ledger(steady, rows, seqlen_q, seqlen_k, mtp_read_slot)
        self.check_rows(rows)
        n = len(rows)
        schedule = StepSchedule(
            request_ids=self.request_ids[rows].tolist(),
            is_prompt=np.asarray(is_prompt, dtype=bool),
            seqlen_q=np.asarray(seqlen_q, dtype=np.int32),
            seqlen_k=np.asarray(seqlen_k, dtype=np.int32),
            mtp_read_slot=np.zeros(n, np.int32) if mtp_read_slot is None else mtp_read_slot,
            prompt_tokens=LazyLookup(self.prompt_tokens.__getitem__, rows) if prompt_tokens is None else prompt_tokens,
            forced_tokens=forced_tokens,
        )
        cols = self.cols[rows]
        validate_batch(
            schedule,
            cols,
            max_draft_tokens=max_draft_tokens,
            compaction_keep_tokens=compaction_keep_tokens,
            check_duplicate_ids=False,
            draft_pool=draft_pool,
        )
        for i in np.flatnonzero(schedule.is_prompt & (cols["num_prompt_logprobs"] >= 0)):
            if schedule.prompt_tokens[i] is None:
                raise ValueError(f"request {schedule.request_ids[i]!r}: params.prompt_logprobs: requested but "
                                 "the table holds no prompt_tokens (targets come from the prompt)")
        inputs = build_ledger(
            schedule, cols, max_draft_tokens=max_draft_tokens, compaction_keep_tokens=compaction_keep_tokens
        )
        # A forced token is this step's only: the steady layout is never taken from such a step.
        if compaction_keep_tokens is None and forced_tokens is None and not inputs.is_prompt.any():
            min_tokens = cols["min_tokens"].copy() if cols["min_tokens"].any() else None
            last_rows = inputs.sample_offsets + inputs.sample_counts - 1
            self._steady = _SteadyDecode(rows.tobytes(), schedule.seqlen_q.tobytes(), max_draft_tokens, min_tokens,
                                         last_rows, inputs)
        return inputs

    def check_rows(self, rows: np.ndarray) -> None:
        """Every row in range, holding a request, named once."""
        if len(rows) and (rows.min() < 0 or rows.max() >= self.capacity):
            raise ValueError(f"rows: table rows must lie in [0, {self.capacity}), got [{rows.min()}, {rows.max()}]")
        # Duplicate rows: write each row's batch position; a row named twice
        # keeps only its later position, so the earlier one reads back wrong.
        positions = np.arange(len(rows), dtype=np.int32)
        self._batch_position[rows] = positions
        dup = np.flatnonzero(self._batch_position[rows] != positions)
        if len(dup):
            raise ValueError(f"request {self.request_ids[rows[dup[0]]]!r}: request_id appears twice in one batch")
        empty = np.flatnonzero(~self.occupied[rows])
        if len(empty):
            raise ValueError(f"rows: table row {rows[empty[0]]} holds no request")

    def _steady_ledger(
        self,
        steady: _SteadyDecode,
        rows: np.ndarray,
        seqlen_q: np.ndarray,
        seqlen_k: np.ndarray,
        mtp_read_slot: np.ndarray | None,
    ) -> SamplerInputs:
        """Steady-state decode: the same requests, in the same order, with the
        same draft counts as the last all-decode step. The row layout (sample
        rows, row_to_req, local_step, offsets), the parameter arrays and every
        validation outcome are unchanged (a request's parameter columns and
        write slot change only through add / update / remove /
        set_step_columns, which drop this cache; record_emitted moves only
        num_generated); only what depends on positions, generated counts and
        read slots is recomputed."""
        prev = steady.inputs
        # A shallow copy: parameter arrays and row layout carry over unchanged.
        inputs = object.__new__(SamplerInputs)
        inputs.__dict__.update(prev.__dict__)
        positions = np.subtract(seqlen_k, seqlen_q, dtype=np.int64)
        positions += 1
        inputs.sample_positions = positions
        if steady.min_tokens is not None:
            tokens_short = steady.min_tokens - self.cols["num_generated"][rows]
            inputs.eos_suppression_rows = suppression_rows(prev.local_step, prev.row_to_req, tokens_short)
        else:
            inputs.eos_suppression_rows = _NO_ROWS  # no request in the batch has min_tokens
        k = steady.max_draft_tokens
        if k:
            read = np.zeros(len(rows), np.int32) if mtp_read_slot is None else mtp_read_slot
            inputs.mtp_info_read_rows = draft_read_rows(read, k, prev.row_to_req, prev.local_step, steady.last_rows)
        return inputs


@dataclass(frozen=True)
class _SteadyDecode:
    """The last all-decode step's layout, reused while the batch is unchanged."""

    rows: bytes  # the batch's table rows, as bytes (rows keep their dtype step to step)
    seqlen_q: bytes  # int32 bytes
    max_draft_tokens: int
    min_tokens: np.ndarray | None  # per request, None when all are 0
    last_rows: np.ndarray  # [n] each request's last sample row (it verifies no draft)
    inputs: SamplerInputs


_NO_ROWS = np.zeros(0, dtype=np.int32)
_NO_ROWS.flags.writeable = False


class LazyLookup:
    """Per request of a batch, `fetch(keys[i])`, looked up only when indexed
    (only prompt-logprob rows read prompt tokens)."""

    __slots__ = ("_fetch", "_keys")

    def __init__(self, fetch: Callable[[object], object], keys: Sequence):
        self._fetch, self._keys = fetch, keys

    def __getitem__(self, i: int) -> object:
        return self._fetch(self._keys[i])

    def __len__(self) -> int:
        return len(self._keys)

