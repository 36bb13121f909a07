"""The embedding API: requests that live across the steps of one `StepEngine` (docs/contract.md §5).

`PersistentBatch` holds a `RequestTable` (engine/host/request_table.py): add,
update and remove requests; per step say which run, with how many query
tokens, context length and drafts, and get what `engine.run` needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Mapping, Sequence, Sized

import numpy as np

from engine.host.draft_slots import DraftSlots
from engine.host.ledger import SamplerInputs
from engine.host.ledger_tables import LedgerRequest, render
from engine.host.params import INT32_MAX, SamplingParams
from engine.host.request_table import RequestState, RequestTable
from engine.host.token_ids import check_request_id, checked_prompt
from engine.host.token_constraints import TokenConstraint, TokenConstraints
from engine.step.prompt_logprobs import PromptLogprobAccumulator

if TYPE_CHECKING:
    from engine.step.step_output import StepOutput
    from engine.step.staging import StepArrays
    from engine.step.step_engine import StepEngine


@dataclass(frozen=True)
class BatchStep:
    """One prepared step: `engine.run(hidden, step.inputs, step.arrays)`."""

    rows: np.ndarray  # [n] table rows, batch order
    inputs: SamplerInputs
    arrays: StepArrays
    read_slots: np.ndarray | None  # [n] draft-info slots read (0 = padding), None without a pool
    seqlen_q: np.ndarray | None = None  # [n] int32 query tokens per request
    seqlen_k: np.ndarray | None = None  # [n] int32 context length per request after the step

    def explain(self, bucket: int | None = None, max_draft_tokens: int = 0) -> str:
        """This step's ledger as tables, as `python -m engine explain` prints a batch: per
        request its rows, sample rows (a discarded one marked), positions, prompt rows and
        draft info; the row map; the staged fields. At most 100 columns wide. `bucket`
        (with the engine's `max_draft_tokens`): also show that graph bucket's padding."""
        inputs = self.inputs
        requests = [LedgerRequest(rid, bool(p), int(q), int(k))
                    for rid, p, q, k in zip(inputs.request_ids, inputs.is_prompt, self.seqlen_q, self.seqlen_k)]
        return render(requests, inputs, max_draft_tokens=max_draft_tokens, bucket=bucket)


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

    Lifecycle (docs/contract.md §5.1): each request has one state (`state`) and
    one generation; a prepared step carries them, and `engine.run` / `record`
    refuse it once any of its requests changed (ValueError naming the request,
    nothing changed). `remove` / `finish` free everything the request held.
    """

    def __init__(self, engine: StepEngine, capacity: int | None = None, *, tokenizer: object | None = None):
        config = engine.config
        self.engine = engine
        self.table = RequestTable(capacity or config.max_num_reqs, seed_base=config.seed_base,
                                  stop_rule=engine.stop_rule, controls=engine.control_hook)
        self.draft_slots = DraftSlots(config.pool_slots) if config.draft_pool else None
        self._rows_in_range = b""  # the last rows (as bytes) found in range and holding requests
        # Per table row: its token constraint (bad words, structured output), if any.
        self.constraints = TokenConstraints(engine.vocab_size, tokenizer, config.eos_token_id)
        self._constrained = np.zeros(self.table.capacity, dtype=bool)

    @property
    def prompt_logprobs(self) -> PromptLogprobAccumulator:
        """The partial prompt logprobs of this batch's requests (between prompt chunks)."""
        return self.engine.prompt_logprobs_of(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self.table.row_of

    def add(self, request_id: Hashable, prompt_tokens: Sequence[int], params: SamplingParams | None = None) -> int:
        """Take a row (returned) for a new request; its stop ids are the
        engine's (EOS, even with ignore_eos, plus params.stop_token_ids). A reused
        id starts from nothing: no counts, prompt logprobs or grammar state of
        the request that held it before. **Raises** ValueError naming the
        request, the field and the value (nothing is written), RuntimeError
        when the batch or the draft-info pool is full."""
        if isinstance(prompt_tokens, Sized) and not isinstance(prompt_tokens, (str, Mapping)) and not len(prompt_tokens):
            raise ValueError(f"request {request_id!r}: prompt_len=0: must be an int >= 1 (the prompt is empty)")
        prompt_tokens, params = self.check(request_id, prompt_tokens, params)
        if request_id in self.table.row_of:
            raise ValueError(f"request {request_id!r}: request_id is already in the table")
        constraint = self.check_constraints(request_id, params)
        self.prompt_logprobs.discard(request_id)  # a reused id inherits nothing
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

    def check(self, request_id: Hashable, prompt_tokens: Sequence[int],
              params: SamplingParams | None) -> tuple[np.ndarray, SamplingParams]:
        """Every check of a request that needs no row, run once where it enters (`add`,
        the loop's `submit`): the id, the prompt (a flat sequence of int ids inside the
        vocabulary), the parameters' caps (logprobs and prompt_logprobs up to
        `SamplerConfig.max_logprobs`), the stop ids and the sampling controls. Returns
        the prompt ([prompt_len] int64) and the parameters (defaults for None).
        **Raises** ValueError naming the request, the field and the value; changes nothing."""
        check_request_id(request_id)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        if prompt_tokens is None:
            raise ValueError(f"request {request_id!r}: prompt_tokens=None: the batch needs the prompt")
        prompt = checked_prompt(request_id, prompt_tokens, self.engine.vocab_size)
        cap = self.engine.config.sampler.max_logprobs
        for name, top_n in (("logprobs", params.num_logprobs), ("prompt_logprobs", params.num_prompt_logprobs)):
            if top_n > cap:
                raise ValueError(f"request {request_id!r}: params.{name}={top_n}: more than max_logprobs={cap} "
                                 "(EngineConfig(sampler=SamplerConfig(max_logprobs=...)))")
        stop_ids = self.engine.stop_rule.for_request(request_id, params)  # too many, or outside the vocabulary
        vocab = self.engine.vocab_size
        if params.min_tokens and len(np.unique(stop_ids[stop_ids >= 0])) == vocab:
            # Every id is suppressed until min_tokens: the first step would have nothing to sample.
            raise ValueError(f"request {request_id!r}: params.stop_token_ids={params.stop_token_ids} with EOS cover "
                             f"the whole vocabulary ({vocab} ids) while min_tokens={params.min_tokens}: no token "
                             "could be sampled")
        self.check_controls(request_id, params)
        return prompt, params

    def state(self, request_id: Hashable) -> RequestState:
        """QUEUED, PREFILLING, DECODING, or REMOVED for an id the batch does not hold."""
        return self.table.state(request_id)

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
        """Free everything the request holds: its row and stop ids, its control slot and
        counts, its draft-info slot, its token constraint (grammar matcher) and any
        partial prompt logprobs the engine keeps for it. A step prepared before is stale."""
        self._free(request_id, RequestState.REMOVED)

    def finish(self, request_id: Hashable) -> None:
        """`remove` for a request that ended (vLLM's finished request ids); stale steps say so."""
        self._free(request_id, RequestState.FINISHED)

    def _free(self, request_id: Hashable, ended: RequestState) -> None:
        row = self.table.row(request_id)
        slot = int(self.table.cols["mtp_write_slot"][row])
        self.table.remove(request_id, ended=ended)
        self.constraints.of.pop(row, None)
        self._constrained[row] = False
        self._rows_in_range = b""
        self.prompt_logprobs.discard(request_id)
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
        step. The draft arguments are those of `StepDrafts.step_arrays`.
        **Raises** ValueError naming the request, the field and the value."""
        table = self.table
        rows = np.asarray(rows)
        if rows.tobytes() != self._rows_in_range:
            if rows.dtype.kind not in "iu" or rows.ndim != 1:
                raise ValueError(f"rows: expected a 1-D array of int table rows, got {rows.dtype} shape {rows.shape}")
            if len(rows) and (rows.min() < 0 or rows.max() >= table.capacity or not table.occupied[rows].all()):
                table.check_rows(rows)  # raises naming the row; the ledger checks for duplicates
            self._rows_in_range = rows.tobytes()
        q, k = _counts("seqlen_q", seqlen_q, rows, table), _counts("seqlen_k", seqlen_k, rows, table)
        prompt_len, generated = table.cols["prompt_len"][rows], table.cols["num_generated"][rows]
        is_prompt = generated == 0
        # The steady state, all decodes: seqlen_k = prompt_len + generated + seqlen_q - 1 is the whole check.
        if is_prompt.any() or q.min(initial=1) < 1 or (k - q != prompt_len + generated - 1).any():
            self._check_lengths(rows, is_prompt, q, k, prompt_len, generated)
        read = None
        if self.draft_slots is not None:
            read = self.draft_slots.read_slots(table.cols["mtp_write_slot"][rows], ~is_prompt)
        config = self.engine.config
        inputs = table.ledger(rows, is_prompt, q, k, read, max_draft_tokens=config.max_draft_tokens,
                              compaction_keep_tokens=config.compaction_keep_tokens, draft_pool=config.draft_pool)
        arrays = self.engine.drafts.step_arrays(inputs, table.stop_ids_of(rows), draft_tokens=draft_tokens,
                                         draft_logprobs=draft_logprobs, next_drafts=next_drafts,
                                         next_draft_logprobs=next_draft_logprobs)
        arrays.control_slots = table.control_slots_of(rows, inputs)
        constrained = np.flatnonzero(self._constrained[rows])
        if len(constrained):
            arrays.token_bitmask = self._token_bitmask(rows, constrained, inputs, arrays)
        inputs.prepared = table.prepared(rows)
        return BatchStep(rows, inputs, arrays, read, q, k)

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
        prepared = step.inputs.prepared
        if prepared is None or prepared.table is not self.table:
            raise ValueError("record(step, out): the step was not prepared by this batch")
        prepared.check(ran=True)  # ValueError naming the request; nothing recorded
        if len(out.tokens) != len(step.rows):
            raise ValueError(f"record(step, out): out has {len(out.tokens)} requests, the step {len(step.rows)}")
        emitted = np.fromiter(map(len, out.tokens), dtype=np.int32, count=len(out.tokens))
        prefilled = np.where(step.inputs.is_prompt, step.seqlen_k, 0).astype(np.int32)
        self.table.record_emitted(step.rows, emitted, prefilled)
        prepared.mark_recorded()
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


def _counts(name: str, values: Sequence[int] | np.ndarray, rows: np.ndarray, table: RequestTable) -> np.ndarray:
    """[n] int32 from integer counts, one per request of the step at table `rows`."""
    n = len(rows)
    array = np.asarray(values)
    if array.shape != (n,) or (n and array.dtype.kind not in "iu"):
        raise ValueError(f"{name}: expected {n} int counts (one per request), got {array.dtype} shape {array.shape}")
    if array.dtype.itemsize > 4 or array.dtype == np.uint32:
        # Past int32 a count would wrap (2**32 + 3 to 3): refuse it, naming the request.
        outside = np.flatnonzero((array < 0) | (array > INT32_MAX))
        if len(outside):
            i = int(outside[0])
            raise ValueError(f"request {table.request_ids[rows[i]]!r}: {name}={int(array[i])}: must lie in [0, 2**31)")
    return array.astype(np.int32, copy=False)
