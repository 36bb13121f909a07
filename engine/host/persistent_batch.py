"""The persistent batch: per-request state kept between steps (docs/contract.md §5).

Requests get a row of the columnar `RequestTable` when they join and give it
back when they leave; a step names its requests by table row and gathers every
column in one fancy-index per dtype group. Nothing per step is rebuilt from
Python objects.

- `PersistentBatch` is the embedding API over one `StepEngine`: add, update
  and remove requests; per step say which run, with how many query tokens,
  context length and drafts, and get what `engine.run` needs.
- `SeqMetaFront` is what `StepEngine.step(hidden, seqs)` runs on: a table
  keyed by request id that takes `SeqMeta` lists, adding a request the first
  time it appears and rewriting its parameter columns only when its
  `SamplingParams` object changes.
- `DraftSlots` owns the draft-info pool's slot numbers and the take-once read
  rule of docs/contract.md §1.3.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Callable, Hashable, Sequence

import numpy as np

from engine.host.columns import Columns
from engine.host.control_slots import ControlHook, NoControls
from engine.host.ledger import (
    SamplerInputs,
    StepSchedule,
    build_ledger,
    draft_read_rows,
    prepare_sampler_inputs,
    suppression_rows,
    validate_batch,
)
from engine.host.params import SamplingParams, SeqMeta
from engine.host.token_constraints import TokenConstraint, TokenConstraints

if TYPE_CHECKING:
    from engine import EngineConfig, StepEngine, StepOutput
    from engine.step.staging import StepArrays

# (request_id, params) -> [max_stop_ids] int64, -1 padded; raises ValueError naming the request.
StopIdRule = Callable[[Hashable, SamplingParams], np.ndarray]


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

    def read_slots(self, write_slots: np.ndarray, is_decode: np.ndarray) -> np.ndarray:
        """Per request: its write slot if it holds fresh draft info and the
        request decodes this step, else 0. Consumes nothing (see `consume`)."""
        return np.multiply(write_slots, self.fresh[write_slots] & is_decode, dtype=np.int32)

    def consume(self, read_slots: np.ndarray) -> None:
        """The step that read these slots went through: they are no longer fresh."""
        self.fresh[read_slots] = False
        self.fresh[0] = False

    def take_read_slots(self, write_slots: np.ndarray, is_decode: np.ndarray) -> np.ndarray:
        """`read_slots`, consumed at once."""
        read = self.read_slots(write_slots, is_decode)
        self.consume(read)
        return read

    def mark_written(self, slots: np.ndarray) -> None:
        """After a decode step's draft head wrote these slots (0 = no write)."""
        self.fresh[slots] = True
        self.fresh[0] = False


