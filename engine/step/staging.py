"""The host arrays one step stages into the static buffers, in batch order, and the
step's drafts checked and laid out on its sample rows (docs/contract.md §1.2, §1.3).

`StepArrays` holds what `StepBuffers.load` copies: one attribute per
declared per-step field (`engine/host/step_fields.py`), under the same
names and in the same order (tests/test_step_fields.py holds them equal),
plus the drafts' distributions for the rejection-mode buffer, which travel
in copies of their own, and the token bitmask, which rides the same copy
after the fields. `from_inputs` and the split into parts derive from the
declaration. Its device twin is `StepInputs`, the typed views of the same fields
in the static buffers, and `check_declaration` says whether a declaration can be
staged at all (dtypes, widths, padding rules).

Every decode row but a request's last verifies one draft: the caller's
(`draft_tokens`), else the one its read slot of the draft-info pool holds
(`READ_FROM_POOL`, resolved inside the graph). Rejection mode can take the
draft distributions (`draft_logprobs`); a draft head's proposals for the next
step (`next_drafts`) go into each request's write slot inside the graph.
`StepDrafts.step_arrays` turns the ledger and all of these into the
`StepArrays` the step stages, after checking every value.

Before any of it is staged, the checks a step passes (`check_hidden_states`,
`check_ledger`, `check_token_bitmask`): after them, nothing may raise but a bug.
Every error is a ValueError naming the request (or the argument), the field and the value.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Hashable, Sequence

import numpy as np
import torch

from engine.sampling.draw import staged_draw_uniforms
from engine.host.ledger import SamplerInputs
from engine.host.step_fields import FROM_LEDGER_FIELDS, READ_FROM_POOL, STEP_FIELDS, StepField
from engine.sampling.row_params import RowParams
from engine.step.engine_config import EngineConfig


# The stage whose fields make up `RowParams`, the sampler's view.
SAMPLE_STAGE = "sample"


@dataclass
class StepInputs:
    """The typed device views of the per-step fields: one tensor per declared field
    (engine/host/step_fields.py, in its order: tests/test_step_fields.py holds them
    equal), full size, views into `StepBuffers.packed`. The step reads
    `buffers.inputs.row_drafts`, never a string key. A declaration that adds a field
    (an experiment, before it is added here) gets it as an attribute of its own."""

    selected_token_indices: torch.Tensor  # [max_rows] int64
    row_to_req: torch.Tensor  # [max_rows] int64
    local_step: torch.Tensor  # [max_rows] int64
    sample_positions: torch.Tensor  # [max_reqs] int64
    control_slots: torch.Tensor  # [max_reqs] int64
    masked_rows: torch.Tensor  # [max_rows] bool
    temperatures: torch.Tensor  # [max_reqs] f32
    top_ks: torch.Tensor  # [max_reqs] int32
    top_ps: torch.Tensor  # [max_reqs] f32
    min_ps: torch.Tensor  # [max_reqs] f32
    seeds: torch.Tensor  # [max_reqs] int64 holding uint64 bits
    stop_ids: torch.Tensor  # [max_reqs, max_stop_ids] int64
    eos_suppression_rows: torch.Tensor  # [max_rows] bool
    forced_tokens: torch.Tensor  # [max_rows] int64
    draw_uniforms: torch.Tensor  # [max_rows] f64
    row_drafts: torch.Tensor  # [max_rows] int64
    has_draft_probs: torch.Tensor  # [max_rows] bool
    mtp_info_read_rows: torch.Tensor  # [max_rows] int64
    mtp_info_write_slots: torch.Tensor  # [max_reqs] int64
    next_draft_tokens: torch.Tensor  # [max_reqs, max(max_draft_tokens, 1)] int64
    next_draft_logprobs: torch.Tensor  # [max_reqs, max(max_draft_tokens, 1)] f32

    @classmethod
    def of(cls, views: dict[str, torch.Tensor]) -> StepInputs:
        """The views of a declaration, by field name (`check_declaration` saw every field here)."""
        known = {f.name for f in fields(cls)}
        inputs = cls(**{name: view for name, view in views.items() if name in known})
        for name in views.keys() - known:
            setattr(inputs, name, views[name])
        return inputs


# Staged numpy dtype -> device dtype. uint64 (seeds) travels as its int64 bits:
# torch has no uint64 arithmetic, and the sampler's hash works on the bits.
STAGED_AS = {np.dtype(np.uint64): np.dtype(np.int64)}
TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
          np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64, np.dtype(np.bool_): torch.bool}
# Step-dependent padding of per-row fields, resolved by `_padding_rules`.
PADDING_RULES = ("padding request", "past request rows")


def check_declaration(declared: tuple[StepField, ...], widths: dict[str, int]) -> None:
    """ValueError naming the first declared field these buffers cannot stage."""
    names = [f.name for f in declared]
    if not {"req", "row"} <= {f.per for f in declared}:
        raise ValueError("step fields: a declaration needs a per-request and a per-row field (they size a step)")
    for f in declared:
        problem = None
        if names.count(f.name) > 1:
            problem = "declared twice"
        elif f.per not in ("req", "row"):
            problem = f"per={f.per!r}: must be 'req' or 'row'"
        elif STAGED_AS.get(np.dtype(f.dtype), np.dtype(f.dtype)) not in TORCH_DTYPES:
            problem = f"dtype={np.dtype(f.dtype)}: not one of {sorted(str(d) for d in (*TORCH_DTYPES, *STAGED_AS))}"
        elif isinstance(f.width, str) and f.width not in widths:
            problem = f"width={f.width!r}: must be an int or one of {sorted(widths)}"
        elif isinstance(f.padding, str) and (f.padding not in PADDING_RULES or f.per != "row"):
            problem = f"padding={f.padding!r}: a rule is one of {PADDING_RULES}, for a per-row field"
        if problem:
            raise ValueError(f"step field {f.name!r}: {problem}")
    sampled = {f.name for f in declared if f.stage == SAMPLE_STAGE}
    wanted = {f.name for f in fields(RowParams)}
    if sampled != wanted:
        raise ValueError(
            f"step fields of stage {SAMPLE_STAGE!r}: {sorted(sampled)}, but the sampler's view RowParams "
            f"reads {sorted(wanted)} (missing {sorted(wanted - sampled)}, extra {sorted(sampled - wanted)})"
        )
    missing = [f.name for f in fields(StepInputs) if f.name not in names]
    if missing:
        raise ValueError(f"step fields: missing {missing}, which the step reads (StepInputs)")


def type_name(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def is_same_view(hidden: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether `hidden` is the engine's static source itself (the zero-copy path)."""
    return (
        hidden.data_ptr() == source.data_ptr()
        and hidden.stride() == source.stride()
        and hidden.dtype == source.dtype
        and hidden.device == source.device
    )


