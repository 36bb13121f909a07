"""Capture-time safety check: reject what would break (or silently freeze) a CUDA graph.

A captured graph records device work only. Anything the step does on the host
(reading a tensor value, sizing an output from tensor contents, drawing from a
generator's state, reallocating a buffer the graph points at) either makes
capture fail on CUDA or is baked in at capture time and never redone by a
replay. On a machine without a GPU nothing would notice, so the CPU twin of
capture runs the step once under this check, which raises `CaptureSafetyError`
naming the op and the reason.

Two layers, because some host reads never reach the dispatcher on CPU
(`.tolist()`, `.numpy()`, `.cpu()` of a CPU tensor is a no-op):
- a TorchFunctionMode rejects the Python-level host reads by name;
- a TorchDispatchMode rejects aten ops by what they do: host syncs, outputs
  whose shape depends on tensor values, boolean-mask indexing, seeded RNG,
  device-to-host copies, and writes that resize or rebind a static buffer.
After the step, every static buffer must still have its data_ptr, shape and
stride (`check_addresses`), which also catches reallocations the op-level
check cannot see.

On a CUDA engine the dispatch layer adds the rules a CPU run cannot see, for
every op inside the captured region:
- no CPU tensor is read by, or mixed into, a device op (a 0-dim CPU tensor is
  legal in eager CUDA: its value is read on the host at capture and frozen);
- no host-to-device copy from pageable memory (only a non-blocking copy from
  pinned memory is capturable);
- every op's output lives on the engine's device: host work is not recorded
  by a graph, so a replay would never redo it.
Tensors built from host data are caught by name in either case.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class CaptureSafetyError(RuntimeError):
    """The step does something a captured CUDA graph cannot reproduce."""


def _storage_key(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage: its data pointer, or for a fake tensor
    (no memory; every data pointer reads 0) the storage object itself."""
    storage = tensor.untyped_storage()
    return storage._cdata if isinstance(tensor, FakeTensor) else storage.data_ptr()


@dataclass(frozen=True)
class BufferAddress:
    """Where a static buffer lives; a captured graph holds exactly these pointers."""

    data_ptr: int  # a fake tensor's: its storage's identity plus the byte offset
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> BufferAddress:
        if isinstance(tensor, FakeTensor):
            pointer = _storage_key(tensor) + tensor.storage_offset() * tensor.element_size()
        else:
            pointer = tensor.data_ptr()
        return cls(pointer, tuple(tensor.shape), tuple(tensor.stride()))


def record_addresses(static_tensors: Mapping[str, torch.Tensor]) -> dict[str, BufferAddress]:
    """Snapshot the address, shape and stride of every static buffer."""
    return {name: BufferAddress.of(tensor) for name, tensor in static_tensors.items()}


def check_addresses(
    static_tensors: Mapping[str, torch.Tensor], recorded: Mapping[str, BufferAddress]
) -> None:
    """Raise CaptureSafetyError if any static buffer moved, changed shape or stride."""
    if set(static_tensors) != set(recorded):
        raise CaptureSafetyError(
            f"static buffer set changed: recorded {sorted(recorded)}, now {sorted(static_tensors)}"
        )
    for name, tensor in static_tensors.items():
        now = BufferAddress.of(tensor)
        if now != recorded[name]:
            raise CaptureSafetyError(
                f"static buffer {name!r} changed from {recorded[name]} to {now}: a captured "
                "graph keeps reading and writing the old address"
            )


_HOST_SYNC = (
    "copies a tensor value to the host (.item(), .tolist(), bool()/int()/float() of a tensor, "
    "`if tensor:`): a host sync, forbidden during CUDA capture and not redone by a replay; "
    "keep the value on the device (torch.where, masked_fill, clamp)"
)
_HOST_READ = (
    "reads tensor data on the host: on CUDA a device-to-host sync, forbidden during capture "
    "and not redone by a replay; keep the computation on the device"
)
_HOST_DATA = (
    "builds a tensor from host data: on CUDA a pageable host-to-device copy (not capturable) "
    "whose value a replay would never refresh; pass the values in through a static buffer"
)