class RequestTable:
    """Columns for up to `capacity` live requests, plus their prompt tokens,
    `SamplingParams` and (with a `stop_ids_for` rule) stop ids, by table row."""

    def __init__(
        self,
        capacity: int,
        *,
        seed_base: int = 0,
        stop_ids_for: StopIdRule | None = None,
        max_stop_ids: int = 0,
        controls: ControlHook | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: must be >= 1")
        self.capacity = capacity
        self.seed_base = seed_base
        self.stop_ids_for = stop_ids_for
        self.cols = Columns.empty(capacity)
        self.prompt_tokens: list[np.ndarray | None] = [None] * capacity
        self.params: list[SamplingParams | None] = [None] * capacity
        self.stop_ids = np.full((capacity, max_stop_ids), -1, dtype=np.int64)  # [capacity, max_stop_ids]
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
        return None if self.stop_ids_for is None else self.stop_ids_for(request_id, params)

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
            prompt_tokens=_Lazy(self.prompt_tokens.__getitem__, rows) if prompt_tokens is None else prompt_tokens,
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


class _Lazy:
    """Per request of a batch, `fetch(keys[i])`, looked up only when indexed
    (only prompt-logprob rows read prompt tokens)."""

    __slots__ = ("_fetch", "_keys")

    def __init__(self, fetch: Callable[[object], object], keys: Sequence):
        self._fetch, self._keys = fetch, keys

    def __getitem__(self, i: int) -> object:
        return self._fetch(self._keys[i])

    def __len__(self) -> int:
        return len(self._keys)


def _engine_table(engine: StepEngine, capacity: int) -> tuple[RequestTable, dict]:
    """A request table that computes the engine's stop ids, and the ledger
    options of the engine's config."""
    config: EngineConfig = engine.config
    table = RequestTable(capacity, seed_base=config.seed_base, stop_ids_for=engine.stop_ids_for,
                         max_stop_ids=config.max_stop_ids, controls=engine.control_hook)
    options = dict(max_draft_tokens=config.max_draft_tokens, compaction_keep_tokens=config.compaction_keep_tokens,
                   draft_pool=config.draft_pool)
    return table, options


@dataclass(frozen=True)
class BatchStep:
    """One prepared step: `engine.run(hidden, step.inputs, step.arrays)`."""

    rows: np.ndarray  # [n] table rows, batch order
    inputs: SamplerInputs
    arrays: StepArrays
    read_slots: np.ndarray | None  # [n] draft-info slots read (0 = padding), None without a pool


class PersistentBatch:
    """Requests that live across the steps of one `StepEngine`.

    Per request: `add` (prompt tokens and `SamplingParams`), `update` (new
    parameters), `remove`. Per step: `prepare(request_ids, seqlen_q,
    seqlen_k)` (or `prepare_rows` by table row) gives the ledger and staged
    arrays `engine.run` takes; `record(step, out)` then counts what each
    request emitted. A request with no generated token yet is in prefill
    (`seqlen_k` = prompt tokens in the cache after the step, at most the
    prompt length); after that it decodes (`seqlen_k = prompt_len +
    generated + drafts`, `seqlen_q = 1 + drafts`).

    Drafts: `draft_tokens` per step (an `[n, >= drafts]` int array or one
    list per request). With a draft-info pool (`EngineConfig.max_draft_tokens
    > 0` and `draft_pool_slots != 1`) every request also holds a pool slot:
    a decode whose drafts are not given reads what a draft head wrote there
    last step (`next_drafts=`), at most once.

    Token constraints (docs/contract.md §2): a request with `bad_words`, or
    with structured output (`json_schema` / `regex` / `grammar`, which needs
    the `tokenizer` the model's vocabulary comes from), gets its per-row token
    bitmask built in `prepare` (drafts included) and its state advanced in
    `record`; `set_generated` rolls it back with the counts.
    """

    def __init__(self, engine: StepEngine, capacity: int | None = None, *, tokenizer: object | None = None):
        config = engine.config
        self.engine = engine
        self.table, self.ledger_options = _engine_table(engine, capacity or config.max_num_reqs)
        self.draft_slots = DraftSlots(config.pool_slots) if config.draft_pool else None
        self._rows_in_range = b""  # the last rows (as bytes) found in range and holding requests
        # Per table row: its token constraint (bad words, structured output), if any.
        self.constraints = TokenConstraints(engine.vocab_size, tokenizer, config.eos_token_id)
        self._constrained = np.zeros(self.table.capacity, dtype=bool)

    def __len__(self) -> int:
        return len(self.table)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self.table.row_of

    def add(self, request_id: Hashable, prompt_tokens: Sequence[int], params: SamplingParams | None = None) -> int:
        """Take a row (returned) for a new request; its stop ids are the
        engine's (EOS, even with ignore_eos, plus params.stop_token_ids).
        **Raises** ValueError naming the request and the field (nothing is
        written), RuntimeError when the batch or the draft-info pool is full."""
        params = SamplingParams() if params is None else params
        if prompt_tokens is None:
            raise ValueError(f"request {request_id!r}: prompt_tokens=None: the batch needs the prompt")
        if request_id in self.table.row_of:
            raise ValueError(f"request {request_id!r}: request_id is already in the table")
        constraint = self.check_constraints(request_id, params)
        if self.draft_slots is None or len(self.table) == self.table.capacity:
            row = self.table.add(request_id, params, prompt_tokens)  # a full table raises before a slot is taken
        else:
            slot = self.draft_slots.allocate()
            try:
                row = self.table.add(request_id, params, prompt_tokens, mtp_write_slot=slot)
            except BaseException:
                self.draft_slots.release(slot)
                raise
        if constraint is not None:
            self.constraints.of[row] = constraint
            self._constrained[row] = True
        return row

    def check_constraints(self, request_id: Hashable, params: SamplingParams) -> TokenConstraint | None:
        """The token constraint `params` asks for (None: none), every check run:
        bad words inside the vocabulary, the structured-output spec compiled
        (cached by kind and text), a tokenizer present. **Raises** ValueError
        naming the request, the field and the value; changes nothing."""
        return self.constraints.make(request_id, params)

    def update(self, request_id: Hashable, params: SamplingParams) -> None:
        """New sampling parameters for a request in the batch (validated first).
        Its bad words and structured output cannot change."""
        row = self.table.row(request_id)
        old = self.table.params[row]
        if (old.bad_words, old.structured) != (params.bad_words, params.structured):
            field = "bad_words" if old.bad_words != params.bad_words else (params.structured or old.structured)[0]
            raise ValueError(f"request {request_id!r}: params.{field}: a request's token constraints are fixed "
                             "when it is added (remove and add it again)")
        self.table.update(request_id, params)

    def check_controls(self, request_id: Hashable, params: SamplingParams) -> None:
        """ValueError naming the request, the field and the value when the engine
        cannot honour the request's sampling controls (none allocated, over a
        cap, a token outside the vocabulary); changes nothing."""
        self.table.controls.check_params(request_id, params)

    def remove(self, request_id: Hashable) -> None:
        """Free the request's row (and its draft-info slot and token constraint)."""
        row = self.table.row(request_id)
        slot = int(self.table.cols.mtp_write_slot[row])
        self.table.remove(request_id)
        self.constraints.of.pop(row, None)
        self._constrained[row] = False
        self._rows_in_range = b""
        if self.draft_slots is not None:
            self.draft_slots.release(slot)

    def rows_of(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """[n] int64 table rows of `request_ids`."""
        row = self.table.row
        return np.fromiter(map(row, request_ids), dtype=np.int64, count=len(request_ids))

    def prepare(self, request_ids: Sequence[Hashable], seqlen_q: Sequence[int], seqlen_k: Sequence[int],
                **drafts: object) -> BatchStep:
        """`prepare_rows` by request id."""
        return self.prepare_rows(self.rows_of(request_ids), seqlen_q, seqlen_k, **drafts)

    def prepare_rows(
        self,
        rows: np.ndarray,
        seqlen_q: Sequence[int] | np.ndarray,
        seqlen_k: Sequence[int] | np.ndarray,
        *,
        draft_tokens: Sequence[Sequence[int] | None] | np.ndarray | None = None,
        draft_logprobs: Sequence[object] | None = None,
        next_drafts: Sequence[Sequence[int] | None] | None = None,
        next_draft_logprobs: Sequence[Sequence[float] | None] | None = None,
    ) -> BatchStep:
        """The step of the requests at table rows `rows` (batch order), each
        with `seqlen_q` query tokens and context length `seqlen_k` after the
        step. The draft arguments are those of `StepEngine.step_arrays`.
        **Raises** ValueError naming the request, the field and the value."""
        table = self.table
        rows = np.asarray(rows)
        if rows.tobytes() != self._rows_in_range:
            if rows.dtype.kind not in "iu" or rows.ndim != 1:
                raise ValueError(f"rows: expected a 1-D array of int table rows, got {rows.dtype} shape {rows.shape}")
            if len(rows) and (rows.min() < 0 or rows.max() >= table.capacity or not table.occupied[rows].all()):
                table.check_rows(rows)  # raises naming the row; the ledger checks for duplicates
            self._rows_in_range = rows.tobytes()
        q, k = _counts("seqlen_q", seqlen_q, len(rows)), _counts("seqlen_k", seqlen_k, len(rows))
        prompt_len, generated = table.cols.prompt_len[rows], table.cols.num_generated[rows]
        is_prompt = generated == 0
        # The steady state, all decodes: seqlen_k = prompt_len + generated + seqlen_q - 1 is the whole check.
        if is_prompt.any() or q.min(initial=1) < 1 or (k - q != prompt_len + generated - 1).any():
            self._check_lengths(rows, is_prompt, q, k, prompt_len, generated)
        read = None
        if self.draft_slots is not None:
            read = self.draft_slots.read_slots(table.cols.mtp_write_slot[rows], ~is_prompt)
        inputs = table.ledger(rows, is_prompt, q, k, read, **self.ledger_options)
        arrays = self.engine.step_arrays(inputs, table.stop_ids_of(rows), draft_tokens=draft_tokens,
                                         draft_logprobs=draft_logprobs, next_drafts=next_drafts,
                                         next_draft_logprobs=next_draft_logprobs)
        arrays.control_slots = table.control_slots_of(rows, inputs)
        constrained = np.flatnonzero(self._constrained[rows])
        if len(constrained):
            arrays.token_bitmask = self._token_bitmask(rows, constrained, inputs, arrays)
        return BatchStep(rows, inputs, arrays, read)

    def _token_bitmask(self, rows: np.ndarray, constrained: np.ndarray, inputs: SamplerInputs,
                       arrays: StepArrays) -> np.ndarray | None:
        """[sample rows, words] int32: the constrained requests' rows filled in
        (row j with drafts 0..j-1 taken as accepted), the others all ones.
        None when no sample row of the step is restricted (a prompt chunk
        that is not the last throws its token away)."""
        wanted = [i for i in constrained if not inputs.is_prompt[i] or inputs.is_last_chunk[i]]
        if not wanted:
            return None
        for i in wanted:
            first, count = int(inputs.sample_offsets[i]), int(inputs.sample_counts[i])
            # A negative draft is one the graph reads from the draft-info pool.
            if count > 1 and (arrays.row_drafts[first : first + count - 1] < 0).any():
                raise ValueError(f"request {inputs.request_ids[i]!r}: token constraints need the drafts on the host: "
                                 "pass draft_tokens (drafts read from the draft-info pool are not seen here)")
        mask = np.full((inputs.num_sample_rows, self.constraints.words), -1, dtype=np.int32)
        for i in wanted:
            first, count = int(inputs.sample_offsets[i]), int(inputs.sample_counts[i])
            drafts = arrays.row_drafts[first : first + count - 1] if count > 1 else ()
            self.constraints.of[int(rows[i])].fill(mask[first : first + count], drafts)
        return mask

    def _check_lengths(self, rows: np.ndarray, is_prompt: np.ndarray, seqlen_q: np.ndarray, seqlen_k: np.ndarray,
                       prompt_len: np.ndarray, generated: np.ndarray) -> None:
        """docs/contract.md §1: what `SeqMeta` checks per request, over the batch at once."""
        drafts = seqlen_q - 1
        decode_k = prompt_len + generated + drafts  # >= seqlen_q, as prompt_len and generated are >= 1
        bad = (seqlen_q < 1) | np.where(is_prompt, (seqlen_k > prompt_len) | (seqlen_k < seqlen_q), seqlen_k != decode_k)
        if not bad.any():
            return
        i = int(np.flatnonzero(bad)[0])
        where = f"request {self.table.request_ids[rows[i]]!r}"
        if seqlen_q[i] < 1:
            raise ValueError(f"{where}: seqlen_q={seqlen_q[i]}: must be >= 1")
        if seqlen_k[i] < seqlen_q[i]:
            raise ValueError(f"{where}: seqlen_k={seqlen_k[i]}: is smaller than seqlen_q={seqlen_q[i]}")
        if is_prompt[i]:
            raise ValueError(f"{where}: seqlen_k={seqlen_k[i]}: a prompt chunk reaches past prompt_len={prompt_len[i]} "
                             "(no token generated yet; `record` each step's output)")
        raise ValueError(f"{where}: seqlen_k={seqlen_k[i]}: a decode step has seqlen_k == prompt_len + generated + "
                         f"drafts = {prompt_len[i]} + {generated[i]} + {drafts[i]} = {decode_k[i]}")

    def record(self, step: BatchStep, out: StepOutput) -> None:
        """After `engine.run(...)` returned `out` for `step`: each request
        generated `len(out.tokens[i])` more tokens, and the pool slots the
        step wrote hold fresh draft info (the ones it read are consumed)."""
        emitted = np.fromiter(map(len, out.tokens), dtype=np.int32, count=len(out.tokens))
        self.table.record_emitted(step.rows, emitted)
        for i in np.flatnonzero(self._constrained[step.rows]):
            self.constraints.of[int(step.rows[i])].advance(out.tokens[i])
        if self.draft_slots is not None:
            self.draft_slots.consume(step.read_slots)
            self.draft_slots.mark_written(step.inputs.mtp_info_write_slots)

    def set_generated(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Set the generated-token counts of table rows (undoing a step the caller
        rolled back); their token constraints go back to the state after as many tokens."""
        self.table.set_generated(rows, counts)
        for i in np.flatnonzero(self._constrained[rows]):
            self.constraints.of[int(rows[i])].rollback_to(int(counts[i]))


def _counts(name: str, values: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """[n] int32 from integer counts."""
    array = np.asarray(values)
    if array.shape != (n,) or (n and array.dtype.kind not in "iu"):
        raise ValueError(f"{name}: expected {n} int counts (one per request), got {array.dtype} shape {array.shape}")
    return array.astype(np.int32, copy=False)


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

    def __init__(self, engine: StepEngine, capacity: int):
        self.engine = engine
        self._reset(capacity)

    def _reset(self, capacity: int) -> None:
        if hasattr(self, "table"):  # a larger table replaces this one: its control slots go back
            for request_id in list(self.table.row_of):
                self.table.remove(request_id)
        self.table, self.ledger_options = _engine_table(self.engine, capacity)
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
            return (prepare_sampler_inputs(seqs, seed_base=self.table.seed_base, **self.ledger_options),
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
        if self.ledger_options["max_draft_tokens"]:
            read_slot, write_slot = (np.fromiter(map(get, seqs), np.int32, n) for get in _SLOTS)
        prompt_len = np.fromiter(map(_PROMPT_LEN, seqs), np.int32, n) if is_prompt.any() else None
        table.set_step_columns(rows, num_generated=generated, mtp_write_slot=write_slot, prompt_len=prompt_len)
        forced = list(map(_FORCED_TOKEN, seqs))
        forced_tokens = None if forced.count(None) == n else np.array([-1 if t is None else t for t in forced], np.int64)
        inputs = table.ledger(rows, is_prompt, seqlen_q, seqlen_k, read_slot, forced_tokens=forced_tokens,
                              prompt_tokens=_Lazy(attrgetter("prompt_tokens"), seqs), **self.ledger_options)
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
