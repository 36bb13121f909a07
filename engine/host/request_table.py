"""The request table: per-request state kept between steps (docs/contract.md §5).

Requests get a row of the columnar `RequestTable` when they join and give it
back when they leave; a step names its requests by table row and gathers every
column in one fancy-index per dtype group. Nothing per step is rebuilt from
Python objects. The embedding API over it (`PersistentBatch`) and the table
behind `StepEngine.step(hidden, seqs)` (`SeqMetaFront`) are the step's
(engine/step/batch.py, engine/step/seq_front.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from engine.host.columns import Columns
from engine.host.control_slots import ControlHook, NoControls
from engine.host.ledger import (
    SamplerInputs,
    StepSchedule,
    build_ledger,
    draft_read_rows,
    suppression_rows,
    validate_batch,
)
from engine.host.params import SamplingParams, SeqMeta
from engine.host.stop_ids import StopIds

class RequestTable:
    """Columns for up to `capacity` live requests, plus their prompt tokens,
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
        self.cols = Columns.empty(capacity)
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
        row = self._free.pop()
        self._write(row, seq, stop_ids)
        self.control_slot[row] = self.controls.join(params, prompt_tokens) if needs_slot else 0
        self.prompt_tokens[row] = None if prompt_tokens is None else np.asarray(prompt_tokens, dtype=np.int32)
        self.request_ids[row] = request_id
        self.occupied[row] = True
        self.row_of[request_id] = row
        return row

    def update(self, request_id: Hashable, params: SamplingParams) -> None:
        """New sampling parameters (and stop ids) for a request in the table;
        validated first, nothing is written when that fails."""
        row = self.row(request_id)
        cols = self.cols
        seq = self._checked(request_id, params, int(cols.prompt_len[row]), int(cols.num_generated[row]),
                            int(cols.mtp_write_slot[row]))
        stop_ids = self._stop_ids(request_id, params)
        slot = int(self.control_slot[row])
        needs_slot = self.controls.check(request_id, params, self.prompt_tokens[row], int(cols.num_generated[row]),
                                         slot > 0)
        self._write(row, seq, stop_ids)
        if needs_slot and slot:
            self.controls.rewrite(slot, params)
        elif needs_slot:
            self.control_slot[row] = self.controls.join(params, self.prompt_tokens[row])
        elif slot:
            self.controls.leave(slot)
            self.control_slot[row] = 0

    def remove(self, request_id: Hashable) -> None:
        row = self.row_of.pop(request_id)
        self._steady = None
        if self.control_slot[row]:
            self.controls.leave(int(self.control_slot[row]))
            self.control_slot[row] = 0
        self.cols.fill_neutral(np.array([row]))
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
        self.cols.write_row(row, seq, self.seed_base)
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

    def record_emitted(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Advance num_generated after a step emitted `counts` tokens per row."""
        self.cols.add_at("num_generated", rows, counts)

    def set_generated(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Set num_generated (a caller putting back what a failed step changed)."""
        self.cols.num_generated[rows] = counts

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
        cols.num_generated[rows] = num_generated
        if mtp_write_slot is not None:
            if self._steady is not None and (cols.mtp_write_slot[rows] != mtp_write_slot).any():
                self._steady = None
            cols.mtp_write_slot[rows] = mtp_write_slot
        if prompt_len is not None:
            cols.prompt_len[rows] = prompt_len

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
        cols = self.cols.take(rows)
        validate_batch(
            schedule,
            cols,
            max_draft_tokens=max_draft_tokens,
            compaction_keep_tokens=compaction_keep_tokens,
            check_duplicate_ids=False,
            draft_pool=draft_pool,
        )
        for i in np.flatnonzero(schedule.is_prompt & (cols.num_prompt_logprobs >= 0)):
            if schedule.prompt_tokens[i] is None:
                raise ValueError(f"request {schedule.request_ids[i]!r}: params.prompt_logprobs: requested but "
                                 "the table holds no prompt_tokens (targets come from the prompt)")
        inputs = build_ledger(
            schedule, cols, max_draft_tokens=max_draft_tokens, compaction_keep_tokens=compaction_keep_tokens
        )
        # A forced token is this step's only: the steady layout is never taken from such a step.
        if compaction_keep_tokens is None and forced_tokens is None and not inputs.is_prompt.any():
            min_tokens = cols.min_tokens.copy() if cols.min_tokens.any() else None
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
            tokens_short = steady.min_tokens - self.cols.num_generated[rows]
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

