"""The sampling controls' per-request state (docs/contract.md §2): penalties, logit bias, allowed tokens.

Static device buffers, one row per *control slot*; slot 0 is padding: neutral
(no penalty, no bias, unrestricted) and never written. A request that uses a
control gets a slot when it joins the request table and gives it back when it
leaves; the step stages each request's slot (`control_slots`, 0 = none).

    counts        [slots, V] int32   times each token was generated
    prompt_words  [slots, ceil(V/32)] int32   the prompt's tokens, packed
    penalties     [slots, 3] f32     repetition, frequency, presence
    bias_ids      [slots, max_logit_bias] int64, bias_values f32 (padding: token 0, +0.0)
    allowed_words [slots, ceil(V/32)] int32, restricted [slots] bool
    unprocessed   [max_rows, V] f32  the logits before the controls (raw logprobs); only for a
                  head that applies the controls in place (`LMHead.controls_in_place`): the
                  kernel head's logits stay unprocessed, and it has none (None)

Inside the captured step (`rows`, `count`): each sample row's controls,
gathered from its request's slot, go to the sampler
(`engine.sampling.sampler.ControlRows`), which keeps a copy of the
unprocessed logits and applies them to `buffers.logits` in place, in vLLM's
order, so what reads the logits afterwards (draft verification, the rescoring
of residual draws) sees the processed ones; then the tokens the step emits are
added to the counts, on the device. What each replay counted comes back to
the host with the step's outputs, in their one copy (`counted_index` lives in
`StepBuffers.output_area`), so that `StepEngine.rollback` can take back the
last step, or a step that raised after its replay.

The other way, a request's controls reach the device with the step's packed
input copy (staged writes, as vLLM's model runner v2 does): joining or
changing writes one record per slot on the host (`ControlWrites`, the latest
record of a slot wins), the next step carries the records after its fields
(`StepBuffers.load(carried=...)`), and a few scatters apply them on the device
before its replay. A slot's counts are zeroed on the device when it is handed
out (a fill, no copy). Controls without an engine's steps (`steps_carry_writes`
False) apply each write at once, with a copy of its own.
"""
from __future__ import annotations

import logging
from typing import Hashable, NamedTuple, Sequence

import numpy as np
import torch

from engine.host.control_slots import first_control, uses_controls
from engine.host.params import SamplingParams
from engine.ops import upload
from engine.sampling.sampler import ControlRows, RowError
from engine.sampling.token_bitmask import BITS_PER_WORD, bitmask_words
from engine.step.engine_config import EngineConfig
from engine.step.staging import TORCH_DTYPES
from engine.step.static_buffers import StepBuffers

log = logging.getLogger(__name__)


