"""The vocab-sharded step over gloo ranks, driven as an engine drives one device.

Each multi-rank test forks `world` processes (fork, not spawn: no re-import of
torch per rank; each child runs torch with one thread, so the parent's OpenMP
pool is never touched after the fork), joins a gloo group on a free local
port with a 30 s timeout, and writes what it saw to a pickle; the parent
compares against the single-process StepEngine over the same inputs. Every rank
builds `StepEngine(sharded_head(its shard))` and steps the same `SeqMeta` batches
(tests/test_shard_heads.py drives the PersistentBatch front with every control).
"""
from __future__ import annotations

import copy
import datetime
import os
import pickle
import socket
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine
from engine.parallel import sharded_head, vocab_shards
from engine.parallel.shard_heads import SHARD_ALIGN
from engine.sampling.sampler import SamplerConfig

VOCAB, HIDDEN, MAX_REQS, MAX_DRAFTS = 4000, 32, 8, 3  # 4000: an uneven last shard with a partial block
CONFIG = EngineConfig(
    max_num_reqs=MAX_REQS,
    max_draft_tokens=MAX_DRAFTS,
    buckets=(2, 8),
    device="cpu",
    eos_token_id=7,
    max_source_rows=256,
    sampler=SamplerConfig(candidate_cap=256, max_logprobs=5),
)
NUM_BATCHES = 6


