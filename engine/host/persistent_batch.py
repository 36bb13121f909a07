"""Persistent columnar per-request state (docs/contract.md §5).

Requests get a row of the table when they join and give it back when they
leave; a step names its requests by table row and gathers every column in one
fancy-index per dtype group. Nothing per step is rebuilt from Python objects.

`DraftSlots` owns the draft-info pool's slot numbers and the take-once read
rule of docs/contract.md §1.3.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from engine.host.columns import Columns
from engine.host.ledger import SamplerInputs, StepSchedule, build_ledger, draft_read_rows, suppression_rows, validate_batch
from engine.host.params import SamplingParams, SeqMeta


class DraftSlots:
    """Slot numbers of the draft-info pool; slot 0 is padding and never handed out.

    A slot is *fresh* after a decode step wrote draft info into it. Taking a
    read slot returns the slot if fresh, else 0, and marks it consumed, so a
    request never verifies the same drafts twice. A new request, one
    preempted and recomputed, or one just out of prefill holds no fresh slot
    and reads padding.
    """

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: need slot 0 (padding) and at least one real slot")
        self.num_slots = num_slots
        self.fresh = np.zeros(num_slots, dtype=bool)
        self._free = list(range(num_slots - 1, 0, -1))

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"draft-info pool exhausted: all {self.num_slots - 1} slots are in use")
        slot = self._free.pop()
        self.fresh[slot] = False
        return slot

    def release(self, slot: int) -> None:
        if not 1 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot={slot}: not an allocated draft-info slot")
        self.fresh[slot] = False
        self._free.append(slot)

    def take_read_slots(self, write_slots: np.ndarray, is_decode: np.ndarray) -> np.ndarray:
        """Per request: its write slot if it holds fresh draft info and the
        request decodes this step, else 0. Consumes what it returns."""
        read = np.where(is_decode & self.fresh[write_slots], write_slots, 0).astype(np.int32)
        self.fresh[read] = False
        self.fresh[0] = False
        return read

    def mark_written(self, slots: np.ndarray) -> None:
        """After a decode step's draft head wrote these slots (0 = no write)."""
        self.fresh[slots] = True
        self.fresh[0] = False


