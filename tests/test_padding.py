"""Padding rows and padding requests of a graph bucket, through the engine.

A bucket's graph always runs over `bucket` request slots and
`bucket * (1 + max_draft_tokens)` row slots; the real step fills the leading
ones and engine/step/static_buffers.py fills the rest with padding values. When
every request slot is real, padding rows point at request slot 0, so their
`local_step` must lie past every real row of a request: per-request
reductions over rows (the accepted-draft count) would otherwise count them
(docs/contract.md §4). Padding requests must not write the draft-info pool.

The LM head and hidden states are small integers, so every logit is an exact
integer and the greedy draws below are computed in numpy, independently.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine

VOCAB, HIDDEN, MAX_DRAFTS = 64, 8, 2
GREEDY = SamplingParams(temperature=0.0)


def _weight() -> np.ndarray:
    return np.random.default_rng(3).integers(-3, 4, (VOCAB, HIDDEN))


def _hidden_with_unique_argmax(weight: np.ndarray, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Integer hidden rows whose logits have a single maximum (no greedy tie)."""
    out = []
    while len(out) < rows:
        h = rng.integers(-3, 4, HIDDEN)
        logits = weight @ h
        if (logits == logits.max()).sum() == 1:
            out.append(h)
    return np.array(out)


def _engine(mode: str, use_graphs: bool, *, capture: bool = True) -> StepEngine:
    engine = StepEngine(
        torch.from_numpy(_weight()).float(),
        EngineConfig(max_num_reqs=4, max_draft_tokens=MAX_DRAFTS, verify_mode=mode, device="cpu",
                     use_graphs=use_graphs, draft_pool_slots=16),
    )
    if use_graphs and capture:
        engine.capture()
    return engine


def _decode(rid: str, drafts: int, write_slot: int) -> SeqMeta:
    return SeqMeta(rid, False, 1 + drafts, 10 + drafts, 6, num_generated=4, params=GREEDY, mtp_write_slot=write_slot)


@pytest.mark.parametrize("mode", ["strict", "rejection"])
@pytest.mark.parametrize("use_graphs", [True, False])
def test_full_bucket_padding_rows_never_cut_request_zeros_accepted_drafts(mode: str, use_graphs: bool) -> None:
    """Every request slot of the bucket is real, so the padding rows share
    request slot 0 with request 0, which verifies MAX_DRAFTS right drafts;
    the others verify none, which leaves padding rows. Request 0 accepts all
    its drafts and emits the bonus token too."""
    engine = _engine(mode, use_graphs)
    weight = _weight()
    rng = np.random.default_rng(0)
    for bucket in engine.buckets:
        seqs = [_decode("lead", MAX_DRAFTS, 1)] + [_decode(f"r{i}", 0, i + 2) for i in range(1, bucket)]
        rows = sum(s.seqlen_q for s in seqs)
        assert bucket == 1 or rows < engine.buffers.rows_for(bucket)  # padding rows exist
        hidden = _hidden_with_unique_argmax(weight, rows, rng)
        draws = (hidden @ weight.T).argmax(-1).tolist()  # greedy token of every sample row
        drafts = [draws[:MAX_DRAFTS]] + [[] for _ in range(1, bucket)]
        out = engine.step(torch.from_numpy(hidden).float(), seqs, drafts)
        assert out.bucket == bucket and out.replayed == use_graphs
        assert out.num_accepted == [MAX_DRAFTS] + [0] * (bucket - 1), bucket
        assert out.tokens[0] == draws[: MAX_DRAFTS + 1]
        assert [t[0] for t in out.tokens[1:]] == draws[MAX_DRAFTS + 1 :]


@pytest.mark.parametrize("use_graphs", [True, False])
def test_padding_requests_never_write_the_draft_pool(use_graphs: bool) -> None:
    """Three real requests in bucket 4 propose next drafts for their write
    slots; the padding request slot writes nowhere a request can read: only
    the real write slots change, and padding slot 0 keeps its values."""
    engine = _engine("strict", use_graphs, capture=False)
    b = engine.buffers
    # As allocated, before capture: capture runs the step over padding alone.
    before_tokens, before_logprobs = b.pool_tokens.clone(), b.pool_logprobs.clone()
    if use_graphs:
        engine.capture()
    write_slots = [2, 5, 7]
    seqs = [_decode(f"r{i}", 0, slot) for i, slot in enumerate(write_slots)]
    hidden = torch.from_numpy(_hidden_with_unique_argmax(_weight(), 3, np.random.default_rng(1))).float()
    proposals = [[10 + i, 20 + i] for i in range(3)]
    out = engine.step(hidden, seqs, next_drafts=proposals, next_draft_logprobs=[[-0.5, -1.5]] * 3)
    assert out.bucket == 4
    changed = torch.nonzero((b.pool_tokens != before_tokens) | (b.pool_logprobs != before_logprobs)).flatten()
    real_rows = sorted(slot * MAX_DRAFTS + j for slot in write_slots for j in range(MAX_DRAFTS))
    extra_slot = engine.config.pool_slots * MAX_DRAFTS  # where writes aimed at slot 0 land
    assert set(changed.tolist()) - set(range(extra_slot, extra_slot + MAX_DRAFTS)) == set(real_rows)
    for slot, proposal in zip(write_slots, proposals):
        assert b.pool_tokens[slot * MAX_DRAFTS : (slot + 1) * MAX_DRAFTS].tolist() == proposal
    assert b.pool_tokens[:MAX_DRAFTS].tolist() == [VOCAB - 1] * MAX_DRAFTS
    assert b.pool_logprobs[:MAX_DRAFTS].tolist() == [0.0, -float("inf")]
