"""A fake CUDA device on a CPU-only torch: device memory is fake, host memory is real.

Under `FakeCuda()`, every tensor created on "cuda" is a FakeTensor: it has a
shape, a dtype, a device and a storage identity but no memory, and every aten
op on it runs its shape function only, so a [129280, 7168] bf16 weight costs
nothing. Host tensors stay real, so numpy views of a staging area, ledgers and
everything else the host does keep working.

What the CPU-only build lacks is patched for the duration, and nothing else:
- Python indexing (`t[...]`, `t[...] = v`), `Tensor.copy_`, `Tensor.to`,
  `Tensor.contiguous`, `~t` and `nonzero` install a device guard in their Python bindings, which a CPU-only build has
  none of for CUDA; on fake tensors they are re-expressed as the aten ops they
  stand for (slice, select, unsqueeze, index, index_put_, copy_, _to_copy);
- `pin_memory=True` and `Tensor.pin_memory()` allocate a plain host tensor
  and remember it as pinned (`is_pinned`);
- `torch.cuda.Event` is a stand-in whose record and synchronize do nothing;
- `torch.from_numpy` shares the array's memory, as outside the fake mode;
- a fake tensor's `data_ptr()` is its storage's identity plus its offset, so
  pointer comparisons tell buffers apart (the fake mode's own reads 0);
- the device has `sms` SMs (`torch.cuda.get_device_properties().multi_processor_count`,
  device 0 current), so a launcher that sizes its grid by the SMs of a CUDA tensor's
  device (the LM head's persistent grid, the sampler's split) sizes it as on that GPU
  (`torch.cuda.is_available()` stays False: the fake mode builds CUDA tensors by it);
- a Triton launch (`JITFunction.run`, or `InterpretedFunction.run` under
  `TRITON_INTERPRET=1`) over fake tensors runs nothing and is recorded in
  `launches` (the kernel's name and its grid, as the launcher computed it); torch's
  `wrap_triton` is switched off for the duration so every launch reaches Triton's
  own entry point. The cost model reads each custom op's grids there.

A host read of device data (`.cpu()`, `.item()`, `.numpy()`, `bool()`, a
device-to-host copy) cannot see values that do not exist: it returns zeros
and is counted in `host_reads`, by call site, so a run reports how many
device-to-host syncs each step pays outside its graphs. Host-to-device copies
that are not pinned and non-blocking (each one a host wait on CUDA) are
counted in `pageable_copies` the same way, and every host-to-device copy in
`h2d_copies`.
"""
from __future__ import annotations

import math
import os
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

_HOST_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__array__, torch.Tensor.__repr__,
    torch.Tensor.__format__, torch.Tensor.cpu,
}


# The SMs of the fake device: an H100 SXM's and an H200's 132.
SMS = 132


@dataclass(frozen=True)
class Launch:
    """One Triton launch the fake device recorded: the kernel's name and its grid."""

    kernel: str
    grid: tuple[int, ...]

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


def _is_fake(value: Any) -> bool:
    return isinstance(value, FakeTensor)