# Python-level host reads. On CPU most of these never reach the dispatcher
# (`.cpu()` returns self, `.numpy()` shares memory), so they are caught by name.
_HOST_INTENT: dict[Any, tuple[str, str]] = {
    torch.Tensor.item: ("Tensor.item()", _HOST_SYNC),
    torch.Tensor.tolist: ("Tensor.tolist()", _HOST_SYNC),
    torch.Tensor.__bool__: ("bool(tensor)", _HOST_SYNC),
    torch.Tensor.__int__: ("int(tensor)", _HOST_SYNC),
    torch.Tensor.__float__: ("float(tensor)", _HOST_SYNC),
    torch.Tensor.__index__: ("tensor used as a Python index", _HOST_SYNC),
    torch.Tensor.numpy: ("Tensor.numpy()", _HOST_READ),
    torch.Tensor.__array__: ("numpy.asarray(tensor)", _HOST_READ),
    torch.Tensor.cpu: ("Tensor.cpu()", _HOST_READ),
    torch.Tensor.__repr__: ("repr/str/print of a tensor", _HOST_READ),
    torch.Tensor.__format__: ("formatting a tensor", _HOST_READ),
    torch.tensor: ("torch.tensor(host data)", _HOST_DATA),
    torch.as_tensor: ("torch.as_tensor(host data)", _HOST_DATA),
    torch.Tensor.new_tensor: ("Tensor.new_tensor(host data)", _HOST_DATA),
}
_CPU_OPERAND = (
    "reads a CPU tensor in a device op: on CUDA a device mismatch or, for a 0-dim tensor, a "
    "value read on the host at capture and frozen into the graph; use a Python scalar or a "
    "static device buffer"
)
_PAGEABLE_COPY = (
    "copies host memory to the device from pageable memory or blocking: not capturable on "
    "CUDA, and in an eager step the host waits for the device to drain; stage the values in "
    "pinned memory and copy them with non_blocking=True"
)
_HOST_OP = (
    "produces a tensor on the host: a captured graph records device work only, so a replay "
    "never redoes it; create it on the engine's device (device=...) or in a static buffer"
)


class _HostIntentMode(TorchFunctionMode):
    def __init__(self, host_work: bool) -> None:
        super().__init__()
        self._host_work = host_work

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        intent = _HOST_INTENT.get(func)
        data = args[0] if args else kwargs.get("data")
        # torch.tensor / torch.as_tensor of a tensor is a device-side copy or a no-op.
        from_tensor = func in (torch.tensor, torch.as_tensor) and isinstance(data, torch.Tensor)
        # In an eager step only reads of device values make the host wait.
        host_only = self._host_work and not (isinstance(data, torch.Tensor) and data.device.type != "cpu")
        if intent is not None and not from_tensor and not host_only:
            label, why = intent
            raise CaptureSafetyError(f"{label} {why}")
        return func(*args, **kwargs)


@lru_cache(maxsize=None)
def _packet_tagged(packet: torch._ops.OpOverloadPacket, tag: torch.Tag) -> bool:
    """True if any overload of the op carries `tag` (`.out` variants often lack the tags)."""
    return any(tag in getattr(packet, name).tags for name in packet.overloads())


_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
_REALLOCATING_OPS = {"resize_", "resize_as_", "set_", "_resize_output_"}


def _arg(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], name: str) -> Any:
    for i, schema_arg in enumerate(func._schema.arguments):
        if schema_arg.name == name:
            return args[i] if i < len(args) else kwargs.get(name, schema_arg.default_value)
    return None