def check_hidden_states(hidden: object, inputs: SamplerInputs, *, hidden_size: int, device: torch.device,
                        source: torch.Tensor) -> None:
    """`hidden` is a floating-point [rows, hidden_size] tensor on `device` with the
    rows the batch's ledger reads."""
    if not isinstance(hidden, torch.Tensor):
        raise ValueError(f"hidden_states: a {type_name(hidden)}, expected a torch.Tensor [rows, {hidden_size}]")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden_states: dtype {hidden.dtype}, expected a floating-point tensor (the model's last-layer rows)")
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden_states: shape {tuple(hidden.shape)}, expected [rows, {hidden_size}]")
    if hidden.device.type != device.type:
        raise ValueError(f"hidden_states: on {hidden.device}, the engine runs on {device}")
    if hidden.shape[0] < inputs.num_output_rows:
        fix = " (the engine's static source: raise EngineConfig.max_source_rows)" if is_same_view(hidden, source) else ""
        raise ValueError(
            f"hidden_states: {hidden.shape[0]} rows{fix}, but the batch's ledger needs "
            f"{inputs.num_output_rows} (requests {list(inputs.request_ids)[:4]}"
            f"{'...' if inputs.num_reqs > 4 else ''})"
        )


def check_ledger(inputs: SamplerInputs, *, vocab_size: int, max_logprobs: int) -> None:
    """Prompt-logprob targets and forced tokens inside the vocabulary, no more top logprobs (sampled or
    prompt) than `max_logprobs`."""
    targets = inputs.prompt_token_targets
    if targets is not None and len(targets) and targets.max() >= vocab_size:
        bad = int(np.flatnonzero(targets >= vocab_size)[0])
        req = int(np.searchsorted(np.cumsum(inputs.prompt_row_counts), bad, side="right"))
        raise ValueError(
            f"request {inputs.request_ids[req]!r}: prompt_tokens: token {int(targets[bad])} "
            f"is outside the vocabulary ({vocab_size})"
        )
    for name, top in (("logprobs", inputs.num_logprobs), ("prompt_logprobs", inputs.num_prompt_logprobs)):
        top_n = int(top.max(initial=-1))
        if top_n > max_logprobs:  # vLLM's cap (its max_logprobs, 20 by default) on both
            req = int(np.argmax(top))
            raise ValueError(
                f"request {inputs.request_ids[req]!r}: params.{name}={top_n}: more than "
                f"SamplerConfig.max_logprobs={max_logprobs}"
            )
    forced = inputs.forced_tokens
    if forced is not None and forced.max() >= vocab_size:
        row = int(np.argmax(forced))
        raise ValueError(f"request {inputs.request_ids[int(inputs.row_to_req[row])]!r}: "
                         f"forced_token={int(forced[row])}: outside the vocabulary ({vocab_size})")


def check_token_bitmask(mask: object, rows: int, vocab_size: int, *, applies: bool) -> None:
    """A step's token bitmask is None or a C-contiguous int32 numpy array
    [rows, ceil(vocab_size / 32)], on an engine whose head applies one."""
    if mask is None:
        return
    if not applies:
        raise ValueError("StepArrays.token_bitmask: this engine applies no token bitmask "
                         "(EngineConfig(token_bitmask=False), or a head without masked graphs)")
    words = -(-vocab_size // 32)
    if not isinstance(mask, np.ndarray) or mask.dtype != np.int32 or mask.shape != (rows, words):
        shape = f"{mask.dtype} {mask.shape}" if isinstance(mask, np.ndarray) else type_name(mask)
        raise ValueError(f"StepArrays.token_bitmask: {shape}, expected int32 [{rows} sample rows, {words} words]")


@dataclass
class StepArrays:
    """Host arrays one step stages, in batch order (sample rows / requests).

    Per-row fields have one entry per sample row, per-request ones one per
    request (`stop_ids` [n, max_stop_ids], the next drafts [n, max_draft]);
    `eos_suppression_rows` lists row numbers, as the ledger hands them. A
    field left None stages padding only (no drafts, no forced token, ...)."""

    # The declared per-step fields (engine/host/step_fields.py), in its order.
    selected_token_indices: np.ndarray | None = None  # [rows] model-output row of each sample row
    row_to_req: np.ndarray | None = None  # [rows]
    local_step: np.ndarray | None = None  # [rows]
    sample_positions: np.ndarray | None = None  # [n] int64
    control_slots: np.ndarray | None = None  # [n] int64, 0 = none
    masked_rows: np.ndarray | None = None  # [rows] bool: the rows `token_bitmask` restricts
    temperatures: np.ndarray | None = None  # [n] float32
    top_ks: np.ndarray | None = None  # [n] int32
    top_ps: np.ndarray | None = None  # [n] float32
    min_ps: np.ndarray | None = None  # [n] float32
    seeds: np.ndarray | None = None  # [n] uint64
    stop_ids: np.ndarray | None = None  # [n, max_stop_ids] int64, -1 = no id
    eos_suppression_rows: np.ndarray | None = None  # row numbers
    forced_tokens: np.ndarray | None = None  # [rows] int64, -1 = none
    draw_uniforms: np.ndarray | None = None  # [rows] float64
    row_drafts: np.ndarray | None = None  # [rows] int64, -1 none, READ_FROM_POOL
    has_draft_probs: np.ndarray | None = None  # [rows] bool
    mtp_info_read_rows: np.ndarray | None = None  # [rows]
    mtp_info_write_slots: np.ndarray | None = None  # [n]
    next_draft_tokens: np.ndarray | None = None  # [n, max_draft_tokens] int64
    next_draft_logprobs: np.ndarray | None = None  # [n, max_draft_tokens] float32
    # What travels in copies of its own:
    draft_probs: dict[int, torch.Tensor] | None = None  # first sample row -> [k, V] q of its drafts
    # [rows, ceil(V / 32)] int32 in xgrammar's packed layout (bit b of word w: token 32 w + b, 1 = allowed;
    # a row of -1 restricts nothing); None: no row is restricted this step. Carried by the step's copy
    # when set.
    token_bitmask: np.ndarray | None = None

    @classmethod
    def from_inputs(cls, inputs: SamplerInputs, stop_ids: np.ndarray) -> StepArrays:
        """The ledger's fields, the stop-id matrix [n, max_stop_ids] the engine built, and
        each row's draw uniform (`engine.sampling.draw.staged_draw_uniforms`; padding only when every
        request is greedy: a greedy row never reads it)."""
        uniforms = None
        if (inputs.temperatures != 0).any():
            uniforms = staged_draw_uniforms(inputs.seeds, inputs.sample_positions, inputs.row_to_req, inputs.local_step)
        return cls(stop_ids=stop_ids, draw_uniforms=uniforms, **{f.name: getattr(inputs, f.name) for f in FROM_LEDGER_FIELDS})

    def requests(self, a: int, b: int, sample_offsets: np.ndarray, sample_counts: np.ndarray) -> StepArrays:
        """The arrays of requests [a, b), renumbered from 0."""
        r0 = int(sample_offsets[a])
        r1 = int(sample_offsets[b - 1] + sample_counts[b - 1])
        part = {}
        for f in STEP_FIELDS:
            value = getattr(self, f.name)
            if value is None:
                part[f.name] = None
            elif f.host_form == "row numbers":
                part[f.name] = value[(value >= r0) & (value < r1)] - r0
            else:
                sliced = value[r0:r1] if f.per == "row" else value[a:b]
                part[f.name] = sliced - a if f.index_of == "req" else sliced
        part["token_bitmask"] = None if self.token_bitmask is None else self.token_bitmask[r0:r1]
        part["draft_probs"] = (
            None if self.draft_probs is None
            else {row - r0: q for row, q in self.draft_probs.items() if r0 <= row < r1}
        )
        return StepArrays(**part)


DRAFT_MASS_TOLERANCE = 1e-3  # |sum(exp(draft_logprobs)) - 1| accepted per draft (float32 sums)


@dataclass(frozen=True)
class _DraftLayout:
    row_to_req: np.ndarray  # the ledger arrays this layout was derived from (identity-checked)
    sample_offsets: np.ndarray
    row_drafts: np.ndarray  # [rows] READ_FROM_POOL where a row verifies a draft, -1 on last rows
    draft_rows: np.ndarray  # rows that verify a draft
    draft_req: np.ndarray  # their request
    draft_step: np.ndarray  # their local step (= draft index)


class StepDrafts:
    """Builds a step's `StepArrays` with its drafts, for a vocabulary of `vocab_size`."""

    def __init__(self, vocab_size: int, config: EngineConfig) -> None:
        self.vocab_size = vocab_size
        self.config = config
        self._last_layout: _DraftLayout | None = None

    def step_arrays(
        self,
        inputs: SamplerInputs,
        stop_ids: np.ndarray,
        *,
        draft_tokens: Sequence[Sequence[int] | None] | np.ndarray | None = None,
        draft_logprobs: Sequence[np.ndarray | torch.Tensor | None] | None = None,
        next_drafts: Sequence[Sequence[int] | None] | None = None,
        next_draft_logprobs: Sequence[Sequence[float] | None] | None = None,
    ) -> StepArrays:
        """Everything the step stages, validated (names the request and field).
        `draft_tokens` may also be an [n, max_draft_tokens] array (vectorised)."""
        n, rows, k = inputs.num_reqs, inputs.num_sample_rows, self.config.max_draft_tokens
        for name, value in (("draft_tokens", draft_tokens), ("draft_logprobs", draft_logprobs),
                            ("next_drafts", next_drafts), ("next_draft_logprobs", next_draft_logprobs)):
            if value is not None and len(value) != n:
                raise ValueError(f"{name}: {len(value)} entries for {n} requests")
        arrays = StepArrays.from_inputs(inputs, stop_ids)
        if k == 0:
            for name, value in (("draft_tokens", draft_tokens), ("next_drafts", next_drafts)):
                if value is not None and any(v for v in value):
                    raise ValueError(f"{name}: drafts given but EngineConfig.max_draft_tokens=0")
            return arrays
        drafts_per_req = inputs.sample_counts - 1  # 0 for a prefill chunk (one sample row)
        layout = self._layout(inputs)
        arrays.row_drafts = layout.row_drafts.copy()
        arrays.mtp_info_read_rows = inputs.mtp_info_read_rows
        arrays.mtp_info_write_slots = inputs.mtp_info_write_slots
        limit = self.config.pool_slots
        pool = (f"the draft-info pool has slots 0..{limit - 1} (EngineConfig.draft_pool_slots)" if limit > 1 else
                "EngineConfig(draft_pool_slots=1) has no draft-info pool: drafts come only from draft_tokens")
        for name, slots, bound in (("mtp_read_slot", arrays.mtp_info_read_rows, limit * k),
                                   ("mtp_write_slot", arrays.mtp_info_write_slots, limit)):
            if len(slots) and slots.max() >= bound:
                j = int(np.argmax(slots))
                req = int(inputs.row_to_req[j]) if name == "mtp_read_slot" else j
                raise ValueError(f"request {inputs.request_ids[req]!r}: {name}={int(slots[j]) * limit // bound}: {pool}")
        if limit == 1 and next_drafts is not None and any(next_drafts):
            raise ValueError(f"next_drafts: given but {pool}, nothing to write them into")
        if limit == 1 and not isinstance(draft_tokens, np.ndarray):
            # Without a pool, a decode's drafts come from draft_tokens or from nowhere: a claimed
            # draft not given would verify the padding token.
            for i in np.flatnonzero(drafts_per_req > 0):
                if draft_tokens is None or draft_tokens[i] is None:
                    raise ValueError(f"request {inputs.request_ids[i]!r}: seqlen_q={int(drafts_per_req[i]) + 1} claims "
                                     f"{int(drafts_per_req[i])} drafts but draft_tokens gives none; {pool}")
        if isinstance(draft_tokens, np.ndarray):
            # The hot path: [n, >= k] array, row i's first drafts_per_req[i] entries used.
            rows_with = layout.draft_rows
            if len(rows_with) and draft_tokens.dtype.kind not in "iu":
                i = int(layout.draft_req[0])
                raise ValueError(f"request {inputs.request_ids[i]!r}: draft_tokens: an array of dtype "
                                 f"{draft_tokens.dtype} ({draft_tokens[i].tolist()}), expected integer token ids")
            values = draft_tokens[layout.draft_req, layout.draft_step]
            if len(values) and (values.min() < 0 or values.max() >= self.vocab_size):
                bad = int(np.flatnonzero((values < 0) | (values >= self.vocab_size))[0])
                i = int(inputs.row_to_req[rows_with[bad]])
                raise ValueError(f"request {inputs.request_ids[i]!r}: draft_tokens={draft_tokens[i].tolist()}: "
                                 f"outside [0, {self.vocab_size})")
            arrays.row_drafts[rows_with] = values
            draft_tokens = None
        for i in range(n if draft_tokens is not None else 0):
            drafts = draft_tokens[i]
            if drafts is None:
                continue
            lo = int(inputs.sample_offsets[i])
            arrays.row_drafts[lo : lo + int(drafts_per_req[i])] = self._checked_tokens(
                inputs.request_ids[i], "draft_tokens", drafts, int(drafts_per_req[i]))
        if draft_logprobs is not None and any(q is not None for q in draft_logprobs):
            if self.config.verify_mode != "rejection":
                raise ValueError("draft_logprobs: only used by EngineConfig(verify_mode='rejection')")
            arrays.has_draft_probs = np.zeros(rows, dtype=bool)
            arrays.draft_probs = {}
            for i, q in enumerate(draft_logprobs):
                if q is None:
                    continue
                probs = self._checked_draft_logprobs(inputs.request_ids[i], q, int(drafts_per_req[i]))
                lo = int(inputs.sample_offsets[i])
                arrays.has_draft_probs[lo : lo + len(probs)] = True
                arrays.draft_probs[lo] = probs
        if next_drafts is not None:
            arrays.next_draft_tokens = np.full((n, k), -1, dtype=np.int64)
            arrays.next_draft_logprobs = np.zeros((n, k), dtype=np.float32)
            for i, proposal in enumerate(next_drafts):
                if not proposal:
                    continue
                if len(proposal) > k:
                    raise ValueError(f"request {inputs.request_ids[i]!r}: next_drafts has {len(proposal)} tokens, "
                                     f"max_draft_tokens={k}")
                arrays.next_draft_tokens[i, : len(proposal)] = self._checked_tokens(
                    inputs.request_ids[i], "next_drafts", proposal, len(proposal))
                if next_draft_logprobs is not None and next_draft_logprobs[i] is not None:
                    values = np.asarray(next_draft_logprobs[i], np.float32)
                    if values.shape != (len(proposal),) or np.isnan(values).any() or np.isposinf(values).any():
                        raise ValueError(f"request {inputs.request_ids[i]!r}: next_draft_logprobs={values.tolist()}: "
                                         f"expected {len(proposal)} log-probabilities (finite or -inf), one per proposal")
                    arrays.next_draft_logprobs[i, : len(proposal)] = values
        return arrays

    def _layout(self, inputs: SamplerInputs) -> _DraftLayout:
        """Which rows verify a draft, and of which request and step; reused
        while the ledger hands out the same row layout (steady-state decode
        shares its arrays from step to step)."""
        cached = self._last_layout
        if cached is not None and cached.row_to_req is inputs.row_to_req and cached.sample_offsets is inputs.sample_offsets:
            return cached
        # Every row verifies a draft (by default from the pool) except each
        # request's last row, which has none.
        row_drafts = np.full(inputs.num_sample_rows, READ_FROM_POOL, dtype=np.int64)
        row_drafts[inputs.sample_offsets + inputs.sample_counts - 1] = -1
        draft_rows = np.flatnonzero(row_drafts == READ_FROM_POOL)
        layout = _DraftLayout(inputs.row_to_req, inputs.sample_offsets, row_drafts, draft_rows,
                              inputs.row_to_req[draft_rows], inputs.local_step[draft_rows])
        self._last_layout = layout
        return layout

    def _checked_draft_logprobs(self, request_id: Hashable, q: np.ndarray | torch.Tensor, count: int) -> torch.Tensor:
        """The draft distributions [count, V] f32 (probabilities) of a request's
        `draft_logprobs`, checked: float, the right shape, no NaN or +inf,
        each row's probabilities summing to 1."""
        if isinstance(q, (list, tuple)):
            q = np.asarray(q)
        floating = ((isinstance(q, torch.Tensor) and q.is_floating_point())
                    or (isinstance(q, np.ndarray) and q.dtype.kind == "f"))
        if not floating:
            raise ValueError(f"request {request_id!r}: draft_logprobs: a {type_name(q)} of dtype "
                             f"{getattr(q, 'dtype', None)}, expected a float tensor [{count}, {self.vocab_size}]")
        q = torch.as_tensor(q).to(torch.float32)
        if tuple(q.shape) != (count, self.vocab_size):
            raise ValueError(f"request {request_id!r}: draft_logprobs: shape {tuple(q.shape)}, "
                             f"expected [{count}, {self.vocab_size}] (one log-distribution per draft)")
        probs = q.exp()
        mass = probs.sum(-1, dtype=torch.float64)  # [count]: NaN or inf when a logprob is NaN or +inf
        if not bool(torch.isfinite(mass).all()):
            bad = "nan" if bool(torch.isnan(q).any()) else "inf"
            raise ValueError(f"request {request_id!r}: draft_logprobs holds {bad}: log-probabilities are finite or -inf")
        off = torch.nonzero((mass - 1).abs() > DRAFT_MASS_TOLERANCE).flatten()
        if len(off):
            j = int(off[0])
            raise ValueError(f"request {request_id!r}: draft_logprobs[{j}]: the probabilities sum to "
                             f"{float(mass[j]):.6g}, not 1 (pass log-probabilities, e.g. log_softmax)")
        return probs

    def _checked_tokens(self, request_id: Hashable, name: str, tokens: Sequence[int], count: int) -> np.ndarray:
        tokens = list(tokens)
        for token in tokens:
            # operator.index takes ints, numpy and 0-d integer torch scalars;
            # a float or a string is a caller's bug, never truncated.
            try:
                if isinstance(token, (bool, np.bool_)):
                    raise TypeError
                operator.index(token)
            except TypeError:
                raise ValueError(f"request {request_id!r}: {name}={tokens!r}: {token!r} is not an int token id") from None
        values = np.asarray([operator.index(t) for t in tokens], dtype=np.int64)
        if len(values) != count:
            raise ValueError(f"request {request_id!r}: {name} has {len(values)} tokens but the request "
                             f"verifies {count} this step (seqlen_q - 1 for a decode)")
        if count and (values.min() < 0 or values.max() >= self.vocab_size):
            raise ValueError(f"request {request_id!r}: {name}={values.tolist()}: outside [0, {self.vocab_size})")
        return values