class _Event:
    """torch.cuda.Event on the fake device: there is no stream work to wait for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeCuda:
    """Context manager: run CUDA code paths with no GPU (see the module doc)."""

    def __init__(self, sms: int = SMS) -> None:
        if isinstance(sms, bool) or not isinstance(sms, int) or sms < 1:
            raise ValueError(f"FakeCuda(sms={sms!r}): must be an int >= 1")
        self.sms = sms
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.launches: list[Launch] = []  # every Triton launch over fake tensors, in order
        # Data pointers of host storages allocated pinned (a pointer freed and reused by a
        # pageable tensor would pass as pinned: the staging areas live as long as their engines).
        self._pinned: set[int] = set()
        self.host_reads: Counter[str] = Counter()  # call site -> device-to-host reads
        self.pageable_copies: Counter[str] = Counter()  # call site -> host-to-device copies not pinned + non_blocking
        self.h2d_copies: Counter[str] = Counter()  # call site -> every host-to-device copy
        self._stack: ExitStack | None = None

    # -- what the patched functions need -------------------------------------------

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether a host tensor stands for pinned memory (allocated with pin_memory=True)."""
        return not _is_fake(tensor) and tensor.untyped_storage().data_ptr() in self._pinned

    def _count_host_read(self) -> None:
        self.host_reads[_call_site()] += 1

    def count_copy(self, source: torch.Tensor, non_blocking: bool) -> None:
        """Record a host-to-device copy by call site, and apart the pageable (or blocking) ones."""
        site = _call_site()
        self.h2d_copies[site] += 1
        if not (non_blocking and self.is_pinned(source)):
            self.pageable_copies[site] += 1

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a device-to-host copy of a fake tensor delivers: zeros (counted). Made with
        every dispatch mode off: a check watching the caller sees the copy, not this."""
        self._count_host_read()
        with _disable_current_modes():
            return torch.zeros(tensor.shape, dtype=tensor.dtype)

    def host_call(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """Host work on real tensors; pin_memory=True is remembered instead of honoured."""
        pinned = bool(kwargs.pop("pin_memory", False))
        with unset_fake_temporarily():
            result = func(*args, **kwargs)
        if pinned:
            self._pinned.add(result.untyped_storage().data_ptr())
        return result

    def _properties(self, device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(name="fake cuda", multi_processor_count=self.sms, major=9, minor=0)

    @contextmanager
    def _watch_launches(self) -> Iterator[None]:
        """Triton launches over fake tensors record their grid and run nothing (module doc)."""
        import triton.runtime.interpreter as interpreter
        import triton.runtime.jit as jit
        from torch._library.triton import set_wrap_triton_enabled

        def watched(run: Any) -> Any:
            def launch(kernel: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
                if not any(_is_fake(leaf) for leaf in tree_leaves((args, kwargs))):
                    return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
                if callable(grid):  # a grid function of the launch's meta-parameters
                    grid = grid(kwargs)
                grid = tuple(int(g) for g in grid)
                self.launches.append(Launch(getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel)), grid))
                return None
            return launch

        with ExitStack() as stack:
            for cls in (jit.JITFunction, interpreter.InterpretedFunction):
                stack.enter_context(_patched(cls, "run", watched(cls.run)))
            stack.enter_context(set_wrap_triton_enabled(False))
            yield

    # -- entering and leaving --------------------------------------------------------

    def __enter__(self) -> FakeCuda:
        stack = ExitStack()
        try:
            stack.enter_context(_patched(torch.cuda, "Event", _Event))
            stack.enter_context(_patched(torch.cuda, "current_device", lambda: 0))
            stack.enter_context(_patched(torch.cuda, "get_device_properties", self._properties))
            stack.enter_context(self._watch_launches())
            stack.enter_context(_patched(torch, "from_numpy", _host_from_numpy))
            stack.enter_context(self.mode)
            stack.enter_context(_CopyWatch(self))
            stack.enter_context(_FakeCudaFunctions(self))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def project_path(filename: str) -> str:
    """`filename` relative to the repository root (engine/step/step_engine.py), or as given outside it."""
    path = os.path.abspath(filename)
    return os.path.relpath(path, _ROOT) if path.startswith(_ROOT + os.sep) else filename


def _call_site() -> str:
    """The innermost frame outside torch and this module, as a repository path and line."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("fake_cuda.py"):
            return f"{project_path(frame.filename)}:{frame.lineno}"
    return "unknown"


