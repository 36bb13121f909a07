"""Context-parallel ledger broadcast and vocab-parallel sampling over gloo (issue 7).

Each multi-rank test forks `world` processes (fork, not spawn: no re-import of
torch per rank; each child runs torch with one thread, so the parent's OpenMP
pool is never touched after the fork), joins a gloo group on a free local
port with a 30 s timeout, and writes what it saw to a pickle; the parent
compares against the single-process StepEngine / ledger over the same inputs.
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

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine, prepare_sampler_inputs
import engine.parallel.vocab_parallel as vocab_parallel_module
import engine.sampling.candidates as candidates_module
from engine.ops import default_block_rows, gather
from engine.parallel import (
    LedgerBroadcaster,
    ParallelConfig,
    ShardedStepEngine,
    StepPlan,
    VocabShards,
    batch_fingerprint,
    request_key,
)
from engine.parallel.vocab_parallel import VocabParallelSampler, candidate_ineligibility
from engine.sampling.normaliser import BLOCK
from engine.sampling.row_params import RowParams
from engine.sampling.rows import expand_rows
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import SamplerConfig, sample
from engine.sampling.suppression import suppressed_scores
from engine.sampling.thresholds import mass_bits, row_distribution

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
    drafts; `eligible`: every request greedy or top_k in 1..50 (the candidate
    strategy's domain), else some requests sample unfiltered or by top-p only."""
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


def _sharded_worker(rank: int, world: int, cases: list) -> dict:
    shards = VocabShards.split(VOCAB, world)
    results = {}
    for strategy in ("gather", "candidates"):
        engine = ShardedStepEngine(shards.shard(_weight(), rank), VOCAB, CONFIG, ParallelConfig(strategy=strategy, k_cap=50))
        engine.capture()
        outs = []
        for seqs, hidden, drafts in cases:
            # Followers get no batch: everything they need comes in the broadcast.
            out = engine.step(hidden, seqs if rank == 0 else None, drafts if rank == 0 else None)
            outs.append(_outputs(out))
        results[strategy] = (outs, engine.parallel_stats, engine.stats.replays)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_equals_unsharded(world: int, tmp_path) -> None:
    cases = make_cases()
    reference = StepEngine(_weight(), CONFIG)
    reference.capture()
    expected = [_outputs(reference.step(hidden, seqs, drafts)) for seqs, hidden, drafts in cases]
    assert sum(sum(o[4]) for o in expected) > 0, "no draft was accepted: the strict path is untested"
    assert any(p is not None for o in expected for p in o[2]), "no prompt logprobs requested"
    results = run_ranks(world, _sharded_worker, (cases,), tmp_path)
    for rank, result in enumerate(results):
        for strategy, (outs, stats, replays) in result.items():
            for i, (got, want) in enumerate(zip(outs, expected)):
                assert got == want, f"rank {rank}, strategy {strategy}, batch {i}"
            assert replays == NUM_BATCHES
            if strategy == "candidates":
                assert stats.candidate_steps == NUM_BATCHES - NUM_BATCHES // 3
                assert stats.candidate_fallbacks == NUM_BATCHES // 3
                assert "top_k=0" in stats.last_fallback_reason
            else:
                assert stats.gather_steps == NUM_BATCHES and stats.candidate_fallbacks == 0


def _ledger_worker(rank: int, world: int, batches: list) -> list:
    broadcaster = LedgerBroadcaster()
    seen = []
    for seqs, hidden, kwargs in batches:
        def build() -> StepPlan:
            inputs = prepare_sampler_inputs(seqs, **kwargs)
            stop_ids = np.arange(inputs.num_reqs * 2, dtype=np.int64).reshape(-1, 2)
            return StepPlan(inputs, stop_ids, np.arange(inputs.num_sample_rows, dtype=np.int64) - 1)

        plan = broadcaster.share(build if rank == 0 else None, hidden_rows=hidden.shape[0], hidden_size=HIDDEN, config=1)
        rows = torch.as_tensor(plan.inputs.selected_token_indices, dtype=torch.int64)
        seen.append((plan, gather(hidden, rows)))
    return seen


