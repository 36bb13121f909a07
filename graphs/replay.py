"""Batch-size buckets, and one step function captured per bucket and replayed.

Buckets: which captured graph serves a step with n requests. Default rule: 1, 2, 4, 8, then every multiple of 8 up to 64, then every
multiple of 16, all capped at `max_num_reqs`; `max_num_reqs` itself is always
the last bucket, so every batch the engine admits has a graph. (nano-vllm picks
the bucket with `next(b for b in buckets if b >= n)` and dies with
StopIteration when max_num_seqs is not in its list; here the lookup array
covers every admissible n and anything above the largest bucket is an explicit
eager fallback, never an exception.)

The step function `step_fn(bucket)` reads and writes only static tensors
(leading slices of `bucket` requests / rows); it is the whole device part of a
step. On CUDA each bucket becomes a torch.cuda.CUDAGraph; on CPU "replay"
calls the same function again over the same buffers, after a capture that ran
it once per bucket under the capture-safety check. Either way the caller's
contract is identical: fill the static inputs, `replay(bucket)`, read the
static outputs (and copy them out before the next replay overwrites them).

`simulated_cuda_capture()` makes CUDA replayers built inside it capture the
CPU way, under the CUDA rules of the capture-safety check: the fake-CUDA dry
run (profiling/cuda_dry_run.py) drives the whole CUDA path with it where
torch.cuda.graph cannot run.
"""
from __future__ import annotations

import functools
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from graphs.capture_safety import capture_safety_check, check_addresses, record_addresses


def default_buckets(max_num_reqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, ..., 64, 80, 96, ... capped at and ending in `max_num_reqs`."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8)]
    sizes.extend(range(80, max_num_reqs + 1, 16))
    sizes = [s for s in sizes if s < max_num_reqs]
    sizes.append(max_num_reqs)
    return tuple(sizes)


def _validate_user_buckets(sizes: Sequence[int], max_num_reqs: int) -> tuple[int, ...]:
    """Check a user bucket list; `max_num_reqs` is appended when the list ends below it."""
    checked: list[int] = []
    for i, size in enumerate(sizes):
        # bool is an int subclass, but `True` as a bucket is surely a mistake.
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise ValueError(f"buckets[{i}] = {size!r}: bucket sizes must be ints")
        size = int(size)
        if size < 1:
            raise ValueError(f"buckets[{i}] = {size}: bucket sizes must be >= 1")
        if checked and size <= checked[-1]:
            raise ValueError(
                f"buckets[{i}] = {size}: bucket sizes must be sorted ascending and unique "
                f"(previous entry is {checked[-1]})"
            )
        if size > max_num_reqs:
            raise ValueError(
                f"buckets[{i}] = {size}: exceeds max_num_reqs = {max_num_reqs}; the static "
                "buffers are sized for max_num_reqs"
            )
        checked.append(size)
    if not checked or checked[-1] != max_num_reqs:
        checked.append(max_num_reqs)
    return tuple(checked)


@dataclass(frozen=True)
class BucketTable:
    """Sorted bucket sizes plus a size -> bucket lookup built once.

    `BucketTable(max_num_reqs)` uses the default rule; `BucketTable(max_num_reqs,
    sizes=[...])` takes a user list (sorted, unique, positive ints, none above
    max_num_reqs; max_num_reqs is appended if missing).
    """

    max_num_reqs: int
    sizes: tuple[int, ...] | None = None
    buckets: tuple[int, ...] = field(init=False)
    # lookup[n] = smallest bucket >= n for 1 <= n <= largest; lookup[0] is unused.
    _lookup: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_num_reqs, bool)
            or not isinstance(self.max_num_reqs, (int, np.integer))
            or self.max_num_reqs < 1
        ):
            raise ValueError(f"max_num_reqs = {self.max_num_reqs!r}: must be an int >= 1")
        object.__setattr__(self, "max_num_reqs", int(self.max_num_reqs))
        if self.sizes is None:
            buckets = default_buckets(self.max_num_reqs)
        else:
            buckets = _validate_user_buckets(self.sizes, self.max_num_reqs)
            object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        lookup = np.zeros(buckets[-1] + 1, dtype=np.int64)
        lower = 1
        for bucket in buckets:
            lookup[lower : bucket + 1] = bucket
            lower = bucket + 1
        lookup.flags.writeable = False
        object.__setattr__(self, "buckets", buckets)
        object.__setattr__(self, "_lookup", lookup)

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_reqs: int) -> int | None:
        """Smallest bucket >= num_reqs, or None above the largest (the caller runs eagerly)."""
        if num_reqs < 1:
            raise ValueError(f"num_reqs = {num_reqs}: a step needs at least one request")
        lookup = self._lookup
        return int(lookup[num_reqs]) if num_reqs < len(lookup) else None

    def parts(self, num_reqs: int) -> list[tuple[int, int, int]]:
        """(first request, end, bucket) of each slice a step of `num_reqs` runs in:
        the whole step in its bucket, or above the largest bucket the largest
        bucket's worth of requests at a time (the eager fallback)."""
        largest = self.buckets[-1]
        if 0 < num_reqs <= largest:
            return [(0, num_reqs, self.bucket_for(num_reqs))]
        return [(start, min(start + largest, num_reqs), self.bucket_for(min(largest, num_reqs - start)))
                for start in range(0, num_reqs, largest)]

    def __iter__(self) -> Iterator[int]:
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def __contains__(self, size: object) -> bool:
        return size in self.buckets