def _unsafe_reason(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """Why this aten op cannot live in a captured graph on any device, or None if it can."""
    packet = func.overloadpacket
    name = packet.__name__
    if name in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return (
                "with a boolean-mask index: the masked positions are found with nonzero, a host "
                "sync whose result sizes the output; use torch.where / masked_fill / a fixed-size "
                "index instead"
            )
        return None
    if name == "repeat_interleave":
        if func._overloadname != "self_int" and _arg(func, args, kwargs, "output_size") is None:
            return "with tensor repeats and no output_size: the output length is a host-side sum; pass output_size"
        return None
    if _packet_tagged(packet, torch.Tag.data_dependent_output):  # item, equal, allclose
        return _HOST_SYNC
    if _packet_tagged(packet, torch.Tag.dynamic_output_shape):
        return (
            "has an output shape that depends on tensor values: sizing it needs a host sync and a "
            "captured graph cannot change shape between replays; use a fixed-size formulation "
            "(nonzero_static, topk, masks with torch.where)"
        )
    if _packet_tagged(packet, torch.Tag.nondeterministic_seeded):
        if _arg(func, args, kwargs, "train") is False:
            return None  # eval-mode dropout draws nothing
        return (
            "draws from a random generator's state: a replay would not follow the host-side "
            "generator, so replay and eager diverge; use the counter-based hash of (seed, position)"
        )
    if name == "_to_copy":
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu":
            return _HOST_READ
    return None


@dataclass(frozen=True)
class _DeviceRules:
    """The rules of a capture on a device other than the CPU (see the module doc)."""

    device: torch.device
    is_pinned: Callable[[torch.Tensor], bool]
    host_work: bool  # an eager step: ops on host tensors alone are allowed

    def _host_to_device(self, source: torch.Tensor, non_blocking: bool) -> str | None:
        return None if non_blocking and self.is_pinned(source) else _PAGEABLE_COPY

    def before(self, func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """Why the op, given its inputs, breaks a device capture; None if it does not."""
        name = func.overloadpacket.__name__
        if name in ("lift_fresh", "lift_fresh_copy") and not self.host_work:
            return _HOST_DATA  # host data (torch.from_numpy) brought into the step
        if name == "copy_" and args[1].device.type == "cpu" and args[0].device.type != "cpu":
            return self._host_to_device(args[1], bool(_arg(func, args, kwargs, "non_blocking")))
        if name == "_to_copy" and args[0].device.type == "cpu":
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                return self._host_to_device(args[0], bool(kwargs.get("non_blocking", False)))
        if name == "copy_" and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            # An asynchronous copy into pinned host memory is capturable (the graph
            # replays it; the host waits on an event before reading). Anything else
            # is a synchronous device-to-host copy.
            if _arg(func, args, kwargs, "non_blocking") and self.is_pinned(args[0]):
                return None
            return _HOST_READ
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = [t for t in inputs if t.device.type == "cpu"]
        if on_host and len(on_host) < len(inputs):
            return _CPU_OPERAND
        return None

    def after(self, func: torch._ops.OpOverload, args: Sequence[Any], result: Any) -> str | None:
        """Why the op's outputs break a device capture; None if they all live on the device."""
        if func.overloadpacket.__name__ == "copy_" and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            return None  # the allowed pinned device-to-host copy writes host memory
        for out in tree_leaves(result):
            if not isinstance(out, torch.Tensor) or out.device == self.device:
                continue
            if out.device.type == "cpu":
                if self.host_work:
                    continue
                return _HOST_OP
            return f"produces a tensor on {out.device}, but the engine runs on {self.device}"
        return None


def _written_tensors(
    func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Iterator[torch.Tensor]:
    """The tensors this op writes in place or as out= arguments, per its schema."""
    for i, schema_arg in enumerate(func._schema.arguments):
        if schema_arg.alias_info is None or not schema_arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(schema_arg.name)
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


@dataclass
class CheckStats:
    """What one run under the check saw."""

    ops: int = 0  # aten ops dispatched and checked
    op_counts: dict[str, int] = field(default_factory=dict)  # per op overload


# Metadata queries a fake tensor dispatches; they do no device work.
_METADATA_OPS = {"device", "layout", "dtype", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}


class _CaptureDispatchMode(TorchDispatchMode):
    def __init__(self, static_storages: Mapping[int, str], rules: _DeviceRules | None, stats: CheckStats) -> None:
        super().__init__()
        # storage key -> buffer name; a leading-slice view shares its buffer's storage.
        self._static_storages = static_storages
        self._rules = rules
        self._stats = stats

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _METADATA_OPS:
            return func(*args, **kwargs)
        self._stats.ops += 1
        label = str(func)
        self._stats.op_counts[label] = self._stats.op_counts.get(label, 0) + 1
        why = _unsafe_reason(func, args, kwargs)
        if why is None and self._rules is not None:
            why = self._rules.before(func, args, kwargs)
        if why is not None:
            raise CaptureSafetyError(f"{func} {why}")
        static_writes = []
        for tensor in _written_tensors(func, args, kwargs):
            name = self._static_storages.get(_storage_key(tensor))
            if name is not None:
                static_writes.append((name, tensor, BufferAddress.of(tensor)))
        if static_writes and func.overloadpacket.__name__ in _REALLOCATING_OPS:
            raise CaptureSafetyError(
                f"{func} on static buffer {static_writes[0][0]!r}: resizing or rebinding a static "
                "buffer moves the memory a captured graph points at"
            )
        result = func(*args, **kwargs)
        if self._rules is not None:
            why = self._rules.after(func, args, result)
            if why is not None:
                raise CaptureSafetyError(f"{func} {why}")
        for name, tensor, before in static_writes:
            after = BufferAddress.of(tensor)
            if after != before:
                raise CaptureSafetyError(
                    f"{func} reallocated static buffer {name!r} ({before} -> {after}), e.g. an "
                    "out= of the wrong shape: a captured graph keeps the old address; write into "
                    "a correctly shaped slice"
                )
        return result


@contextmanager
def capture_safety_check(
    static_tensors: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str | None = None,
    is_pinned: Callable[[torch.Tensor], bool] | None = None,
    host_work: bool = False,
) -> Iterator[CheckStats]:
    """Run the body (one step) under the capture-safety check; raises CaptureSafetyError.

    `device`: the engine's device (default: that of the static buffers, else
    the CPU); any other than the CPU adds the device rules of the module doc.
    `is_pinned` says which host tensors are pinned (default `Tensor.is_pinned`;
    the fake-CUDA dry run, whose host memory cannot be pinned, passes its own).
    `host_work=True` checks an eager device step instead of a captured one
    (a model forward that plans on the host): work on host tensors alone is
    allowed, and what stays forbidden is what makes the host wait for the
    device (reading device values, blocking or pageable copies) and host
    tensors in device ops.
    Yields the run's `CheckStats`. On exit without an error, every static
    buffer must still have the address, shape and stride it had on entry.
    """
    if device is None:
        device = next(iter(static_tensors.values())).device if static_tensors else torch.device("cpu")
    device = torch.device(device)
    rules = None
    if device.type != "cpu":
        rules = _DeviceRules(device, is_pinned or torch.Tensor.is_pinned, host_work)
    recorded = record_addresses(static_tensors)
    # Storage pointer 0 belongs to every empty tensor: it would flag unrelated temporaries.
    static_storages = {
        _storage_key(tensor): name
        for name, tensor in static_tensors.items()
        if _storage_key(tensor) != 0
    }
    stats = CheckStats()
    with _HostIntentMode(host_work and rules is not None), _CaptureDispatchMode(static_storages, rules, stats):
        yield stats
    check_addresses(static_tensors, recorded)