def _weight() -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, out_dir: str, worker, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        result = worker(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(world: int, worker, args: tuple, tmp_path) -> list:
    """Run `worker(rank, world, *args)` on `world` forked gloo ranks; their return values."""
    mp.start_processes(_child, args=(world, _free_port(), str(tmp_path), worker, args), nprocs=world, start_method="fork")
    results = []
    for rank in range(world):
        with open(tmp_path / f"{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def random_batch(seed: int, *, eligible: bool) -> tuple[list[SeqMeta], torch.Tensor]:
    """Prefill chunks (some with prompt logprobs), decodes with 0..MAX_DRAFTS
    drafts; `eligible`: every request greedy or top_k in 1..50, else some requests
    sample unfiltered or by top-p only."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, MAX_REQS + 1))
    seqs = []
    for i in range(n):
        top_k = int(rng.choice([1, 5, 20, 50]))
        temperature = float(rng.choice([0.0, 0.7, 1.0, 1.3]))
        if not eligible and rng.random() < 0.5:
            top_k, temperature = 0, 1.0
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=float(rng.choice([1.0, 0.9, 0.5])),
            min_p=float(rng.choice([0.0, 0.05])),
            seed=int(rng.integers(2**63)) if rng.random() < 0.7 else None,
            logprobs=int(rng.choice([0, 3, 5])) if rng.random() < 0.6 else None,
            min_tokens=int(rng.integers(3)),
            prompt_logprobs=int(rng.choice([0, 2])) if rng.random() < 0.5 else False,
        )
        prompt_len = int(rng.integers(2, 12))
        tokens = rng.integers(0, VOCAB, prompt_len)
        if rng.random() < 0.35:
            k = int(rng.integers(1, prompt_len + 1))
            q = int(rng.integers(1, k + 1))
            if q < k:  # a later chunk: its earlier chunks are not in these tests
                params = replace(params, prompt_logprobs=False)
            seqs.append(SeqMeta(f"req-{seed}-{i}", True, q, k, prompt_len, prompt_tokens=tokens, params=params,
                                mtp_write_slot=i + 1))
        else:
            drafts = int(rng.integers(MAX_DRAFTS + 1))
            gen = int(rng.integers(1, 20))
            seqs.append(SeqMeta(i + 100 * seed, False, 1 + drafts, prompt_len + gen + drafts, prompt_len,
                                prompt_tokens=tokens, num_generated=gen, params=replace(params, prompt_logprobs=False),
                                mtp_read_slot=int(rng.integers(3)), mtp_write_slot=i + 1))
    rows = sum(s.seqlen_q for s in seqs)
    hidden = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return seqs, hidden


def accepting_drafts(engine: StepEngine, seqs, hidden, seed: int) -> list:
    """Drafts that the strict verifier accepts in part or in full: the rows'
    own draws (read from the static outputs after a probe step), with some
    drafts replaced by a wrong token so rejections happen too."""
    rng = np.random.default_rng(seed)
    probe = [None if s.is_prompt else [0] * (s.seqlen_q - 1) for s in seqs]
    engine.step(hidden, seqs, probe)
    draws = engine.buffers.out.tokens.clone().numpy()
    drafts, row = [], 0
    for s in seqs:
        if s.is_prompt:
            drafts.append(None)
            row += 1
            continue
        mine = draws[row : row + s.seqlen_q - 1].tolist()
        if mine and rng.random() < 0.4:
            j = int(rng.integers(len(mine)))
            mine[j] = (mine[j] + 1) % VOCAB
        drafts.append(mine)
        row += s.seqlen_q
    return drafts


def make_cases() -> list:
    reference = StepEngine(_weight(), CONFIG)
    cases = []
    for seed in range(NUM_BATCHES):
        seqs, hidden = random_batch(seed, eligible=seed % 3 != 2)
        cases.append((seqs, hidden, accepting_drafts(reference, seqs, hidden, seed)))
    return cases


def _outputs(out) -> tuple:
    return (out.tokens, out.logprobs, out.prompt_logprobs, out.seeds, out.num_accepted)


def _sharded_worker(rank: int, world: int, cases: list) -> tuple[list, int, int]:
    head = sharded_head(vocab_shards(VOCAB, world).shard(_weight(), rank), VOCAB, CONFIG)
    engine = StepEngine(head, CONFIG)
    engine.capture()
    outs = [_outputs(engine.step(hidden, seqs, drafts)) for seqs, hidden, drafts in cases]
    return outs, engine.stats.replays, head.stats.steps


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_equals_unsharded(world: int, tmp_path) -> None:
    cases = make_cases()
    reference = StepEngine(_weight(), CONFIG)
    reference.capture()
    expected = [_outputs(reference.step(hidden, seqs, drafts)) for seqs, hidden, drafts in cases]
    assert sum(sum(o[4]) for o in expected) > 0, "no draft was accepted: the strict path is untested"
    assert any(p is not None for o in expected for p in o[2]), "no prompt logprobs requested"
    for rank, (outs, replays, exchanges) in enumerate(run_ranks(world, _sharded_worker, (cases,), tmp_path)):
        for i, (got, want) in enumerate(zip(outs, expected)):
            assert got == want, f"rank {rank}, batch {i}"
        assert replays == NUM_BATCHES and exchanges >= NUM_BATCHES


def test_shards_align_to_blocks() -> None:
    for vocab, tp in [(4000, 2), (4000, 4), (128256, 4), (131072, 2), (1024 * 5, 4), (1500, 2)]:
        shards = vocab_shards(vocab, tp)
        assert sum(shards.sizes) == vocab and shards.starts[0] == 0
        assert all(s % SHARD_ALIGN == 0 for s in shards.starts)
        assert all(a + n == b for a, n, b in zip(shards.starts, shards.sizes, shards.starts[1:]))
        assert shards.sizes[-1] == min(shards.sizes) > 0
    with pytest.raises(ValueError, match="cannot feed tp=4"):
        vocab_shards(3 * SHARD_ALIGN, 4)
    with pytest.raises(ValueError, match="tp=0"):
        vocab_shards(4000, 0)


@pytest.fixture
def one_rank_group():
    """This process as a gloo group of one: the sharded head in-process, tp = 1."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_rollback_restores_the_sharded_heads_counters(one_rank_group) -> None:
    head = sharded_head(_weight(), VOCAB, CONFIG)
    engine = StepEngine(head, CONFIG)
    engine.capture()
    seqs, hidden = random_batch(0, eligible=True)
    engine.step(hidden, seqs)
    mark, before = engine.checkpoint(), copy.deepcopy(head.stats)
    engine.step(hidden, seqs)
    assert head.stats != before
    engine.rollback(mark)
    assert head.stats == before
    engine.step(hidden, seqs)  # the restored counters count on
    assert head.stats.steps == before.steps + 1


def test_a_sharded_engine_takes_sampling_controls(one_rank_group) -> None:
    """The shard heads run the single-device stages: a control changes the draw as on one device."""
    config = replace(CONFIG, max_control_slots=4)
    engine, reference = StepEngine(sharded_head(_weight(), VOCAB, config), config), StepEngine(_weight(), config)
    seq = SeqMeta("c", True, 2, 2, 2, prompt_tokens=[1, 2], params=SamplingParams(temperature=0.0, logit_bias={11: 100.0}))
    hidden = torch.zeros(2, HIDDEN)
    got, want = engine.step(hidden, [seq]), reference.step(hidden, [seq])
    assert got.tokens == want.tokens == [[11]]