StepFn = Callable[[int], None]
PinnedTest = Callable[[torch.Tensor], bool]

# Set by simulated_cuda_capture: how the simulation tells pinned host memory.
_SIMULATED_CUDA: ContextVar[PinnedTest | None] = ContextVar("simulated_cuda_capture", default=None)


@contextmanager
def simulated_cuda_capture(is_pinned: PinnedTest) -> Iterator[None]:
    """A CUDA replayer constructed inside this context captures by running each
    bucket once under the CUDA capture-safety rules and replays by calling the
    step function, with no torch.cuda call: for a CUDA device whose tensors
    are fake (FakeTensorMode on a machine without a GPU). `is_pinned` says
    which host tensors stand for pinned memory there."""
    token = _SIMULATED_CUDA.set(is_pinned)
    try:
        yield
    finally:
        _SIMULATED_CUDA.reset(token)


@dataclass(frozen=True)
class CaptureReport:
    """What capture() did."""

    buckets: tuple[int, ...]  # in capture order, largest first
    seconds: float
    device: torch.device
    # CUDA only: growth of reserved device memory over the capture. Mostly the
    # shared graph pool: torch.cuda.graph empties the allocator cache before
    # each capture, so warm-up scratch is released again.
    pool_bytes: int | None
    logits_kernel: str | None = None  # the step engine's verified LM-head block GEMM, e.g. "onednn[16]"
    # Aten ops the capture-safety check saw per bucket (the checked run; on
    # CUDA the first warm-up), in capture order.
    ops_checked: tuple[int, ...] = ()

    def __str__(self) -> str:
        pool = "" if self.pool_bytes is None else f", {self.pool_bytes / 2**20:.1f} MiB pool"
        kernel = "" if self.logits_kernel is None else f", LM head {self.logits_kernel}"
        return f"captured {len(self.buckets)} buckets on {self.device} in {self.seconds:.2f} s{pool}{kernel}"


# (buckets captured, buckets to capture, the bucket just captured): what a caller's
# progress bar hears; `capture(progress=True)` draws its own.
CaptureProgress = Callable[[int, int, int], None]


def show_capture_progress(done: int, total: int, bucket: int, *, device: torch.device | None = None) -> None:
    """A bar on stderr: redrawn in place on a terminal, its last state only in a log. It
    says what really happens: CUDA graphs captured, or on CPU (no graphs there) each
    bucket's step run once under the capture-safety check."""
    if not sys.stderr.isatty() and done != total:
        return
    width = 24
    filled = width * done // total
    bar = "#" * filled + "." * (width - filled)
    end = "\n" if done == total else ""
    what = "checking each bucket's step (CPU: no graphs)" if device is not None and device.type == "cpu" \
        else "capturing step graphs"
    print(f"\r{what} [{bar}] {done}/{total} (bucket {bucket})", end=end, file=sys.stderr, flush=True)


class ReplayCounts(NamedTuple):
    replays: tuple[tuple[int, int], ...]  # (bucket, replays)
    eager_runs: int
    eager_fallbacks: int


