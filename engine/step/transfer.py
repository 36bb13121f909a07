"""The step's way back to the host: one packed device-to-host copy.

Every output of a step (the sampler's `SampleOutput`, the drafts accepted per
request, rejection mode's emitted tokens, the penalty counts' flat indices)
lives in ONE packed device buffer, `OutputArea.packed`, as typed views: the
graphs write them in place as before. After the replay one copy brings the
bytes the step needs into a pinned host twin, an event is recorded behind it,
and the host reads numpy views of the twin once the event has completed
(`OutputCopy.fetch`, `HostOutputs.wait`). No other read of the device follows
a step, unless one of its rows needs the exact path (vocab-parallel ties).

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

from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import torch

from engine.sampling.sample_output import SampleOutput

_ALIGN = 8  # bytes: every view starts 8-aligned, and the copy moves whole int64 words
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
          torch.bool: np.bool_}


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