class RequestTable:
    """Columns for up to `capacity` live requests plus their prompt tokens."""

    def __init__(self, capacity: int, *, seed_base: int = 0):
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: must be >= 1")
        self.capacity = capacity
        self.seed_base = seed_base
        self.cols = Columns.empty(capacity)
        self.prompt_tokens: list[np.ndarray | None] = [None] * capacity
        self.request_ids = np.full(capacity, None, dtype=object)  # fancy-indexed per step
        self._batch_position = np.zeros(capacity, dtype=np.int32)  # scratch for the duplicate check
        self.row_of: dict[Hashable, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._steady: _SteadyDecode | None = None  # see _steady_ledger

    def __len__(self) -> int:
        return len(self.row_of)

    def add(
        self,
        request_id: Hashable,
        params: SamplingParams,
        prompt_tokens: Sequence[int],
        *,
        mtp_write_slot: int = 0,
    ) -> int:
        """Validate, then take a row. Nothing is written when validation fails."""
        if request_id in self.row_of:
            raise ValueError(f"request {request_id!r}: request_id is already in the table")
        if not self._free:
            raise RuntimeError(f"request {request_id!r}: request table is full ({self.capacity} rows)")
        tokens = np.asarray(prompt_tokens, dtype=np.int64)
        seq = SeqMeta(
            request_id,
            is_prompt=True,
            seqlen_q=max(len(tokens), 1),
            seqlen_k=max(len(tokens), 1),
            prompt_len=len(tokens),
            prompt_tokens=tokens,
            params=params,
            mtp_write_slot=mtp_write_slot,
        )
        row = self._free.pop()
        self._steady = None
        self.cols.write_row(row, seq, self.seed_base)
        self.prompt_tokens[row] = tokens.astype(np.int32)
        self.request_ids[row] = request_id
        self.row_of[request_id] = row
        return row

    def remove(self, request_id: Hashable) -> None:
        row = self.row_of.pop(request_id)
        self._steady = None
        self.cols.fill_neutral(np.array([row]))
        self.prompt_tokens[row] = None
        self.request_ids[row] = None
        self._free.append(row)

    def record_emitted(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Advance num_generated after a step emitted `counts` tokens per row."""
        self.cols.add_at("num_generated", rows, counts)

    def set_generated(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Set num_generated (the decode loop putting back what a failed step changed)."""
        self.cols.num_generated[rows] = counts

    def schedule(
        self,
        rows: np.ndarray,
        is_prompt: np.ndarray,
        seqlen_q: np.ndarray,
        seqlen_k: np.ndarray,
        mtp_read_slot: np.ndarray | None = None,
    ) -> tuple[StepSchedule, Columns]:
        """The step's schedule and its requests' columns, in batch order."""
        n = len(rows)
        return (
            StepSchedule(
                request_ids=self.request_ids[rows].tolist(),
                is_prompt=np.asarray(is_prompt, dtype=bool),
                seqlen_q=np.asarray(seqlen_q, dtype=np.int32),
                seqlen_k=np.asarray(seqlen_k, dtype=np.int32),
                mtp_read_slot=np.zeros(n, np.int32) if mtp_read_slot is None else mtp_read_slot,
                prompt_tokens=_LazyRows(self.prompt_tokens, rows),
            ),
            self.cols.take(rows),
        )

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
    ) -> SamplerInputs:
        """Validate and build the step's ledger from table rows."""
        rows = np.asarray(rows)
        steady = self._steady
        if (
            steady is not None
            and steady.max_draft_tokens == max_draft_tokens
            and compaction_keep_tokens is None
            # Byte comparisons: a few hundred ns where np.array_equal costs µs.
            and rows.tobytes() == steady.rows
            and np.asarray(seqlen_q, dtype=np.int32).tobytes() == steady.seqlen_q
            and not np.any(is_prompt)
        ):
            return self._steady_ledger(steady, rows, seqlen_q, seqlen_k, mtp_read_slot)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.capacity):
            raise ValueError(f"rows: table rows must lie in [0, {self.capacity}), got [{rows.min()}, {rows.max()}]")
        # Duplicate rows: write each row's batch position; a row named twice
        # keeps only its later position, so the earlier one reads back wrong.
        positions = np.arange(len(rows), dtype=np.int32)
        self._batch_position[rows] = positions
        dup = np.flatnonzero(self._batch_position[rows] != positions)
        if len(dup):
            raise ValueError(f"request {self.request_ids[rows[dup[0]]]!r}: scheduled twice in one batch")
        schedule, cols = self.schedule(rows, is_prompt, seqlen_q, seqlen_k, mtp_read_slot)
        if None in schedule.request_ids:
            free = rows[[i for i, r in enumerate(schedule.request_ids) if r is None][0]]
            raise ValueError(f"rows: table row {free} holds no request")
        validate_batch(
            schedule,
            cols,
            max_draft_tokens=max_draft_tokens,
            compaction_keep_tokens=compaction_keep_tokens,
            check_duplicate_ids=False,
        )
        inputs = build_ledger(
            schedule, cols, max_draft_tokens=max_draft_tokens, compaction_keep_tokens=compaction_keep_tokens
        )
        if compaction_keep_tokens is None and not inputs.is_prompt.any():
            min_tokens = cols.min_tokens.copy() if cols.min_tokens.any() else None
            self._steady = _SteadyDecode(rows.tobytes(), schedule.seqlen_q.tobytes(), max_draft_tokens, min_tokens, inputs)
        return inputs

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
        validation outcome are unchanged (a request's columns change only
        through add / remove, which drop this cache, and record_emitted, which
        moves num_generated); only what depends on positions, generated counts
        and read slots is recomputed."""
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
            last_rows = prev.sample_offsets + prev.sample_counts - 1
            inputs.mtp_info_read_rows = draft_read_rows(read, k, prev.row_to_req, prev.local_step, last_rows)
        return inputs


@dataclass(frozen=True)
class _SteadyDecode:
    """The last all-decode step's layout, reused while the batch is unchanged."""

    rows: bytes  # the batch's table rows, as bytes (rows keep their dtype step to step)
    seqlen_q: bytes  # int32 bytes
    max_draft_tokens: int
    min_tokens: np.ndarray | None  # per request, None when all are 0
    inputs: SamplerInputs


_NO_ROWS = np.zeros(0, dtype=np.int32)
_NO_ROWS.flags.writeable = False


class _LazyRows:
    """Prompt tokens of the batch's requests, looked up only when indexed
    (only prompt-logprob rows read them)."""

    __slots__ = ("_store", "_rows")

    def __init__(self, store: list, rows: np.ndarray):
        self._store, self._rows = store, rows

    def __getitem__(self, i: int) -> np.ndarray | None:
        return self._store[self._rows[i]]

    def __len__(self) -> int:
        return len(self._rows)