def test_followers_rebuild_the_drivers_ledger(tmp_path) -> None:
    batches = []
    for seed in range(4):
        seqs, hidden = random_batch(seed, eligible=True)
        kwargs = {"max_draft_tokens": MAX_DRAFTS}
        if seed == 0:  # no drafts, no draft-info fields
            seqs = [s if s.is_prompt else replace(s, seqlen_q=1, seqlen_k=s.seqlen_k - s.seqlen_q + 1) for s in seqs]
            hidden = hidden[: sum(s.seqlen_q for s in seqs)]
            kwargs = {}
        if seed == 2:  # compaction: output rows and query tokens differ
            seqs = [replace(s, params=replace(s.params, prompt_logprobs=False)) for s in seqs]
            kwargs["compaction_keep_tokens"] = 2
        if seed == 3:  # forced tokens reach the followers too
            seqs = [replace(s, forced_token=7 + i) if i % 2 == 0 else s for i, s in enumerate(seqs)]
        batches.append((seqs, hidden, kwargs))
    results = run_ranks(2, _ledger_worker, (batches,), tmp_path)
    for (seqs, hidden, kwargs), (driver, _), (follower, follower_rows) in zip(batches, results[0], results[1]):
        expected = prepare_sampler_inputs(seqs, **kwargs)
        keys = tuple(request_key(s.request_id) for s in seqs)
        assert follower.inputs == replace(expected, request_ids=keys)
        assert driver.inputs == expected
        assert np.array_equal(follower.stop_ids, driver.stop_ids)
        assert np.array_equal(follower.row_drafts, driver.row_drafts)
        rows = torch.as_tensor(expected.selected_token_indices, dtype=torch.int64)
        assert torch.equal(follower_rows, gather(hidden, rows))


def _mismatch_worker(rank: int, world: int, cases: list) -> list:
    shards = VocabShards.split(VOCAB, world)
    engine = ShardedStepEngine(shards.shard(_weight(), rank), VOCAB, CONFIG, ParallelConfig(strategy="candidates"))
    errors = []
    for seqs_by_rank, hidden, drafts in cases:
        try:
            engine.step(hidden, seqs_by_rank[rank], drafts if rank == 0 else None)
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_mismatching_batch_raises_on_every_rank(tmp_path) -> None:
    seqs, hidden = random_batch(1, eligible=True)
    seqs = [s if s.is_prompt else replace(s, seqlen_q=1, seqlen_k=s.seqlen_k - s.seqlen_q + 1) for s in seqs]
    hidden = hidden[: sum(s.seqlen_q for s in seqs)]
    other = list(seqs)
    other[0] = replace(other[0], request_id="someone-else")
    bad_draft = [None] * len(seqs)
    decode = next(i for i, s in enumerate(seqs) if not s.is_prompt)
    bad_draft[decode] = [1]  # a draft for a request that verifies none
    cases = [
        ((seqs, seqs), hidden, None),  # agreement: runs
        ((seqs, other), hidden, None),  # rank 1 holds another batch
        ((seqs, None), hidden, bad_draft),  # the driver rejects its own batch
        ((seqs, None), hidden, None),  # and the group still works afterwards
    ]
    results = run_ranks(2, _mismatch_worker, (cases,), tmp_path)
    for errors in results:
        assert errors[0] is None and errors[3] is None
        assert "rank 1: its batch differs from rank 0's" in errors[1]
        assert "draft_tokens has 1 tokens" in errors[2]
    assert results[1][2].startswith("rank 0 (driver) rejected the batch")


def test_shards_align_to_blocks() -> None:
    for vocab, tp in [(4000, 2), (4000, 4), (128256, 4), (131072, 2), (1024 * 5, 4)]:
        shards = VocabShards.split(vocab, tp)
        assert sum(shards.sizes) == vocab and shards.starts[0] == 0
        assert all(s % BLOCK == 0 for s in shards.starts)
        assert all(a + n == b for a, n, b in zip(shards.starts, shards.sizes, shards.starts[1:]))
    with pytest.raises(ValueError, match="cannot feed tp=4"):
        VocabShards.split(3000, 4)


