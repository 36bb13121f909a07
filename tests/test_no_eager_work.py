"""Every row is decided inside the captured step: over flat distributions, whose
kept sets hold tens of thousands of tokens, a step runs no sampling work
after the replay, only the copy of its outputs (docs/contract.md §2, "the
whole row, a fixed amount of work")."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engine.step.step_output as collect_module
import engine.sampling.exact as exact_module
from engine import EngineConfig, PersistentBatch, SamplingParams, StepEngine
from engine.sampling.exact import kept_sets
from engine.sampling.row_params import RowParams

VOCAB, HIDDEN = 32768, 16
# What copying the outputs to the host may run: views, copies, nothing that computes.
COPY_OPS = {"aten._to_copy.default", "aten.copy_.default", "aten.slice.Tensor", "aten.detach.default",
            "aten.alias.default", "aten.empty.memory_format", "aten.empty_strided.default", "aten._unsafe_view.default",
            "aten.view.default", "aten.lift_fresh.default", "aten.clone.default",
            "aten.view.dtype"}  # the packed output copy moves its bytes as int64 words: a view, no work


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


FLAT = [
    SamplingParams(temperature=1.0, top_p=0.9, seed=1),
    SamplingParams(temperature=1.5, top_k=20000, seed=2),
    SamplingParams(temperature=1.0, top_k=30000, top_p=0.95, seed=3),
    SamplingParams(temperature=0.8, min_p=1e-4, seed=4),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=5),
    SamplingParams(temperature=1.0, seed=6),
    SamplingParams(temperature=0.0),
]


@pytest.mark.parametrize("use_graphs", [True, False], ids=["replay", "eager"])
def test_flat_rows_leave_no_work_after_the_replay(monkeypatch: pytest.MonkeyPatch, use_graphs: bool) -> None:
    # Tiny hidden states and weights: logits within about +-0.01, every row nearly uniform.
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.01
    engine = StepEngine(weight, EngineConfig(max_num_reqs=len(FLAT), use_graphs=use_graphs, device="cpu"))
    if use_graphs:
        engine.capture()

    def forbidden(*args, **kwargs):
        raise AssertionError("the reference path ran inside a step")

    monkeypatch.setattr(exact_module, "sample_exact", forbidden)
    counter = _OpCounter()
    real_collect = collect_module.collect

    def counted_collect(*args, **kwargs):
        with counter:
            return real_collect(*args, **kwargs)

    monkeypatch.setattr("engine.step.step_engine.collect", counted_collect)
    batch = PersistentBatch(engine)
    ids = [f"r{i}" for i in range(len(FLAT))]
    for rid, params in zip(ids, FLAT):
        batch.add(rid, [1, 2, 3], params)
    hidden = torch.randn(len(FLAT), HIDDEN, generator=torch.Generator().manual_seed(1))
    drawn: list[list[int]] = [[] for _ in FLAT]
    for s in range(6):
        # The prompt's last position, then one new token a step; every step samples the same rows.
        q = [3 if s == 0 else 1] * len(ids)
        step = batch.prepare(ids, q, [3 + s] * len(ids))
        rows = hidden.repeat_interleave(torch.tensor(q), dim=0)
        out = engine.run(rows, step.inputs, step.arrays)
        batch.record(step, out)
        for i, tokens in enumerate(out.tokens):
            drawn[i] += list(tokens)
    computing = {op: n for op, n in counter.ops.items() if op not in COPY_OPS}
    assert not computing, computing
    # The rows really were flat: each filter keeps thousands of tokens, and the draws vary.
    logits = hidden @ weight.T
    params = RowParams.from_numpy(
        temperatures=np.array([p.temperature for p in FLAT], np.float32),
        top_ks=np.array([p.top_k for p in FLAT], np.int32), top_ps=np.array([p.top_p for p in FLAT], np.float32),
        min_ps=np.array([p.min_p for p in FLAT], np.float32), seeds=np.arange(len(FLAT), dtype=np.uint64),
        sample_positions=np.zeros(len(FLAT), np.int64), row_to_req=np.arange(len(FLAT)),
        local_step=np.zeros(len(FLAT), np.int64))
    kept = kept_sets(logits, params).sum(-1).tolist()
    assert min(kept[:4]) > 10000 and 1 < kept[4] <= 50 and kept[5] == VOCAB, kept
    assert all(len(set(d)) == 6 for d in drawn[:6]), drawn
