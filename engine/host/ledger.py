"""The row ledger (docs/contract.md §1): which model-output rows are sampled, which feed
prompt logprobs, at which positions, with which parameters, and which
draft-info rows are read and written.

One vectorised walk over the batch (cumsum / repeat over columns), no Python
loop over requests except to fetch prompt-logprob targets. The plain
per-request loop that mirrors docs/contract.md §1 line by line lives in
tests/ledger_reference.py and is the oracle for this one.

Cursors, in array form:
- out_offset   : first model-output row of each request (the output cursor)
- query_offset : first query token of each request (differs from out_offset
                 under prefill compaction, §1.4)
- sample_offset, prompt_offset : write cursors of sample and prompt rows
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Hashable, Protocol, Sequence

import numpy as np

from engine.host.param_records import derive_seeds
from engine.host.params import SEQ_RECORD, SeqMeta
from engine.host.step_fields import PARAM_FIELDS


class PreparedStep(Protocol):
    """What `engine.run` asks of a step a persistent batch prepared (`PreparedRows` of
    engine/host/request_table.py): is it still current, and that it ran."""

    def check(self, *, ran: bool = False) -> None: ...

    def mark_run(self) -> None: ...


_LEDGER_RECORD = attrgetter("ledger_record")
_REQUEST_ID = attrgetter("request_id")


class LedgerInvariantError(RuntimeError):
    """A §1.5 invariant failed after the walk: a bug in the ledger, never clipped."""


@dataclass(frozen=True)
class StepSchedule:
    """What the scheduler decided for one step, one entry per request in batch order."""

    request_ids: Sequence[Hashable]
    is_prompt: np.ndarray  # [n] bool
    seqlen_q: np.ndarray  # [n] int32
    seqlen_k: np.ndarray  # [n] int32
    mtp_read_slot: np.ndarray  # [n] int32, after the take-once rule
    prompt_tokens: Sequence[np.ndarray | None]  # per request, only read for prompt-logprob targets
    forced_tokens: np.ndarray | None = None  # [n] int64, -1 = none; None: no request has one

    @classmethod
    def from_records(
        cls, records: np.ndarray, request_ids: Sequence[Hashable], seqs: Sequence[SeqMeta]
    ) -> StepSchedule:
        """From the batch's SeqMeta records (`SEQ_RECORD`, writable): the columns are views
        into them; prompt tokens are read from `seqs` only where prompt-logprob targets need them."""
        forced = records["forced_token"]
        return cls(
            request_ids=request_ids,
            is_prompt=records["is_prompt"],
            seqlen_q=records["seqlen_q"],
            seqlen_k=records["seqlen_k"],
            mtp_read_slot=records["mtp_read_slot"],
            prompt_tokens=_PromptTokens(seqs),
            forced_tokens=forced if (forced >= 0).any() else None,
        )

    @classmethod
    def from_seqs(cls, seqs: Sequence[SeqMeta]) -> StepSchedule:
        forced = [s.forced_token for s in seqs]
        return cls(
            request_ids=[s.request_id for s in seqs],
            is_prompt=np.fromiter((s.is_prompt for s in seqs), dtype=bool, count=len(seqs)),
            seqlen_q=np.fromiter((s.seqlen_q for s in seqs), dtype=np.int32, count=len(seqs)),
            seqlen_k=np.fromiter((s.seqlen_k for s in seqs), dtype=np.int32, count=len(seqs)),
            mtp_read_slot=np.fromiter((s.mtp_read_slot for s in seqs), dtype=np.int32, count=len(seqs)),
            prompt_tokens=[s.prompt_tokens for s in seqs],
            forced_tokens=None if forced.count(None) == len(forced) else np.array(
                [-1 if t is None else t for t in forced], dtype=np.int64),
        )


class _PromptTokens:
    """`seqs[i].prompt_tokens`, read only when indexed (only prompt-logprob rows read them)."""

    __slots__ = ("_seqs",)

    def __init__(self, seqs: Sequence[SeqMeta]):
        self._seqs = seqs

    def __getitem__(self, i: int) -> Sequence[int] | None:
        return self._seqs[i].prompt_tokens

    def __len__(self) -> int:
        return len(self._seqs)


@dataclass
class SamplerInputs:
    """The ledger's outputs (docs/contract.md §1 table) plus the per-request layout the
    engine needs to cut results back into requests. Host numpy arrays. The
    parameter arrays (`temperatures`, `top_ks`, `top_ps`, `min_ps`, `seeds`)
    are the request columns of the step-field declaration, passed through."""

    # The sampling parameters: PARAM_FIELDS of the declaration, in its order
    # (tests/test_step_fields.py holds them equal).
    temperatures: np.ndarray  # [n] float32
    top_ks: np.ndarray  # [n] int32
    top_ps: np.ndarray  # [n] float32
    min_ps: np.ndarray  # [n] float32
    seeds: np.ndarray  # [n] uint64
    selected_token_indices: np.ndarray  # [sample_rows] int32: model-output row of each sample row
    selected_prompt_indices: np.ndarray | None  # [prompt_rows] int32
    prompt_token_targets: np.ndarray | None  # [prompt_rows] int32
    sample_positions: np.ndarray  # [n] int64: position produced by the request's first sample row
    row_to_req: np.ndarray  # [sample_rows] int32
    local_step: np.ndarray  # [sample_rows] int32
    eos_suppression_rows: np.ndarray  # [<= sample_rows] int32
    mtp_first_token_positions: np.ndarray | None  # [n] int32
    mtp_seqlens_q: np.ndarray | None  # [n] int32
    mtp_info_write_slots: np.ndarray | None  # [n] int32
    mtp_info_read_rows: np.ndarray | None  # [sample_rows] int32
    # layout
    request_ids: tuple
    num_output_rows: int  # rows the model must produce (after compaction)
    out_offsets: np.ndarray  # [n] int32
    out_lens: np.ndarray  # [n] int32
    query_offsets: np.ndarray  # [n] int32
    sample_offsets: np.ndarray  # [n] int32
    sample_counts: np.ndarray  # [n] int32
    prompt_row_counts: np.ndarray  # [n] int32
    is_prompt: np.ndarray  # [n] bool
    is_last_chunk: np.ndarray  # [n] bool
    num_logprobs: np.ndarray  # [n] int32, -1 = off
    num_prompt_logprobs: np.ndarray  # [n] int32, -1 = off
    # [sample_rows] int64: a request's first sample row holds its forced token,
    # every other row -1; None when no request of the step has one.
    forced_tokens: np.ndarray | None = None
    # The table rows a persistent batch prepared this step over (None: a step of SeqMeta
    # lists); `engine.run` refuses the step once any of them changed (`PreparedRows.check`).
    prepared: PreparedStep | None = field(default=None, compare=False, repr=False)
    # Counted once, when made: the step reads them often.
    num_reqs: int = field(init=False, compare=False, repr=False)
    num_sample_rows: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.num_reqs = len(self.request_ids)
        self.num_sample_rows = len(self.selected_token_indices)

    @property
    def num_prompt_rows(self) -> int:
        return 0 if self.selected_prompt_indices is None else len(self.selected_prompt_indices)

    def __eq__(self, other: object) -> bool:  # arrays compare by value, for tests
        if not isinstance(other, SamplerInputs):
            return NotImplemented
        for f in fields(self):
            if not f.compare:
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if (a is None) != (b is None):
                return False
            if isinstance(a, np.ndarray):
                if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True


def validate_batch(
    schedule: StepSchedule,
    cols: np.ndarray,
    *,
    max_draft_tokens: int,
    compaction_keep_tokens: int | None,
    check_duplicate_ids: bool = True,
    draft_pool: bool = True,
) -> None:
    """Checks that need the step's context; raises ValueError naming the
    request, the field and the value. Vectorised: one combined mask on the
    hot path, the per-check messages only once something is wrong.
    `check_duplicate_ids=False` when the caller already proved the batch's
    requests distinct (the request table checks its row numbers).
    `draft_pool=False`: the engine has no draft-info pool (drafts come only
    from the caller), so write slots are 0 and the §1.3 rule that a running
    request's write slot is never 0 does not apply."""
    if max_draft_tokens < 0:
        raise ValueError(f"max_draft_tokens={max_draft_tokens}: must be >= 0")
    if compaction_keep_tokens is not None and compaction_keep_tokens < 1:
        raise ValueError(f"compaction_keep_tokens={compaction_keep_tokens}: must be None or >= 1")
    ids = schedule.request_ids
    if check_duplicate_ids and len(set(ids)) != len(ids):
        seen: set = set()
        dup = next(r for r in ids if r in seen or seen.add(r))
        raise ValueError(f"request {dup!r}: request_id appears twice in one batch")
    decode = ~schedule.is_prompt
    too_many_drafts = schedule.seqlen_q > max_draft_tokens + 1
    needs_write_slot = max_draft_tokens > 0 and draft_pool
    if needs_write_slot:
        too_many_drafts |= cols["mtp_write_slot"] == 0
    bad = decode & too_many_drafts
    if compaction_keep_tokens is not None:
        bad |= schedule.is_prompt & (cols["num_prompt_logprobs"] >= 0)
    if not bad.any():
        return
    checks = [
        (
            decode & (schedule.seqlen_q - 1 > max_draft_tokens),
            "seqlen_q",
            schedule.seqlen_q,
            f"verifies {{d}} drafts but max_draft_tokens={max_draft_tokens}",
        ),
        (
            decode & needs_write_slot & (cols["mtp_write_slot"] == 0),
            "mtp_write_slot",
            cols["mtp_write_slot"],
            "a running request's draft-info write slot is never 0 (slot 0 is padding)",
        ),
        (
            schedule.is_prompt & (cols["num_prompt_logprobs"] >= 0) & (compaction_keep_tokens is not None),
            "params.prompt_logprobs",
            cols["num_prompt_logprobs"],
            "prompt logprobs are not available under prefill compaction (its rows are not produced)",
        ),
    ]
    for mask, name, values, why in checks:
        hit = np.flatnonzero(mask)
        if len(hit):
            i = int(hit[0])
            raise ValueError(f"request {ids[i]!r}: {name}={values[i]}: {why.format(d=int(schedule.seqlen_q[i]) - 1)}")


