"""The static buffers of the captured step: one typed object, fixed addresses.

Everything a captured graph reads or writes lives here, sized once for the
largest bucket; a bucket's graph works on leading slices. Per step the host
packs every index and parameter array into ONE staging area (pinned on CUDA)
and ONE copy moves it into the device twin, whose typed views are the step's
inputs. The per-step fields are declared once (engine/host/step_fields.py)
and handed to `allocate`: the packed layout, the staging views, the typed
device views, the padding values and the sampler's view derive from it.

Why padding is safe: a padding sample row gets gather index -1, outside the
hidden-state source, so it reads a zero row (never stray memory or a stale
row of the previous step), and points at a request slot with neutral
parameters, so its logits and draw stay finite and are then cut off.

The way back to the host is one packed device-to-host copy. Every output of a step (the sampler's `SampleOutput`, the drafts accepted per
request, rejection mode's emitted tokens, the penalty counts' flat indices)
lives in ONE packed device buffer, `OutputArea.packed`, as typed views: the
graphs write them in place as before. After the replay one copy brings the
bytes the step needs into a pinned host twin, an event is recorded behind it,
and the host reads numpy views of the twin once the event has completed
(`OutputCopy.fetch`, `HostOutputs.wait`). No other read of the device follows
a step.

The twins are double-buffered: the copy of step N + 1 goes into the other one,
so a host that has not yet read step N's results when it launches step N + 1
still finds them intact. What is read is copied out of the twin
(`HostOutputs.rows`), so nothing handed on refers to pinned memory that the
step after next overwrites.

The host-to-device way is `StepBuffers.load`: the per-step fields packed into
one pinned staging area, with the control writes staged since the last step
(`engine.step.control_state`) and a step's token bitmask carried in the same copy.
What still travels apart: rejection mode's draft distributions ([k, V] a
request, too large to stage every step), the row index of a step whose hidden
states are not in the engine's source, and, after the copy back, the logprob
and rank of rejection mode's residual draws (a second read, only on a step
that emits one).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import NamedTuple, Sequence

import numpy as np
import torch

from engine.host.step_fields import StepField
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from engine.step.staging import SAMPLE_STAGE, STAGED_AS, TORCH_DTYPES, StepArrays, StepInputs, check_declaration


_ALIGN = 8  # bytes: every field and output view starts 8-aligned (any dtype view is legal), and copies move int64 words

# --- the outputs: one packed area, one copy back ------------------------------------------

_NUMPY = {torch_dtype: numpy_dtype.type for numpy_dtype, torch_dtype in TORCH_DTYPES.items()}


class _Slot(NamedTuple):
    """Where one output lives in the packed buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset
    nbytes: int