class _CopyWatch(TorchDispatchMode):
    """Sees every host-to-device copy, wherever it comes from (copy_, .to, torch.as_tensor)."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu":
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                self.cuda.count_copy(args[0], bool(kwargs.get("non_blocking", False)))
        elif func is torch.ops.aten.copy_.default and args[1].device.type == "cpu" and args[0].device.type != "cpu":
            self.cuda.count_copy(args[1], bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


def _host_from_numpy(array: Any) -> torch.Tensor:
    # torch.from_numpy has no torch-function hook, and under FakeTensorMode its
    # result would be lifted to a fake host tensor: host memory stays real.
    with unset_fake_temporarily():
        return _FROM_NUMPY(array)


_FROM_NUMPY = torch.from_numpy


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _touches_device(args: tuple, kwargs: dict) -> bool:
    """Whether a call involves a fake tensor or names a non-CPU device."""
    for leaf in tree_leaves((args, kwargs)):
        if _is_fake(leaf):
            return True
        if isinstance(leaf, (torch.device, str)) and leaf != "cpu":
            try:
                if torch.device(leaf).type != "cpu":
                    return True
            except (RuntimeError, TypeError):
                continue
    return False


class _FakeCudaFunctions(TorchFunctionMode):
    """Routes the Python-level calls a CPU-only build cannot run on fake CUDA tensors."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.__getitem__ and _is_fake(args[0]):
            return _getitem(args[0], args[1])
        if func is torch.Tensor.__setitem__ and _is_fake(args[0]):
            return _setitem(args[0], args[1], args[2])
        if func is torch.Tensor.__invert__ and _is_fake(args[0]):
            return torch.ops.aten.bitwise_not.default(args[0])
        if func in (torch.nonzero, torch.Tensor.nonzero) and _is_fake(args[0]) and not kwargs and len(args) == 1:
            return torch.ops.aten.nonzero.default(args[0])
        if func is torch.Tensor.contiguous and _is_fake(args[0]):
            fmt = kwargs.get("memory_format", args[1] if len(args) > 1 else torch.contiguous_format)
            if args[0].is_contiguous(memory_format=fmt):
                return args[0]
            return torch.ops.aten.clone.default(args[0], memory_format=fmt)
        if func is torch.Tensor.copy_:
            return self._copy(*args, **kwargs)
        if func is torch.Tensor.to:
            return self._to(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return self._to(args[0], "cuda", **kwargs)
        if func is torch.Tensor.pin_memory and not _is_fake(args[0]):
            return self.cuda.host_call(torch.Tensor.clone, (args[0],), {"pin_memory": True})
        if func is torch.Tensor.is_pinned and not _is_fake(args[0]):
            return self.cuda.is_pinned(args[0])
        if func in _HOST_READS and _is_fake(args[0]):
            host = self.cuda.host_copy(args[0])
            with unset_fake_temporarily():
                return func(host, *args[1:], **kwargs)
        if func in (torch.tensor, torch.as_tensor) and not isinstance(args[0] if args else kwargs.get("data"), torch.Tensor):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                # Host data straight onto the device: a pageable copy (the fake mode
                # builds the tensor without dispatching one).
                self.cuda.pageable_copies[_call_site()] += 1
                self.cuda.h2d_copies[_call_site()] += 1
        if func is torch.Tensor.data_ptr and _is_fake(args[0]):
            # Every fake data pointer reads 0; code that compares pointers (is this the
            # static source?) needs distinct ones: the storage's identity plus the offset.
            t = args[0]
            return t.untyped_storage()._cdata + t.storage_offset() * t.element_size()
        if not _touches_device(args, kwargs):
            # Host work: real tensors, real values.
            return self.cuda.host_call(func, args, kwargs)
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if not _is_fake(dst) and _is_fake(src):
            # Dispatched for whoever watches (it leaves the host tensor as it was), then
            # the zeros a copy of no data delivers.
            torch.ops.aten.copy_.default(dst, src, non_blocking)
            host = self.cuda.host_copy(src)
            with _disable_current_modes():
                return dst.copy_(host)
        if not _is_fake(dst):  # host to host
            return self.cuda.host_call(torch.Tensor.copy_, (dst, src), {"non_blocking": non_blocking})
        return torch.ops.aten.copy_.default(dst, src, non_blocking)

    def _to(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copy = bool(kwargs.pop("copy", False))
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        device = tensor.device if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        dtype = tensor.dtype if dtype is None else dtype
        if device.type == "cpu" and _is_fake(tensor):
            torch.ops.aten._to_copy.default(tensor, dtype=dtype, device=device, non_blocking=non_blocking)
            host = self.cuda.host_copy(tensor)
            with _disable_current_modes():
                return host.to(dtype)
        if device == tensor.device and dtype == tensor.dtype and not copy:
            return tensor
        if device.type == "cpu":  # host to host
            return self.cuda.host_call(torch.Tensor.to, (tensor,), {"dtype": dtype, "copy": copy, "non_blocking": non_blocking})
        return torch.ops.aten._to_copy.default(
            tensor, dtype=dtype, device=device, non_blocking=non_blocking,
            **({} if memory_format is None else {"memory_format": memory_format}),
        )


# -- Python indexing in aten ops ------------------------------------------------------------


def _as_index(value: Any, device: torch.device) -> torch.Tensor:
    """An advanced index as a tensor: lists and numpy arrays become host tensors (moved by
    aten.index as CUDA would move them: a host-to-device copy)."""
    if isinstance(value, torch.Tensor):
        return value
    with unset_fake_temporarily():
        return torch.as_tensor(value)


def _basic(tensor: torch.Tensor, key: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Apply ints, slices, None and Ellipsis as views; return the view and the advanced
    indices by the view's dimension (None where a dimension is not advanced-indexed)."""
    items = list(key) if isinstance(key, tuple) else [key]
    consumed = sum(
        0 if item is None or item is Ellipsis else (item.dim() if isinstance(item, torch.Tensor) and item.dtype == torch.bool else 1)
        for item in items
    )
    view, dim, advanced = tensor, 0, []
    for item in items:
        if item is Ellipsis:
            skip = tensor.dim() - consumed
            advanced.extend([None] * skip)
            dim += skip
        elif item is None:
            view = torch.ops.aten.unsqueeze.default(view, dim)
            advanced.append(None)
            dim += 1
        elif isinstance(item, bool):
            raise NotImplementedError("a bool as an index")
        elif isinstance(item, int):
            view = torch.ops.aten.select.int(view, dim, item)
        elif isinstance(item, slice):
            view = torch.ops.aten.slice.Tensor(view, dim, item.start, item.stop, 1 if item.step is None else item.step)
            advanced.append(None)
            dim += 1
        else:
            index = _as_index(item, tensor.device)
            advanced.append(index)
            dim += index.dim() if index.dtype == torch.bool else 1
            advanced.extend([None] * (index.dim() - 1 if index.dtype == torch.bool else 0))
    return view, advanced


def _trimmed(advanced: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    while advanced and advanced[-1] is None:
        advanced.pop()
    return advanced


def _getitem(tensor: torch.Tensor, key: Any) -> torch.Tensor:
    view, advanced = _basic(tensor, key)
    advanced = _trimmed(advanced)
    if not advanced:
        return view
    return torch.ops.aten.index.Tensor(view, advanced)


def _setitem(tensor: torch.Tensor, key: Any, value: Any) -> None:
    view, advanced = _basic(tensor, key)
    advanced = _trimmed(advanced)
    if not isinstance(value, torch.Tensor):
        if not advanced:
            torch.ops.aten.fill_.Scalar(view, value)
            return
        value = torch.ops.aten.full.default((), value, dtype=tensor.dtype, device=tensor.device)
    if not advanced:
        torch.ops.aten.copy_.default(view, value)
    else:
        torch.ops.aten.index_put_.default(view, advanced, value)
