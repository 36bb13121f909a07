"""Large temporaries without page faults: glibc told to keep the memory it frees.

A step on a CPU allocates and frees temporaries of megabytes ([rows, V] float32 in the
sampler, activations in the model). glibc serves a block above its mmap threshold (128 KiB
at start, moving up to at most 32 MiB) with a fresh `mmap` and unmaps it when freed, so the
next step faults every page in again. On the 2-core AMD EPYC the sampler at B = 16,
V = 49152 took 6.3 ms a call that way and 2.2 ms with freed blocks kept (the same bits).
vLLM's CPU backend asks its users to preload tcmalloc for the same reason.

`keep_freed_memory()` sets glibc's mmap threshold to 1 GiB and its trim threshold to 2 GiB:
blocks below them come from the heap and go back to it, to be reused by the next step. The
price is that the process keeps its peak heap. It is process-wide, so `LLM` and the demo
call it on a CPU run and the benchmarks for both sides they time; an engine that embeds
`StepEngine` calls it itself (or preloads another allocator). It does nothing where the C
library is not glibc, or where `MALLOC_MMAP_THRESHOLD_` is set (the user's own choice).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1

_applied: str | None = None


def keep_freed_memory() -> str:
    """Apply the thresholds once; returns what was done, in words for a user."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> str:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return "glibc malloc as MALLOC_MMAP_THRESHOLD_ sets it"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, version = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return "the C library's allocator as it is (not glibc)"
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "glibc malloc as it is (mallopt refused the thresholds)"
    version.restype = ctypes.c_char_p
    return f"glibc {version().decode()} malloc keeps freed blocks below 1 GiB for reuse"