_ARANGE = np.arange(4096, dtype=np.int32)


def _arange(n: int) -> np.ndarray:
    """A read-only view of 0..n-1 (int32) without allocating one per step."""
    global _ARANGE
    if n > len(_ARANGE):
        _ARANGE = np.arange(max(n, 2 * len(_ARANGE)), dtype=np.int32)
    return _ARANGE[:n]


def exclusive_cumsum(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(counts, dtype=np.int32)
    return ends - counts, ends


def suppression_rows(local_step: np.ndarray, row_to_req: np.ndarray, tokens_short: np.ndarray) -> np.ndarray:
    """Sample rows whose token would be the request's k-th generated one with
    k < min_tokens (`tokens_short` = min_tokens - num_generated per request):
    EOS and stop ids are suppressed there."""
    return np.flatnonzero(local_step < tokens_short[row_to_req]).astype(np.int32)


def draft_read_rows(
    read_slot: np.ndarray, max_draft_tokens: int, row_to_req: np.ndarray, local_step: np.ndarray, last_rows: np.ndarray
) -> np.ndarray:
    """mtp_info_read_rows (§1.3): row j < seqlen_q - 1 reads draft j of its
    request's read slot; the last row of each request (a prefill's only row)
    has no draft and reads padding row 0."""
    rows = (read_slot * max_draft_tokens)[row_to_req] + local_step
    rows[last_rows] = 0
    return rows.astype(np.int32, copy=False)


def build_ledger(
    schedule: StepSchedule,
    cols: np.ndarray,
    *,
    max_draft_tokens: int = 0,
    compaction_keep_tokens: int | None = None,
) -> SamplerInputs:
    """The vectorised walk. `cols` holds the batch's requests' records (`SEQ_RECORD`, in
    batch order; their request columns are read: lengths, counts, parameters). Call
    `validate_batch` first (prepare_sampler_inputs does).

    Every numpy call costs about a microsecond whatever the batch size, so
    the all-decode step (the steady state) skips the prefill-only work."""
    n = len(schedule.request_ids)
    is_prompt = schedule.is_prompt
    seqlen_q = schedule.seqlen_q
    seqlen_k = schedule.seqlen_k
    any_prompt = bool(is_prompt.any())
    is_last_chunk = is_prompt & (seqlen_k == cols["prompt_len"])

    # §1.4: under compaction a prefill chunk only gets rows for the tail of
    # its sequence; at least one row survives so the sample row exists.
    out_lens = seqlen_q
    if compaction_keep_tokens is not None and any_prompt:
        q_start = seqlen_k - seqlen_q
        clip = np.clip(cols["prompt_len"] - compaction_keep_tokens - q_start, 0, seqlen_q - 1)
        out_lens = np.where(is_prompt, seqlen_q - clip, seqlen_q).astype(np.int32)
    out_offsets, out_ends = exclusive_cumsum(out_lens)
    query_offsets = out_offsets if out_lens is seqlen_q else exclusive_cumsum(seqlen_q)[0]
    num_output_rows = int(out_ends[-1]) if n else 0

    # Sample rows: one per prefill chunk (its last row, even for a non-last
    # chunk whose token is discarded), every row of a decode request.
    # A prefill produces the token after the chunk (position seqlen_k); decode
    # row j produces position seqlen_k - seqlen_q + 1 + j (row r predicts r + 1).
    sample_positions = np.subtract(seqlen_k, seqlen_q, dtype=np.int64)
    sample_positions += 1
    if any_prompt:
        sample_counts = np.where(is_prompt, 1, seqlen_q).astype(np.int32)
        sample_offsets, sample_ends = exclusive_cumsum(sample_counts)
        first_sample_row = np.where(is_prompt, out_ends - 1, out_offsets)
        sample_positions = np.where(is_prompt, seqlen_k, sample_positions)
    else:
        sample_counts, sample_offsets, sample_ends, first_sample_row = seqlen_q, out_offsets, out_ends, out_offsets
    num_sample_rows = int(sample_ends[-1]) if n else 0
    row_to_req = np.repeat(_arange(n), sample_counts)
    local_step = _arange(num_sample_rows) - sample_offsets[row_to_req]
    selected_token_indices = first_sample_row[row_to_req] + local_step

    tokens_short = cols["min_tokens"] - cols["num_generated"]
    if any_prompt:
        # A non-last chunk's sample row produces no token (it is discarded), so
        # it never counts towards min_tokens and needs no suppression.
        tokens_short = np.where(is_last_chunk | ~is_prompt, tokens_short, 0)
    eos_suppression_rows = suppression_rows(local_step, row_to_req, tokens_short)

    if any_prompt:
        selected_prompt_indices, prompt_token_targets, prompt_row_counts = _prompt_rows(
            schedule, cols, out_offsets, is_last_chunk, n
        )
    else:
        selected_prompt_indices = prompt_token_targets = None
        prompt_row_counts = np.zeros(n, np.int32)

    mtp_first = mtp_seqlens = mtp_write = mtp_read = None
    if max_draft_tokens > 0:
        mtp_first = first_sample_row
        mtp_seqlens = sample_counts
        mtp_write = cols["mtp_write_slot"]
        read_slot = schedule.mtp_read_slot
        if any_prompt:
            # Non-last prefill chunks never produce draft info: slot 0 means "no write".
            mtp_write = np.where(is_prompt & ~is_last_chunk, 0, mtp_write).astype(np.int32)
            read_slot = np.where(is_prompt, 0, read_slot)
        mtp_read = draft_read_rows(read_slot, max_draft_tokens, row_to_req, local_step, sample_ends - 1)

    forced_tokens = None
    if schedule.forced_tokens is not None:
        forced_tokens = np.full(num_sample_rows, -1, dtype=np.int64)
        forced_tokens[sample_offsets] = schedule.forced_tokens

    inputs = SamplerInputs(
        **{f.name: cols[f.name] for f in PARAM_FIELDS},
        selected_token_indices=selected_token_indices,
        selected_prompt_indices=selected_prompt_indices,
        prompt_token_targets=prompt_token_targets,
        sample_positions=sample_positions,
        row_to_req=row_to_req,
        local_step=local_step,
        eos_suppression_rows=eos_suppression_rows,
        mtp_first_token_positions=mtp_first,
        mtp_seqlens_q=mtp_seqlens,
        mtp_info_write_slots=mtp_write,
        mtp_info_read_rows=mtp_read,
        request_ids=tuple(schedule.request_ids),
        num_output_rows=num_output_rows,
        out_offsets=out_offsets,
        out_lens=out_lens,
        query_offsets=query_offsets,
        sample_offsets=sample_offsets,
        sample_counts=sample_counts,
        prompt_row_counts=prompt_row_counts,
        is_prompt=is_prompt,
        is_last_chunk=is_last_chunk,
        num_logprobs=cols["num_logprobs"],
        num_prompt_logprobs=cols["num_prompt_logprobs"],
        forced_tokens=forced_tokens,
    )
    planned = int(seqlen_q.sum()) - (int((seqlen_q - 1)[is_prompt].sum()) if any_prompt else 0)
    _check_invariants(inputs, planned_sample_rows=planned)
    return inputs


def _prompt_rows(
    schedule: StepSchedule,
    cols: np.ndarray,
    out_offsets: np.ndarray,
    is_last_chunk: np.ndarray,
    n: int,
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
    """Prompt-logprob rows (§1.1): a chunk of seqlen_q tokens yields seqlen_q
    logprobs, one short on the last chunk because its last row predicts the
    first *generated* token, not a prompt token. Over all chunks: L - 1."""
    wants = schedule.is_prompt & (cols["num_prompt_logprobs"] >= 0)
    prompt_row_counts = np.where(wants, schedule.seqlen_q - is_last_chunk, 0).astype(np.int32)
    if not wants.any():
        return None, None, prompt_row_counts
    prompt_offsets, prompt_ends = exclusive_cumsum(prompt_row_counts)
    total = int(prompt_ends[-1])
    prompt_row_to_req = np.repeat(np.arange(n, dtype=np.int32), prompt_row_counts)
    j = np.arange(total, dtype=np.int32) - prompt_offsets[prompt_row_to_req]
    selected_prompt_indices = out_offsets[prompt_row_to_req] + j
    # Row j of the chunk predicts the prompt token right after it.
    targets = np.empty(total, dtype=np.int32)
    chunk_start = schedule.seqlen_k - schedule.seqlen_q
    for i in np.flatnonzero(prompt_row_counts):
        start = int(chunk_start[i]) + 1
        lo, hi = int(prompt_offsets[i]), int(prompt_ends[i])
        targets[lo:hi] = np.asarray(schedule.prompt_tokens[i])[start : start + hi - lo]
    return selected_prompt_indices, targets, prompt_row_counts


def _check_invariants(inputs: SamplerInputs, *, planned_sample_rows: int) -> None:
    """§1.5: a violation is a ledger bug and raises; nothing is clipped."""
    problems = []
    if inputs.num_sample_rows != planned_sample_rows:
        problems.append(f"wrote {inputs.num_sample_rows} sample rows, planned {planned_sample_rows}")
    if len(inputs.temperatures) != inputs.num_reqs:
        problems.append(f"wrote {len(inputs.temperatures)} parameter sets for {inputs.num_reqs} requests")
    planned_prompt_rows = int(inputs.prompt_row_counts.sum())
    if inputs.num_prompt_rows != planned_prompt_rows:
        problems.append(f"wrote {inputs.num_prompt_rows} prompt rows, planned {planned_prompt_rows}")
    for name in ("selected_token_indices", "selected_prompt_indices"):
        rows = getattr(inputs, name)
        # Viewed as unsigned, a negative index is huge: one max() checks both ends.
        if rows is not None and len(rows) and rows.view(np.uint32).max() >= inputs.num_output_rows:
            problems.append(f"{name} outside [0, {inputs.num_output_rows}): [{rows.min()}, {rows.max()}]")
    if problems:
        raise LedgerInvariantError("ledger invariant violated: " + "; ".join(problems))


def prepare_sampler_inputs(
    seqs: Sequence[SeqMeta],
    *,
    max_draft_tokens: int = 0,
    compaction_keep_tokens: int | None = None,
    seed_base: int = 0,
    draft_pool: bool = True,
) -> SamplerInputs:
    """docs/contract.md §1 over a list of `SeqMeta`, pure: nothing is kept
    between calls.

    The engine keeps per-request state in a persistent `RequestTable`
    (engine/host/request_table.py) and runs the same vectorised walk.
    `seed_base` salts the seeds given to requests that brought none;
    `draft_pool=False`: no draft-info pool, write slots may be 0 (see `validate_batch`).
    """
    # One read of the whole batch: the records each SeqMeta packed when it was built (into a
    # bytearray: the schedule's columns are writable views of them).
    try:
        records = np.frombuffer(bytearray(b"".join(map(_LEDGER_RECORD, seqs))), dtype=SEQ_RECORD)
        request_ids = list(map(_REQUEST_ID, seqs))
    except (AttributeError, TypeError):
        records = None
    if records is None or len(records) != len(seqs):
        bad = next(seq for seq in seqs if not isinstance(seq, SeqMeta))
        raise TypeError(f"expected SeqMeta, got {type(bad).__name__}: {bad!r}")
    schedule = StepSchedule.from_records(records, request_ids, seqs)
    cols = derive_seeds(records, request_ids, seed_base)
    validate_batch(schedule, cols, max_draft_tokens=max_draft_tokens, compaction_keep_tokens=compaction_keep_tokens,
                   draft_pool=draft_pool)
    return build_ledger(
        schedule, cols, max_draft_tokens=max_draft_tokens, compaction_keep_tokens=compaction_keep_tokens
    )