def test_candidate_eligibility() -> None:
    temps = np.array([0.0, 1.0, 0.7], dtype=np.float32)
    assert candidate_ineligibility(temps, np.array([0, 5, 50], dtype=np.int32), 50, VOCAB) is None
    assert "request 2 samples with top_k=51" in candidate_ineligibility(temps, np.array([0, 5, 51], dtype=np.int32), 50, VOCAB)
    assert "top_k=0" in candidate_ineligibility(temps, np.array([3, 0, 5], dtype=np.int32), 50, VOCAB)


def test_batch_fingerprint_sees_lengths_and_ids() -> None:
    seqs, _ = random_batch(3, eligible=True)
    assert batch_fingerprint(seqs) == batch_fingerprint(list(seqs))
    assert batch_fingerprint(seqs) != batch_fingerprint(seqs[:-1])
    assert batch_fingerprint(seqs) != batch_fingerprint([replace(seqs[0], request_id="x"), *seqs[1:]])
    assert request_key(12) == 12 and request_key("a") == request_key("a") != request_key("b")


@pytest.fixture
def one_rank_group():
    """This process as a gloo group of one: the sharded engine in-process, tp = 1."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_lm_head_block_size_for_sampled_and_prompt_rows(one_rank_group, monkeypatch) -> None:
    """EngineConfig.block_rows (default: engine.ops.default_block_rows) is the one LM-head
    block size: the vocab-parallel head runs it for the sampled rows and the prompt
    logprobs alike, and matches the unsharded engine bit for bit."""
    blocks = []
    real_get_logits = vocab_parallel_module.get_logits

    def recording_get_logits(hidden, weight, **kwargs):
        blocks.append(kwargs.get("block_rows"))
        return real_get_logits(hidden, weight, **kwargs)

    monkeypatch.setattr(vocab_parallel_module, "get_logits", recording_get_logits)
    prompt = SeqMeta("p", True, 6, 6, 6, prompt_tokens=np.arange(6), params=SamplingParams(prompt_logprobs=2, logprobs=1))
    for block_rows, expected in ((None, default_block_rows("cpu")), (8, 8)):
        config = replace(CONFIG, logits_block_rows=block_rows)
        assert config.block_rows == expected
        sharded = ShardedStepEngine(_weight(), VOCAB, config, ParallelConfig(strategy="gather"))
        reference = StepEngine(_weight(), config)
        sharded.capture()
        reference.capture()
        blocks.clear()
        for seed in range(3):
            seqs, hidden = random_batch(seed, eligible=True)
            seqs = [prompt, *seqs[: MAX_REQS - 1]]
            hidden = torch.cat([torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(50 + seed)),
                                hidden[: sum(s.seqlen_q for s in seqs[1:])]])
            got = sharded.step(hidden, seqs)
            assert got.prompt_logprobs[0] and _outputs(got) == _outputs(reference.step(hidden, seqs))
        assert len(blocks) >= 6 and set(blocks) == {expected}  # per step: the sampled rows, a prompt chunk


def test_candidates_draw_over_the_full_rows_weights(one_rank_group, monkeypatch) -> None:
    """The candidate exchange decides a row as the unsharded sampler does:
    every row it does not flag has the sampler's outputs, and its draw runs
    over the full row's kept weights, bit for bit, and top-p's walk over the
    full row's masses (a wrong mass scale, the candidates' count instead of
    V, moves a cut by a sliver of the row's mass that the outputs almost
    never show)."""
    rows_n, k_cap, stops = 48, 50, 4
    rng = np.random.default_rng(5)
    logits = torch.from_numpy(rng.standard_normal((rows_n, VOCAB)).astype(np.float32) * 3)
    logits[::4] = logits[::4].round()  # ties at the top-k cut: some rows flagged
    stop_ids = rng.integers(0, VOCAB, (rows_n, stops))
    stop_ids[:, 0] = logits.argmax(-1).numpy()  # the largest logit suppressed on some rows
    params = RowParams.from_numpy(
        temperatures=rng.choice([0.0, 0.3, 1.0, 2.0], rows_n).astype(np.float32),
        top_ks=rng.choice([1, 5, 20, 50], rows_n).astype(np.int32),
        top_ps=rng.choice([1.0, 0.9, 0.5], rows_n).astype(np.float32),
        min_ps=rng.choice([0.0, 0.05], rows_n).astype(np.float32),
        seeds=rng.integers(0, 2**63, rows_n).astype(np.uint64), sample_positions=rng.integers(0, 99, rows_n),
        row_to_req=np.arange(rows_n), local_step=np.zeros(rows_n, np.int64), stop_ids=stop_ids,
        eos_suppression_rows=rng.random(rows_n) < 0.5,
        # Forced tokens, mostly outside the candidates: their logprobs need the full row.
        forced_tokens=np.where(np.arange(rows_n) % 6 == 1, rng.integers(0, VOCAB, rows_n), -1))
    config = SamplerConfig(candidate_cap=256, max_logprobs=5)
    sampler = VocabParallelSampler(VocabShards.split(VOCAB, 1), 0, max_rows=rows_n, k_cap=k_cap, max_stop_ids=stops,
                                   sampler=config, full_logits=torch.zeros(rows_n, VOCAB))
    sampler.local_logits.copy_(logits)
    drawn_over, masses = [], []
    real_draw, real_masses = candidates_module.inverse_cdf_draw, candidates_module.token_masses

    def recording_draw(weights, block_mass, u):
        drawn_over.append(weights.clone())
        return real_draw(weights, block_mass, u)

    def recording_masses(weights, vocab=None):
        masses.append(real_masses(weights, vocab))
        return masses[-1]

    monkeypatch.setattr(candidates_module, "inverse_cdf_draw", recording_draw)
    monkeypatch.setattr(candidates_module, "token_masses", recording_masses)
    got = SampleOutput.allocate(rows_n, 5)
    sampler.sample_candidates(rows_n, params, got)
    want = sample(logits, params, config, SampleOutput.allocate(rows_n, 5))
    settled = ~got.needs_exact
    assert 0 < int(settled.sum()) < rows_n
    for name in ("tokens", "logprob", "rank", "top_ids", "top_logprobs", "error"):
        assert torch.equal(getattr(got, name)[settled], getattr(want, name)[settled]), name
    rows = expand_rows(params, VOCAB)
    masked = suppressed_scores(logits, rows)
    full = row_distribution(masked, masked.amax(-1), rows).weights  # [rows, V] f32, by token id
    assert len(drawn_over) == len(masses) == 1
    scale = float(2 ** mass_bits(VOCAB))
    for r in torch.nonzero(settled & ~rows.greedy).flatten().tolist():
        assert torch.equal(drawn_over[0][r], full[r]), r
        assert float(masses[0][r].max()) == scale, r  # the largest token's exp(0) = 1 weighs 2**S(V)


def test_rollback_restores_the_sharded_heads_counters(one_rank_group) -> None:
    engine = ShardedStepEngine(_weight(), VOCAB, CONFIG, ParallelConfig(strategy="candidates", k_cap=50))
    engine.capture()
    seqs, hidden = random_batch(0, eligible=True)
    engine.step(hidden, seqs)
    mark, before = engine.checkpoint(), copy.deepcopy(engine.parallel_stats)
    engine.step(hidden, seqs)
    assert engine.parallel_stats != before
    engine.rollback(mark)
    assert engine.parallel_stats == before
    engine.step(hidden, seqs)  # the restored counters count on
    assert engine.parallel_stats.candidate_steps == before.candidate_steps + 1


def test_the_sharded_engine_overrides_no_private_method() -> None:
    """Composition: what differs lives in its LM-head strategy, not in overrides of StepEngine's internals."""
    private = {name for name in vars(ShardedStepEngine) if name.startswith("_") and not name.startswith("__")}
    assert not private & set(dir(StepEngine))


def test_the_sharded_engine_refuses_sampling_controls_at_submission(one_rank_group) -> None:
    engine = ShardedStepEngine(_weight(), VOCAB, replace(CONFIG, max_control_slots=4), ParallelConfig(strategy="gather"))
    assert engine.controls is None
    seq = SeqMeta("c", True, 2, 2, 2, prompt_tokens=[1, 2], params=SamplingParams(logit_bias={1: 2.0}))
    with pytest.raises(ValueError, match=r"request 'c': logit_bias=\{1: 2.0\}: VocabParallelHead does not apply"):
        engine.step(torch.zeros(2, HIDDEN), [seq])