@dataclass
class OutputArea:
    """Every output of the step in one packed device buffer, as typed full-size views.

    The sampler's outputs come first in the order `SampleOutput.allocate` declares
    them (a field added there is laid out here without an edit), the wide ones
    (`[rows, N]` top-N) last, so the bytes a step without top logprobs needs are
    the leading `narrow_bytes`."""

    packed: torch.Tensor  # [nbytes] uint8 on the device
    out: SampleOutput  # [max_rows] views (top_ids / top_logprobs [max_rows, N])
    num_accepted: torch.Tensor  # [max_reqs] int64: drafts accepted per request
    emitted: torch.Tensor  # [max_rows] int64: rejection mode's emitted token per row (-1 = none)
    counted_index: torch.Tensor  # [max_rows] int64: the flat penalty-count index a row added 1 to (-1 = none)
    slots: tuple[_Slot, ...]
    narrow_bytes: int  # the leading bytes that hold every output but the [rows, N] ones

    @classmethod
    def allocate(cls, max_rows: int, max_reqs: int, num_top: int, device: torch.device) -> OutputArea:
        """The packed outputs for `max_rows` sample rows and `max_reqs` requests, `num_top`
        top-N columns; emitted and counted_index hold -1, the rest 0."""
        shapes = SampleOutput.allocate(1, num_top, "meta")  # the declaration's dtypes and widths
        declared = [(f.name, getattr(shapes, f.name)) for f in fields(SampleOutput)]
        wanted = [(name, like.dtype, (max_rows, *like.shape[1:])) for name, like in declared]
        wanted += [("num_accepted", torch.int64, (max_reqs,)), ("emitted", torch.int64, (max_rows,)),
                   ("counted_index", torch.int64, (max_rows,))]
        wanted.sort(key=lambda item: len(item[2]) > 1)  # stable: the narrow ones first, in declared order
        slots, offset, narrow = [], 0, 0
        for name, dtype, shape in wanted:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            slots.append(_Slot(name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
            if len(shape) == 1:
                narrow = offset
        packed = torch.zeros(offset, dtype=torch.uint8, device=device)
        views = {s.name: packed[s.start : s.start + s.nbytes].view(s.dtype).view(s.shape) for s in slots}
        views["emitted"].fill_(-1)
        views["counted_index"].fill_(-1)
        return cls(packed=packed, out=SampleOutput(**{name: views[name] for name, _ in declared}),
                   num_accepted=views["num_accepted"], emitted=views["emitted"],
                   counted_index=views["counted_index"], slots=tuple(slots), narrow_bytes=narrow)


class HostOutputs:
    """One step's outputs in a pinned host twin: `wait()`, then `rows(name, count)`."""

    def __init__(self, views: dict[str, np.ndarray], event: torch.cuda.Event | None, complete: frozenset[str]):
        self._views, self._event, self._complete = views, event, complete
        self._waited = event is None

    def wait(self) -> None:
        """Block until the copy has landed (the step's one wait on the device)."""
        if not self._waited:
            self._event.synchronize()
            self._waited = True

    def rows(self, name: str, count: int) -> np.ndarray:
        """A copy of the leading `count` entries of output `name` (waits first)."""
        return self.take(count, (name,))[0]

    def take(self, count: int, names: tuple[str, ...]) -> list[np.ndarray]:
        """`rows(name, count)` of each of `names`, in order."""
        missing = [name for name in names if name not in self._complete]
        if missing:
            raise ValueError(f"output {missing[0]!r}: not fetched (fetch(wide=True) brings the [rows, N] outputs)")
        if not self._waited:
            self.wait()
        return [self._views[name][:count].copy() for name in names]


class OutputCopy:
    """The host side of `OutputArea`: two pinned twins used in turn, an event each."""

    def __init__(self, area: OutputArea):
        self.area = area
        pinned = area.packed.device.type == "cuda"
        nbytes = area.packed.numel()
        self._twins = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self._events = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._views = [self._host_views(twin) for twin in self._twins]
        self._next = 0
        self.fetches = 0  # copies issued (each one a device-to-host copy)
        # The outputs a copy brings, all of them (wide) or the [rows] ones.
        self._complete = {wide: frozenset(s.name for s in area.slots if s.start + s.nbytes <= (
            area.packed.numel() if wide else area.narrow_bytes)) for wide in (False, True)}

    def _host_views(self, twin: torch.Tensor) -> dict[str, np.ndarray]:
        raw = twin.numpy()
        return {s.name: raw[s.start : s.start + s.nbytes].view(_NUMPY[s.dtype]).reshape(s.shape)
                for s in self.area.slots}

    def fetch(self, *, wide: bool) -> HostOutputs:
        """Issue the step's one device-to-host copy (every output; the [rows, N] ones only
        with `wide`) into the next twin, and record its event. Returns at once on CUDA."""
        i = self._next
        self._next ^= 1
        nbytes = self.area.packed.numel() if wide else self.area.narrow_bytes
        event = self._events[i]
        # As int64 words: torch's CPU byte copy goes through a parallel path that costs
        # milliseconds on a busy 2-core machine.
        self._twins[i][:nbytes].view(torch.int64).copy_(self.area.packed[:nbytes].view(torch.int64),
                                                        non_blocking=event is not None)
        if event is not None:
            event.record()
        self.fetches += 1
        return HostOutputs(self._views[i], event, self._complete[wide])


# --- the buffers ---------------------------------------------------------------------------


def _padding_rules(real_reqs: int, bucket: int, rows_per_req: int) -> dict[str, int]:
    """The value of each padding rule in a step of `real_reqs` requests.

    Padding rows point at a padding request slot when there is one (neutral
    parameters); when every slot is real they reuse slot 0, harmless since
    their gathered row is zero and their result is cut off. A padding row's
    local_step lies past every real row of its request (>= rows_per_req), so
    per-request reductions over rows (accepted drafts) never count it even
    when it shares request slot 0.
    """
    return {"padding request": real_reqs if real_reqs < bucket else 0, "past request rows": rows_per_req}


class _Staged(NamedTuple):
    """A declared field with a fixed padding value, as `load` stages it (precomputed at allocate)."""

    name: str
    per_row: bool
    padding: int | float | bool
    row_numbers: bool  # the host value lists the rows where the bool field is True
    bits: bool  # the host value is viewed as the staged dtype (uint64 -> int64)
    view: np.ndarray  # full-size numpy view into the staging area


class _RulePadded(NamedTuple):
    """A per-row field whose padding depends on the step: rewritten up to the bucket every step."""

    name: str
    rule: str  # one of PADDING_RULES
    view: np.ndarray


@dataclass
class StepBuffers:
    """Static tensors of the step, for `max_reqs` request slots and `max_rows` sample-row slots."""

    max_reqs: int
    max_rows: int
    rows_per_req: int  # 1 + max_draft_tokens
    device: torch.device
    source: torch.Tensor  # [max_source_rows, H] model dtype: the hidden-state source
    hidden: torch.Tensor  # [max_rows, H] gathered sample rows
    logits: torch.Tensor  # [max_rows, V] fp32
    out: SampleOutput  # [max_rows] results
    num_accepted: torch.Tensor  # [max_reqs] int64: drafts accepted per request
    emitted: torch.Tensor  # [max_rows] int64: rejection mode's emitted token per row (-1 = none)
    # The three above (and the penalty counts' indices) are views into this one packed buffer,
    # which one copy a step brings back to the host (`OutputCopy` above).
    output_area: OutputArea
    output_copy: OutputCopy
    resolved_drafts: torch.Tensor  # [max_rows] int64: the draft each row verified (staged or from the pool)
    pool_tokens: torch.Tensor  # [(pool_slots + 1) * max_draft] int64; the extra slot absorbs "no write"
    pool_logprobs: torch.Tensor  # same shape, f32
    draft_probs: torch.Tensor | None  # [max_rows, V] f32, rejection mode only: q of each row's draft
    # [max_rows, ceil(V / 32)] int32 packed allowed-token bits, written only by steps that restrict a row
    token_bitmask: torch.Tensor | None
    packed: torch.Tensor  # [nbytes] uint8 on the device: every per-step field
    staging: torch.Tensor  # [nbytes] uint8 on the host (pinned on CUDA)
    inputs: StepInputs  # typed device views into `packed`, full size, one attribute per field
    staged: dict[str, np.ndarray]  # numpy views into `staging`, full size
    _staging_plan: tuple[_Staged, ...]
    _rule_padded: tuple[_RulePadded, ...]
    _row_count: str  # the first declared per-row field: its length is the step's sample rows
    _req_count: str  # the first declared per-request field: its length is the step's requests
    _sampler_views: tuple[tuple[str, bool, torch.Tensor], ...]  # (name, per row, device view) of RowParams
    _copy_done: torch.cuda.Event | None = None
    # Bytes of the declared fields; past them, room for `carried_bytes` of writes carried along.
    _field_bytes: int = 0
    # Per staged field: leading entries that may hold non-padding values.
    _high_water: dict[str, int] = field(default_factory=dict)
    _views: dict[tuple[str, int], object] = field(default_factory=dict)  # `params` and `outputs`, per bucket

    @classmethod
    def allocate(
        cls,
        *,
        step_fields: Sequence[StepField],
        max_reqs: int,
        max_draft_tokens: int,
        max_source_rows: int,
        hidden_size: int,
        vocab_size: int,
        max_logprobs: int,
        max_stop_ids: int,
        source_dtype: torch.dtype,
        device: torch.device,
        pool_slots: int = 0,
        draft_probs: bool = False,
        token_bitmask_words: int = 0,
        carried_bytes: int = 0,
    ) -> StepBuffers:
        """Static buffers for the declared per-step fields (and the fixed
        ones: source, hidden, logits, outputs, draft pool; a token bitmask of
        `token_bitmask_words` int32 words per row unless 0); raises ValueError
        naming a field the buffers cannot stage. `carried_bytes`: room past the
        fields for what `load(carried=...)` brings along (staged control writes, a
        step's token bitmask)."""
        declared = tuple(step_fields)
        rows_per_req = 1 + max_draft_tokens
        max_rows = max_reqs * rows_per_req
        widths = {"stop": max_stop_ids, "draft": max(max_draft_tokens, 1)}
        check_declaration(declared, widths)
        layout, offset = [], 0
        for f in declared:
            width = widths[f.width] if isinstance(f.width, str) else f.width
            dtype = STAGED_AS.get(np.dtype(f.dtype), np.dtype(f.dtype))
            nbytes = (max_rows if f.per == "row" else max_reqs) * width * dtype.itemsize
            layout.append((f, width, dtype, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        pinned = device.type == "cuda"
        field_bytes = offset
        offset += -(-carried_bytes // _ALIGN) * _ALIGN
        staging = torch.zeros(offset, dtype=torch.uint8, pin_memory=pinned)
        packed = torch.zeros(offset, dtype=torch.uint8, device=device)
        views, staged, plan, rule_padded = {}, {}, [], []
        host_bytes = staging.numpy()
        allocated = _padding_rules(0, max_reqs, rows_per_req)  # no slot is real yet
        for f, width, dtype, start, nbytes in layout:
            shape = (-1,) if width == 1 and not isinstance(f.width, str) else (-1, width)
            views[f.name] = packed[start : start + nbytes].view(TORCH_DTYPES[dtype]).view(shape)
            staged[f.name] = host_bytes[start : start + nbytes].view(dtype).reshape(shape)
            if isinstance(f.padding, str):
                staged[f.name][...] = allocated[f.padding]
                rule_padded.append(_RulePadded(f.name, f.padding, staged[f.name]))
            else:
                staged[f.name][...] = f.padding
                plan.append(_Staged(f.name, f.per == "row", f.padding, f.host_form == "row numbers",
                                    dtype != np.dtype(f.dtype), staged[f.name]))
        packed.copy_(staging)
        inputs = StepInputs.of(views)
        sampler_views = tuple((f.name, f.per == "row", views[f.name]) for f in declared if f.stage == SAMPLE_STAGE)
        # Draft-info pool (docs/contract.md §1.3): slot 0 is padding and never written:
        # token V - 1, logprob 0 in its first entry and -inf after, so reading
        # it biases nothing. Writes aimed at slot 0 land in the extra last slot.
        width = max(max_draft_tokens, 1)
        pool_tokens = torch.full(((pool_slots + 1) * width,), -1, dtype=torch.int64, device=device)
        pool_logprobs = torch.full(((pool_slots + 1) * width,), -float("inf"), device=device)
        pool_tokens[:width] = vocab_size - 1
        pool_logprobs[0] = 0.0
        outputs = OutputArea.allocate(max_rows, max_reqs, max_logprobs, device)
        return cls(
            max_reqs=max_reqs,
            max_rows=max_rows,
            rows_per_req=rows_per_req,
            device=device,
            source=torch.zeros(max_source_rows, hidden_size, dtype=source_dtype, device=device),
            hidden=torch.zeros(max_rows, hidden_size, dtype=source_dtype, device=device),
            logits=torch.zeros(max_rows, vocab_size, dtype=torch.float32, device=device),
            out=outputs.out,
            num_accepted=outputs.num_accepted,
            emitted=outputs.emitted,
            output_area=outputs,
            output_copy=OutputCopy(outputs),
            resolved_drafts=torch.full((max_rows,), -1, dtype=torch.int64, device=device),
            pool_tokens=pool_tokens,
            pool_logprobs=pool_logprobs,
            draft_probs=torch.zeros(max_rows, vocab_size, device=device) if draft_probs else None,
            token_bitmask=(torch.full((max_rows, token_bitmask_words), -1, dtype=torch.int32, device=device)
                           if token_bitmask_words else None),
            packed=packed,
            staging=staging,
            inputs=inputs,
            staged=staged,
            _staging_plan=tuple(plan),
            _rule_padded=tuple(rule_padded),
            _row_count=next(f.name for f in declared if f.per == "row"),
            _req_count=next(f.name for f in declared if f.per == "req"),
            _sampler_views=sampler_views,
            _copy_done=torch.cuda.Event() if pinned else None,
            _field_bytes=field_bytes,
            _high_water={f.name: 0 for f in declared},
        )

    def rows_for(self, bucket: int) -> int:
        """Sample-row capacity of a bucket: every request may verify max drafts."""
        return bucket * self.rows_per_req

    def static_tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer the captured step touches, by name (for address checks)."""
        named = {
            "source": self.source,
            "hidden": self.hidden,
            "logits": self.logits,
            "packed": self.packed,
            "num_accepted": self.num_accepted,
            "emitted": self.emitted,
            "resolved_drafts": self.resolved_drafts,
            "pool_tokens": self.pool_tokens,
            "pool_logprobs": self.pool_logprobs,
        }
        if self.draft_probs is not None:
            named["draft_probs"] = self.draft_probs
        if self.token_bitmask is not None:
            named["token_bitmask"] = self.token_bitmask
        named.update({f"out.{k}": v for k, v in vars(self.out).items()})
        return named

    def load(self, arrays: StepArrays, bucket: int, carried: Sequence[np.ndarray] = ()) -> list[torch.Tensor]:
        """Stage one step's host arrays (real entries, then padding up to the
        bucket) and issue the single host-to-device copy.

        `arrays` has one attribute per declared field (`StepArrays`, or any
        object with those names), in batch order; None stages padding only.
        The first declared per-row and per-request fields (never None) give
        the step's sample rows and requests. `carried`: byte arrays (uint8) that
        travel in the same copy, after the fields; returns their device twins
        ([len] uint8 each, 8-aligned), to be read by device work queued after it."""
        rows = len(getattr(arrays, self._row_count))
        n = len(getattr(arrays, self._req_count))
        cap_reqs, cap_rows = bucket, bucket * self.rows_per_req
        if n > cap_reqs or rows > cap_rows:
            raise ValueError(f"bucket={bucket}: holds {cap_reqs} requests / {cap_rows} rows, step has {n} / {rows}")
        starts = np.cumsum([0] + [-(-len(c) // _ALIGN) * _ALIGN for c in carried]) + self._field_bytes
        if starts[-1] > self.staging.numel():
            raise ValueError(f"carried={[len(c) for c in carried]} bytes: over the "
                             f"{self.staging.numel() - self._field_bytes} allocated (carried_bytes)")
        if self._copy_done is not None:
            # The previous step's copy may still read the staging area.
            self._copy_done.synchronize()
        step_padding = _padding_rules(n, cap_reqs, self.rows_per_req)
        for name, rule, view in self._rule_padded:
            view[:rows] = getattr(arrays, name)
            view[rows:cap_rows] = step_padding[rule]
        # A fixed padding value: write the real entries, then reset only what
        # an earlier step left past them. Everything beyond a field's
        # high-water mark holds its padding already (allocate wrote it,
        # fill_garbage raises the marks), so a steady batch pays nothing for
        # padding.
        hw = self._high_water
        for name, per_row, padding, row_numbers, bits, view in self._staging_plan:
            real = getattr(arrays, name)
            count = rows if per_row else n
            if real is None:
                count = 0
            elif row_numbers:
                view[:count] = False
            else:
                view[:count] = real.view(view.dtype) if bits else real
            if hw[name] > count:
                view[count : hw[name]] = padding
            hw[name] = count
            if row_numbers and real is not None:
                view[real] = True
        host = self.staging.numpy()
        for start, piece in zip(starts, carried):
            host[start : start + len(piece)] = piece
        end = int(starts[-1])
        non_blocking = self._copy_done is not None
        # Copied as int64 words: torch's CPU byte copy goes through a parallel
        # path that costs milliseconds on a busy 2-core machine.
        self.packed[:end].view(torch.int64).copy_(self.staging[:end].view(torch.int64), non_blocking=non_blocking)
        if self._copy_done is not None:
            self._copy_done.record()
        return [self.packed[start : start + len(piece)] for start, piece in zip(starts, carried)]

    def params(self, bucket: int) -> RowParams:
        """The sampler's view of a bucket: leading slices of the sample-stage fields."""
        params = self._views.get(("params", bucket))
        if params is None:  # views of static tensors: made once per bucket
            reqs, rows = bucket, bucket * self.rows_per_req
            params = self._views[("params", bucket)] = RowParams(
                **{name: view[: rows if per_row else reqs] for name, per_row, view in self._sampler_views})
        return params

    def outputs(self, rows: int) -> SampleOutput:
        """Leading `rows` of the sampler's output buffers (views, no copy)."""
        out = self._views.get(("outputs", rows))
        if out is None:
            out = self._views[("outputs", rows)] = SampleOutput(**{k: v[:rows] for k, v in vars(self.out).items()})
        return out

    def fill_garbage(self, generator: torch.Generator | None = None) -> None:
        """Test hook: scribble over every staged field and output buffer, as a
        previous step with other requests would have left them."""
        for name, view in self.staged.items():
            view[...] = np.random.default_rng(0).integers(-5, 2**20, view.shape).astype(view.dtype)
            self._high_water[name] = len(view)
        self.packed.copy_(self.staging)
        scribbled = (self.hidden, self.logits, self.num_accepted, self.emitted, *vars(self.out).values())
        for tensor in scribbled + ((self.token_bitmask,) if self.token_bitmask is not None else ()):
            if tensor.dtype == torch.bool:
                tensor.fill_(True)
            elif tensor.is_floating_point():
                tensor.normal_(generator=generator).mul_(1e3)
            else:
                tensor.random_(0, 2**20, generator=generator)
