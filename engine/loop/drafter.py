"""The n-gram prompt-lookup drafter: the longest recent n-gram of a request's
history that occurred before proposes the tokens that followed it.
Verification is strict, so drafts change speed, never tokens."""
from __future__ import annotations

import numpy as np


def propose_ngram_drafts(history: np.ndarray, k: int, ngram_max: int) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the history's last
    n tokens (n = ngram_max down to 1) and propose the k tokens after it."""
    length = len(history)
    for n in range(min(ngram_max, length - 1), 0, -1):
        tail = history[length - n :]
        # Windows starting before the tail itself; the latest match wins.
        windows = np.lib.stride_tricks.sliding_window_view(history[: length - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return history[start : start + k].tolist()
    return []
