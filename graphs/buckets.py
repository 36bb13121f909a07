"""Batch-size buckets: which captured graph serves a step with n requests.

Default rule: 1, 2, 4, 8, then every multiple of 8 up to 64, then every
multiple of 16, all capped at `max_num_reqs`; `max_num_reqs` itself is always
the last bucket, so every batch the engine admits has a graph. (nano-vllm picks
the bucket with `next(b for b in buckets if b >= n)` and dies with
StopIteration when max_num_seqs is not in its list; here the lookup array
covers every admissible n and anything above the largest bucket is an explicit
eager fallback, never an exception.)
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np


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
