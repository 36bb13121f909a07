"""Random step batches for the Triton kernel tests (tests/test_kernel_controls.py,
tests/test_kernel_verify.py): the flat row layout of docs/contract.md §1.2 with
requests verifying 0..K drafts, padding rows past every real row, control slots,
stop ids, drafts staged or read from the draft-info pool, and logits with the
values that break kernels: -inf, NaN rows, signed zeros, huge magnitudes.

Only layout here, no reference: each test composes its own from the torch path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

READ_FROM_POOL = -2


@dataclass
class Batch:
    vocab: int
    max_drafts: int  # K: a request verifies 0..K drafts; rows_per_req = 1 + K
    row_to_req: torch.Tensor  # [rows] int64
    local_step: torch.Tensor  # [rows] int64; padding rows: 1 + K
    real: torch.Tensor  # [rows] bool
    row_drafts: torch.Tensor  # [rows] int64 staged: token, -1 none, -2 from the pool
    read_rows: torch.Tensor  # [rows] int64 pool rows (mtp_info_read_rows)
    pool_tokens: torch.Tensor  # [(pool_slots + 1) * K'] int64
    logits: torch.Tensor  # [rows, V] f32
    num_reqs: int

    def __repr__(self) -> str:  # what hypothesis prints of a failing example
        return (f"Batch(V={self.vocab}, K={self.max_drafts}, reqs={self.num_reqs}, row_to_req={self.row_to_req.tolist()}, "
                f"local_step={self.local_step.tolist()}, row_drafts={self.row_drafts.tolist()})")

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))

    @property
    def rows(self) -> int:
        return self.row_to_req.shape[0]

    def resolved_drafts(self) -> torch.Tensor:
        """[rows] int64: what `engine.step.lm_head.resolve_drafts` computes."""
        return torch.where(self.row_drafts == READ_FROM_POOL, self.pool_tokens[self.read_rows], self.row_drafts)


def special_logits(rng: np.random.Generator, rows: int, vocab: int) -> torch.Tensor:
    """[rows, V] f32: normal logits salted with -inf, +-0, huge values; some rows NaN or all -inf."""
    x = rng.normal(0.0, 3.0, (rows, vocab)).astype(np.float32)
    salt = rng.random((rows, vocab))
    x[salt < 0.05] = -np.inf
    x[(salt >= 0.05) & (salt < 0.08)] = -0.0
    x[(salt >= 0.08) & (salt < 0.10)] = 0.0
    x[(salt >= 0.10) & (salt < 0.11)] = np.float32(-3e38)
    x[(salt >= 0.11) & (salt < 0.12)] = np.float32(3e38)
    for r in range(rows):
        kind = rng.random()
        if kind < 0.06:
            x[r, rng.integers(vocab)] = np.nan
        elif kind < 0.10:
            x[r] = -np.inf
    return torch.from_numpy(x)


@st.composite
def batches(draw, *, vocabs=(45, 200, 333), max_drafts=(0, 1, 3), max_reqs: int = 4) -> Batch:
    vocab = draw(st.sampled_from(vocabs))
    k = draw(st.sampled_from(max_drafts))
    n = draw(st.integers(1, max_reqs))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    drafts_per_req = [int(rng.integers(0, k + 1)) for _ in range(n)]
    row_to_req, local_step = [], []
    for i, d in enumerate(drafts_per_req):
        row_to_req += [i] * (d + 1)
        local_step += list(range(d + 1))
    padding = int(rng.integers(0, 3))
    pad_req = n if padding and rng.random() < 0.5 else 0  # a padding request slot, or slot 0 when all are real
    # Request slots past the last one with rows hold none (a bucket larger than the batch).
    num_reqs = n + (pad_req == n and padding > 0) + int(rng.integers(0, 2))
    real = [True] * len(row_to_req) + [False] * padding
    row_to_req += [pad_req] * padding
    local_step += [k + 1] * padding
    rows = len(row_to_req)
    width = max(k, 1)
    pool_slots = n + 2
    pool = rng.integers(0, vocab, (pool_slots + 1) * width)
    pool[rng.random(pool.shape) < 0.2] = -1  # entries no draft head wrote
    pool[:width] = vocab - 1  # slot 0: padding
    row_drafts = np.full(rows, -1, np.int64)
    read_rows = np.zeros(rows, np.int64)
    for r in range(rows):
        i, j = row_to_req[r], local_step[r]
        if not real[r] or j == drafts_per_req[i]:
            continue  # a request's last row verifies no draft
        if rng.random() < 0.5:
            row_drafts[r] = READ_FROM_POOL
            read_rows[r] = int(rng.integers(0, pool_slots)) * width + j
        else:
            row_drafts[r] = int(rng.integers(0, vocab))
    return Batch(vocab, k, torch.tensor(row_to_req, dtype=torch.int64), torch.tensor(local_step, dtype=torch.int64),
                 torch.tensor(real), torch.from_numpy(row_drafts), torch.from_numpy(read_rows),
                 torch.from_numpy(pool.astype(np.int64)), special_logits(rng, rows, vocab), num_reqs)


def same_values(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal values with NaN in the same places (a zero's sign is not a value: -0.0 == 0.0)."""
    return actual.shape == expected.shape and bool(((actual == expected) | (actual.isnan() & expected.isnan())).all())