def pack_tokens(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """[ceil(V/32)] int32: bit b of word w set for each token 32w + b in `tokens`."""
    bits = np.zeros(bitmask_words(vocab) * BITS_PER_WORD, dtype=bool)
    bits[np.asarray(tokens, dtype=np.int64)] = True
    return np.packbits(bits.reshape(-1, BITS_PER_WORD), axis=1, bitorder="little").view("<i4").reshape(-1).astype(np.int32)


class _Column(NamedTuple):
    """One field of a control write record."""

    name: str
    dtype: np.dtype
    width: int
    start: int  # byte offset in the record, 8-aligned


class ControlWrites:
    """Control state staged on the host, one fixed-size record per slot, until a step
    carries the records to the device (`pending`) and `apply` scatters them into the
    slots' rows. A slot staged twice keeps its latest record."""

    def __init__(self, capacity: int, max_logit_bias: int, words: int):
        declared = (("slot", np.int64, 1), ("penalties", np.float32, 3), ("restricted", np.bool_, 1),
                    ("bias_ids", np.int64, max_logit_bias), ("bias_values", np.float32, max_logit_bias),
                    ("prompt_words", np.int32, words), ("allowed_words", np.int32, words))
        columns, offset = [], 0
        for name, dtype, width in declared:
            columns.append(_Column(name, np.dtype(dtype), width, offset))
            offset += -(-np.dtype(dtype).itemsize * width // 8) * 8
        self.columns = tuple(columns)
        self.record_bytes = offset
        self._records = np.zeros((capacity, offset), dtype=np.uint8)
        self.staged: dict[int, int] = {}  # slot -> its record (empty: nothing to carry)

    @staticmethod
    def nbytes(capacity: int, max_logit_bias: int, words: int) -> int:
        """Bytes of `capacity` records: what a step may carry at most."""
        return capacity * ControlWrites(0, max_logit_bias, words).record_bytes

    def stage(self, slot: int, **values: np.ndarray | float | bool) -> None:
        """Record every column but `slot` for `slot` (replacing a record staged before)."""
        i = self.staged.setdefault(slot, len(self.staged))
        record = self._records[i]
        for column in self.columns:
            value = slot if column.name == "slot" else values[column.name]
            record[column.start : column.start + column.dtype.itemsize * column.width].view(column.dtype)[:] = value

    def pending(self) -> np.ndarray | None:
        """[records * record_bytes] uint8: the staged records, None when there are none."""
        return self._records[: len(self.staged)].reshape(-1) if self.staged else None

    def apply(self, records: torch.Tensor, controls: SamplingControls) -> None:
        """Scatter the records `pending` returned, now on the controls' device, into the
        slots' rows; the records are done with. Eager, before the step's replay."""
        table = records.view(len(self.staged), self.record_bytes)  # [records, record_bytes] uint8

        def column(name: str) -> torch.Tensor:  # [records, width]
            c = next(c for c in self.columns if c.name == name)
            return table[:, c.start : c.start + c.dtype.itemsize * c.width].view(TORCH_DTYPES[c.dtype])

        slots = column("slot")[:, 0]
        for name in ("penalties", "bias_ids", "bias_values", "prompt_words", "allowed_words"):
            getattr(controls, name).index_copy_(0, slots, column(name))
        controls.restricted.index_copy_(0, slots, column("restricted")[:, 0])
        self.staged.clear()


class SamplingControls:
    """The control slots of one engine and their static buffers (see the module docstring).

    The host side (`check`, `join`, `rewrite`, `leave`) is what the request
    tables call; the device side (`rows`, `count`, `recount`) runs inside
    the step of the engine's controls graphs."""

    def __init__(self, config: EngineConfig, vocab_size: int, max_rows: int, device: torch.device, *,
                 keep_unprocessed: bool = True, counted_index: torch.Tensor | None = None,
                 steps_carry_writes: bool = False):
        slots = config.max_control_slots + 1
        words = bitmask_words(vocab_size)
        self.config, self.vocab_size, self.device = config, vocab_size, device
        self.counts = torch.zeros(slots, vocab_size, dtype=torch.int32, device=device)
        self.prompt_words = torch.zeros(slots, words, dtype=torch.int32, device=device)
        self.penalties = torch.tensor([[1.0, 0.0, 0.0]] * slots, dtype=torch.float32, device=device)
        self.bias_ids = torch.zeros(slots, config.max_logit_bias, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(slots, config.max_logit_bias, dtype=torch.float32, device=device)
        self.allowed_words = torch.zeros(slots, words, dtype=torch.int32, device=device)
        self.restricted = torch.zeros(slots, dtype=torch.bool, device=device)
        # [max_rows, V] f32 (132 MB at 256 rows of V 129280), for `rows` alone: None when the head
        # keeps its logits unprocessed itself (`keep_unprocessed` False: the kernel head).
        self.unprocessed = (torch.zeros(max_rows, vocab_size, dtype=torch.float32, device=device)
                            if keep_unprocessed else None)
        # Per sample row of the last replay: the flat counts index (slot * V + token) it added 1 to, -1 none.
        # An engine's lives among the step's outputs (`StepBuffers.output_area`), which come back in one copy.
        self.counted_index = (torch.full((max_rows,), -1, dtype=torch.int64, device=device) if counted_index is None
                              else counted_index)
        self._free = list(range(slots - 1, 0, -1))
        # What joins and changes wrote, until a step carries it (or at once, see the module doc).
        self.writes = ControlWrites(slots - 1, config.max_logit_bias, words)
        self.steps_carry_writes = steps_carry_writes
        self._prompt_words = np.zeros((slots, words), dtype=np.int32)  # the host's copy, for rewrites
        # Host side, for undoing: the flat indices the last finished step added to; those of
        # the parts of a step in flight, and the rows of a replayed part not collected yet.
        self.last_step: np.ndarray | None = None
        self.steps = 0  # finished steps that counted tokens: a rollback takes back only the latest
        self._parts: list[np.ndarray] | None = None
        self._uncollected = 0
        log.info("sampling controls: %s", self.describe())

    # -- memory -----------------------------------------------------------------

    def static_tensors(self) -> dict[str, torch.Tensor]:
        names = ("counts", "prompt_words", "penalties", "bias_ids", "bias_values", "allowed_words", "restricted",
                 "unprocessed", "counted_index")
        return {f"controls.{name}": getattr(self, name) for name in names if getattr(self, name) is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.static_tensors().values())

    def describe(self) -> str:
        """One line: the slots, the counts buffer and the total, e.g. for a log."""
        s, v = self.counts.shape
        return (f"{s - 1} slots; penalty counts {s} x {v} int32 = {self.counts.numel() * 4 / 2**20:.1f} MiB; "
                f"all control buffers {self.nbytes / 2**20:.1f} MiB")

    # -- host side: slots ---------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def check(self, request_id: Hashable, params: SamplingParams, prompt_tokens: Sequence[int] | None,
              num_generated: int, holds_slot: bool) -> bool:
        """Whether the request needs a slot; ValueError naming the request, the
        field and the value when the engine cannot honour its controls,
        RuntimeError when it needs a new slot and none is free. Changes nothing."""
        if not self.check_params(request_id, params):
            return False
        where = f"request {request_id!r}"
        if not holds_slot:
            if params.repetition_penalty != 1 and prompt_tokens is None:
                raise ValueError(f"{where}: repetition_penalty={params.repetition_penalty!r}: needs the prompt's "
                                 "tokens (prompt_tokens is None)")
            if params.has_penalties and num_generated > 0:
                raise ValueError(f"{where}: {first_control(params)}: penalties must be set before the first "
                                 f"generated token (the request has {num_generated}; their counts are unknown)")
            prompt = np.asarray(() if prompt_tokens is None else prompt_tokens, dtype=np.int64)
            outside = np.flatnonzero((prompt < 0) | (prompt >= self.vocab_size))
            if len(outside):  # the prompt's tokens are packed into the slot's prompt words
                j = int(outside[0])
                raise ValueError(f"{where}: prompt_tokens[{j}]={int(prompt[j])}: outside the vocabulary "
                                 f"[0, {self.vocab_size})")
            if not self._free:
                raise RuntimeError(f"{where}: all {self.config.max_control_slots} sampling-control slots are in use "
                                   "(EngineConfig.max_control_slots)")
        return True

    def check_params(self, request_id: Hashable, params: SamplingParams) -> bool:
        """Whether the request uses controls; ValueError naming the request, the
        field and the value when one is over a cap or outside the vocabulary."""
        if not uses_controls(params):
            return False
        where = f"request {request_id!r}"
        for name, tokens, cap in (("logit_bias", tuple(params.logit_bias or ()), "max_logit_bias"),
                                  ("allowed_token_ids", params.allowed_token_ids or (), "max_allowed_token_ids")):
            limit = getattr(self.config, cap)
            if len(tokens) > limit:
                raise ValueError(f"{where}: {name} has {len(tokens)} entries, over EngineConfig.{cap}={limit}")
            for token in tokens:
                if token >= self.vocab_size:
                    raise ValueError(f"{where}: {name}: token {token} is outside the vocabulary ({self.vocab_size})")
        return True

    def join(self, params: SamplingParams, prompt_tokens: Sequence[int] | None) -> int:
        """A slot for a checked request: its counts zeroed (on the device, now), its
        prompt, penalties, bias and allowed set staged for the next step. Returns the slot."""
        slot = self._free.pop()
        self.counts[slot].zero_()
        prompt = np.zeros(0, np.int64) if prompt_tokens is None else np.asarray(prompt_tokens, dtype=np.int64)
        self._prompt_words[slot] = pack_tokens(prompt, self.vocab_size)
        self.rewrite(slot, params)
        return slot

    def rewrite(self, slot: int, params: SamplingParams) -> None:
        """New penalties, bias and allowed set for a slot (its counts and prompt stay), staged
        for the next step."""
        bias = params.logit_bias or {}
        ids = np.zeros(self.config.max_logit_bias, np.int64)
        values = np.zeros(self.config.max_logit_bias, np.float32)
        ids[: len(bias)] = list(bias.keys())
        values[: len(bias)] = list(bias.values())
        allowed = params.allowed_token_ids
        self.writes.stage(slot, penalties=np.array([params.repetition_penalty, params.frequency_penalty,
                                                    params.presence_penalty], np.float32),
                          restricted=allowed is not None, bias_ids=ids, bias_values=values,
                          prompt_words=self._prompt_words[slot],
                          allowed_words=pack_tokens(np.asarray(allowed or (), np.int64), self.vocab_size))
        if not self.steps_carry_writes:
            self.apply_writes(upload(self.writes.pending(), self.device))

    def apply_writes(self, records: torch.Tensor) -> None:
        """Scatter the staged writes, `writes.pending()` brought to the device, into the slots."""
        self.writes.apply(records, self)

    def leave(self, slot: int) -> None:
        """Give a slot back; its state is rewritten when it is handed out again."""
        if not 1 <= slot < self.counts.shape[0] or slot in self._free:
            raise ValueError(f"slot={slot}: not an allocated sampling-control slot")
        self._free.append(slot)

    # -- device side: inside the step -------------------------------------------

    def rows(self, buffers: StepBuffers, bucket: int) -> ControlRows:
        """The controls of the bucket's sample rows, gathered from their slots, for the
        sampler to apply; capture-safe. Row j of a request counts the drafts its rows
        0..j-1 verify as generated."""
        if self.unprocessed is None:
            raise RuntimeError("SamplingControls.rows: built with keep_unprocessed=False (a head that keeps its "
                               "logits unprocessed), so there is no copy for the torch sampler's in-place controls")
        b = buffers
        rows = b.rows_for(bucket)
        slot = self.row_slots(b, bucket)  # [rows]
        counts = self.counts[slot]  # [rows, V] int32, a copy
        for d in range(1, b.rows_per_req):
            # Row r at local step s >= d: the draft of row r - d (same request) was generated before it.
            earlier = b.inputs.local_step[:rows] >= d  # [rows] bool
            source = (torch.arange(rows, device=counts.device) - d).clamp(min=0)
            draft = b.resolved_drafts[:rows][source]  # [rows] int64, -1 = none
            counts.scatter_add_(1, draft.clamp(0, self.vocab_size - 1)[:, None],
                                (earlier & (draft >= 0)).to(torch.int32)[:, None])
        return ControlRows(counts=counts, prompt_words=self.prompt_words[slot], penalties=self.penalties[slot],
                           bias_ids=self.bias_ids[slot], bias_values=self.bias_values[slot],
                           allowed_words=self.allowed_words[slot], restricted=self.restricted[slot],
                           unprocessed=self.unprocessed[:rows])

    def row_slots(self, buffers: StepBuffers, bucket: int) -> torch.Tensor:
        """[rows] int64: the control slot of each sample row of the bucket."""
        f = buffers.inputs
        rows = buffers.rows_for(bucket)
        return f.control_slots[:bucket][f.row_to_req[:rows]]

    def count(self, buffers: StepBuffers, config: EngineConfig, bucket: int) -> None:
        """Add the tokens the step emits to their requests' counts; capture-safe.
        A request emits the tokens of its rows up to its accepted drafts plus
        one, none when any of its rows failed; slot 0 counts nothing."""
        b, f = buffers, buffers.inputs
        rows = b.rows_for(bucket)
        req = f.row_to_req[:rows]
        step = f.local_step[:rows]
        real = step < b.rows_per_req  # padding rows lie past every real row
        failed_rows = (b.out.error[:rows] != RowError.OK) & real
        failed = torch.zeros(bucket, dtype=torch.int32, device=req.device).index_add_(
            0, req, failed_rows.to(torch.int32)) > 0  # [bucket]
        accepted = b.num_accepted[:bucket][req] if config.max_draft_tokens else torch.zeros_like(step)
        slot = f.control_slots[:bucket][req]
        emits = real & (step <= accepted) & ~failed[req] & (slot > 0)
        token = b.out.tokens[:rows]
        if config.max_draft_tokens and config.verify_mode == "rejection":
            token = torch.where(b.emitted[:rows] >= 0, b.emitted[:rows], token)
        index = torch.where(emits, slot * self.vocab_size + token, torch.full_like(slot, -1))
        self.counted_index[:rows].copy_(index)
        self._add(self.counted_index[:rows], 1)

    def _add(self, index: torch.Tensor, sign: int) -> None:
        """counts.flat[index] += sign for every index >= 0 (-1: nothing); capture-safe."""
        counted = index >= 0
        self.counts.view(-1).scatter_add_(0, index.clamp(min=0), counted.to(torch.int32) * sign)

    # -- host side: undoing ---------------------------------------------------------

    def start_step(self) -> None:
        """A step of the controls graphs begins (before its first replay)."""
        self._parts = []

    def replayed(self, rows: int) -> None:
        """A part of the step ran over `rows` sample rows: its counts are on the device."""
        self._uncollected = rows

    def collected(self, counted_index: np.ndarray) -> None:
        """After the part's output copy: what it counted, per sample row (-1 none), as the
        step's output copy brought it."""
        self._parts.append(counted_index[counted_index >= 0])
        self._uncollected = 0

    def finish_step(self, dropped: np.ndarray) -> None:
        """The step went through. `dropped` [counted tokens] bool, in row order: tokens of
        requests that failed after the graph (their prompt logprobs) and emit nothing,
        taken back now; the rest is kept for a rollback."""
        index = np.concatenate(self._parts) if self._parts else np.zeros(0, np.int64)
        self._take_back(index[dropped])
        self.last_step = index[~dropped]
        self.steps += 1
        self._parts = None

    def counted_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots, tokens) of what the step in flight counted so far, in row order."""
        index = np.concatenate(self._parts) if self._parts else np.zeros(0, np.int64)
        return index // self.vocab_size, index % self.vocab_size

    def _take_back(self, index: np.ndarray) -> None:
        if len(index):
            self._add(torch.as_tensor(index, dtype=torch.int64, device=self.device), -1)

    def check_rollback(self, steps: int) -> None:
        """ValueError unless `rollback_to(steps)` can undo what ran since the checkpoint that
        saw `steps` (a step in flight, or at most one finished step); changes nothing."""
        if self._parts is None and self.last_step is not None and self.steps > steps + 1:
            raise ValueError(f"checkpoint: a rollback can undo one step of the penalty counts, {self.steps - steps} "
                             "ran since this checkpoint was taken (take one before every step)")

    def rollback_to(self, steps: int) -> None:
        """Undo a step in flight (it raised), or the last finished one if it ran
        after the checkpoint that saw `steps` (`check_rollback` first)."""
        self.check_rollback(steps)
        if self._parts is not None:
            if self._uncollected:
                self._add(self.counted_index[: self._uncollected], -1)
            for index in self._parts:
                self._take_back(index)
            self._parts, self._uncollected = None, 0
            return
        if self.steps == steps or self.last_step is None:
            return
        self._take_back(self.last_step)
        self.last_step = None
        self.steps = steps
