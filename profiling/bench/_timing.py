"""Shared timing helpers for the benchmarks: medians over repeats, a plain table."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence


def median_us(fn: Callable[[], object], *, repeats: int = 50, warmup: int = 5, sync: Callable[[], None] | None = None) -> float:
    """Median wall time of `fn()` in microseconds (after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def ratio(numerator: float, denominator: float) -> str:
    """A ratio of two measurements as "1.23x": two decimals, and two significant
    digits below 0.1, so a positive ratio never prints as 0 (tests parse it)."""
    value = numerator / denominator
    return f"{value:,.2f}x" if value >= 0.1 else f"{value:.2g}x"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else f"{c:,.1f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))