class GraphReplayer:
    """One captured graph per bucket of `buckets`, all over the same static tensors.

    `static_tensors` names every buffer the step reads or writes; their
    addresses are recorded at capture and, with `check_addresses_each_replay`,
    verified before every replay.
    """

    def __init__(
        self,
        step_fn: StepFn,
        buckets: BucketTable,
        static_tensors: Mapping[str, torch.Tensor],
        device: torch.device | str,
        *,
        warmup_runs: int = 2,
        check_addresses_each_replay: bool = False,
    ) -> None:
        self.device = torch.device(device)
        # Fixed here: a replayer built inside simulated_cuda_capture stays simulated.
        self._simulated_pinned = _SIMULATED_CUDA.get() if self.device.type == "cuda" else None
        if self.device.type == "cuda" and self.device.index is None:
            index = 0 if self._simulated_pinned is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device = {self.device}: only cpu and cuda are supported")
        if warmup_runs < 1:
            raise ValueError(f"warmup_runs = {warmup_runs}: CUDA capture needs at least one warm-up run")
        for name, tensor in static_tensors.items():
            if tensor.device != self.device:
                raise ValueError(f"static buffer {name!r} is on {tensor.device}, the replayer on {self.device}")
        self.buckets = buckets
        self._step_fn = step_fn
        self._static = dict(static_tensors)
        self._warmup_runs = warmup_runs
        self._check_each_replay = check_addresses_each_replay
        self._recorded = record_addresses(self._static)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._captured: set[int] = set()
        self._replays = dict.fromkeys(buckets, 0)
        self._eager_runs = 0
        self._eager_fallbacks = 0

    @property
    def captured(self) -> bool:
        return bool(self._captured)

    @property
    def replays(self) -> dict[int, int]:
        """Replays per bucket since construction."""
        return dict(self._replays)

    @property
    def eager_runs(self) -> int:
        """Calls of run_eager (use_graphs=False, reference runs)."""
        return self._eager_runs

    @property
    def eager_fallbacks(self) -> int:
        """Steps with more requests than the largest bucket (run eagerly by the caller)."""
        return self._eager_fallbacks

    def counts(self) -> ReplayCounts:
        """The counters, for `restore_counts` (a caller undoing a step)."""
        return ReplayCounts(tuple(self._replays.items()), self._eager_runs, self._eager_fallbacks)

    def restore_counts(self, counts: ReplayCounts) -> None:
        self._replays = dict(counts.replays)
        self._eager_runs, self._eager_fallbacks = counts.eager_runs, counts.eager_fallbacks

    def capture(self, progress: bool | CaptureProgress = True) -> CaptureReport:
        """Capture every bucket, largest first; on CPU run each once under the safety check.
        `progress`: True draws a bar on stderr, a callable hears each bucket instead."""
        if progress is True:
            progress = functools.partial(show_capture_progress, device=self.device)
        if self._captured:
            raise RuntimeError("capture() already ran for this replayer")
        # Largest first: its allocations size the shared pool, and every smaller
        # graph then reuses those blocks instead of growing the pool.
        order = tuple(sorted(self.buckets, reverse=True))
        start = time.perf_counter()
        pool_bytes = None
        ops: list[int] = []
        if self.device.type == "cuda" and self._simulated_pinned is None:
            pool_bytes = self._capture_cuda(order, progress, ops)
        else:
            for done, bucket in enumerate(order, start=1):
                with capture_safety_check(self._static, device=self.device, is_pinned=self._simulated_pinned) as stats:
                    self._step_fn(bucket)
                ops.append(stats.ops)
                self._captured.add(bucket)
                if progress:
                    progress(done, len(order), bucket)
        check_addresses(self._static, self._recorded)
        return CaptureReport(order, time.perf_counter() - start, self.device, pool_bytes, ops_checked=tuple(ops))

    def _capture_cuda(self, order: tuple[int, ...], progress: CaptureProgress | bool, ops: list[int]) -> int:
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            reserved_before = torch.cuda.memory_reserved()
            pool = torch.cuda.graph_pool_handle()
            warmup_stream = torch.cuda.Stream()
            for done, bucket in enumerate(order, start=1):
                # Warm-up off the default stream, as capture itself runs on a side
                # stream: lazy init (cuBLAS handles, workspaces, autotuning) must
                # happen before capture, where it is illegal. The first warm-up
                # runs under the safety check, which names the offending op where
                # CUDA would only report a failed capture.
                warmup_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warmup_stream):
                    with capture_safety_check(self._static, device=self.device) as stats:
                        self._step_fn(bucket)
                    ops.append(stats.ops)
                    for _ in range(self._warmup_runs - 1):
                        self._step_fn(bucket)
                torch.cuda.current_stream().wait_stream(warmup_stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._step_fn(bucket)
                self._graphs[bucket] = graph
                self._captured.add(bucket)
                if progress:
                    progress(done, len(order), bucket)
            torch.cuda.synchronize()
            return torch.cuda.memory_reserved() - reserved_before

    def replay(self, bucket: int) -> None:
        """Run the captured step of `bucket` over the current static buffer contents.

        The outputs land in the static output buffers and are overwritten by the
        next replay of any bucket: copy them out first.
        """
        if not self._captured:
            raise RuntimeError("replay() before capture()")
        if bucket not in self._captured:
            raise ValueError(f"bucket = {bucket}: not one of the captured buckets {self.buckets.buckets}")
        if self._check_each_replay:
            check_addresses(self._static, self._recorded)
        if bucket in self._graphs:
            self._graphs[bucket].replay()
        else:
            self._step_fn(bucket)
        self._replays[bucket] += 1

    def run_eager(self, bucket: int) -> None:
        """Run the step of `bucket` eagerly over the static buffers (no graph)."""
        if bucket not in self.buckets:
            raise ValueError(f"bucket = {bucket}: not one of the buckets {self.buckets.buckets}")
        self._step_fn(bucket)
        self._eager_runs += 1

    def record_eager_fallback(self, num_reqs: int) -> None:
        """Count a step too large for any bucket; warns on the first one."""
        if self.buckets.bucket_for(num_reqs) is not None:
            raise ValueError(
                f"num_reqs = {num_reqs} fits bucket {self.buckets.bucket_for(num_reqs)}: "
                "it is not an eager fallback"
            )
        if self._eager_fallbacks == 0:
            warnings.warn(
                f"a step with {num_reqs} requests exceeds the largest graph bucket "
                f"({self.buckets.largest}); such steps run eagerly (counted in eager_fallbacks)",
                RuntimeWarning,
                stacklevel=2,
            )
        self._eager_fallbacks += 1
