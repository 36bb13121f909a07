"""The single-device heads over vocabulary shards (engine/parallel/shard_heads.py), two gloo ranks.

The reference is the unsharded StepEngine over the whole weight with the same head kind:
each rank of a 2-rank group (forked, as in tests/test_parallel.py) builds
`StepEngine(sharded_head(its shard))` and runs the same requests through a PersistentBatch
(controls, bad words through the token bitmask, min_tokens and stop ids, logprobs, prompt
logprobs, drafts), the same hidden states (a NaN row among them) and drafts, step after
step. Every rank's StepOutputs must equal the unsharded engine's exactly: tokens, errors,
accepted drafts and every logprob bit, with the torch sampler and with the Triton kernels
(in the interpreter on CPU). V = 1500: an uneven split (768 + 732 tokens) whose shorter
shard is padded.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from engine import EngineConfig, SamplingParams, StepEngine
from engine.ops import get_logits
from engine.parallel.shard_heads import ShardedKernelHead, ShardedLocalHead, sharded_head, vocab_shards
from engine.sampling.sampler import SamplerConfig
from engine.step.batch import PersistentBatch
from engine.step.step_output import StepOutput
from tests.test_parallel import run_ranks

VOCAB, HIDDEN, MAX_REQS, MAX_DRAFTS, EOS = 1500, 32, 4, 1, 2
WEIGHT = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3))
BASE = dict(max_num_reqs=MAX_REQS, max_control_slots=MAX_REQS, device="cpu", eos_token_id=EOS, max_source_rows=64,
            max_logit_bias=8, max_allowed_token_ids=64, max_draft_tokens=MAX_DRAFTS, buckets=(2, 4),
            prompt_logprobs_chunk_rows=3)


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """Every kind of row at once: greedy, filtered and plain draws, penalties, bias,
    allowed tokens, bad words, min_tokens with a stop id, logprobs and prompt logprobs."""
    return [
        ([5, 9, 13, 2, 40], SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2, min_tokens=2,
                                           stop_token_ids=(7,))),
        ([1, 2, 3], SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=11, logprobs=2,
                                   repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={3: 4.0, 1400: -2.0})),
        ([1200, 7, 7], SamplingParams(temperature=1.0, seed=12, presence_penalty=-0.4, bad_words=((5, 9), (11,)),
                                      allowed_token_ids=tuple(range(3, 1500, 25)), prompt_logprobs=0)),
        ([9], SamplingParams(temperature=0.7, top_p=0.8, seed=13, logprobs=0)),
    ]


def _drive(engine: StepEngine, seed: int, steps: int = 2) -> list[StepOutput]:
    """The requests through `engine`: a prefill, then `steps` decodes with one draft each
    (half of them the row's argmax, so both verdicts occur); the first request's first
    hidden row is NaN in the last decode (its request fails that step)."""
    rng = np.random.default_rng(seed)
    requests = _requests()
    batch = PersistentBatch(engine)
    ids = list(range(len(requests)))
    generated = [0] * len(ids)
    outs = []
    for step in range(1 + steps):
        prefill = step == 0
        q = [len(p) if prefill else 1 + MAX_DRAFTS for p, _ in requests]
        kv = [len(p) + generated[i] + (0 if prefill else q[i] - 1) for i, (p, _) in enumerate(requests)]
        hidden = torch.from_numpy(rng.standard_normal((sum(q), HIDDEN)).astype(np.float32))
        drafts = None
        if not prefill:
            best = (hidden @ WEIGHT.T).argmax(-1).tolist()
            drafts = [[best[sum(q[:i])] if rng.random() < 0.5 else int(rng.integers(0, VOCAB))] for i in ids]
        if step == steps:
            hidden[0] = float("nan")
        if prefill:
            for i, (prompt, params) in enumerate(requests):
                batch.add(i, prompt, params)
        prepared = batch.prepare(ids, q, kv, draft_tokens=drafts)
        out = engine.run(hidden, prepared.inputs, prepared.arrays)
        batch.record(prepared, out)
        outs.append(out)
        generated = [g + len(t) for g, t in zip(generated, out.tokens)]
    return outs


def _captured(engine: StepEngine) -> StepEngine:
    # On CPU: each bucket's step under the capture-safety check, then replayed as steps.
    # The kernels capture only with use_graphs (their capture costs a minute in the interpreter).
    if engine.config.use_graphs:
        engine.capture()
    return engine


def _sharded_worker(rank: int, world: int, config: EngineConfig, seed: int,
                    steps: int) -> tuple[str, list[StepOutput], int]:
    head = sharded_head(vocab_shards(VOCAB, world).shard(WEIGHT, rank), VOCAB, config)
    return type(head).__name__, _drive(_captured(StepEngine(head, config)), seed, steps), head.stats.received_bytes


# The interpreter takes about 10 s per step of these four requests: one decode on the kernels,
# and the kernels' raw-logprob strict case only with ENGINE_LONG_TESTS=1 (what the shard adds,
# the logits stage, does not depend on the mode; the torch cases run both modes).
LONG = pytest.mark.skipif(not os.environ.get("ENGINE_LONG_TESTS"), reason="ENGINE_LONG_TESTS=1: the long variants")


@pytest.mark.parametrize("config, steps", [
    (EngineConfig(kernels="torch", **BASE), 2),
    (EngineConfig(kernels="torch", verify_mode="rejection", sampler=SamplerConfig(logprobs_mode="processed"), **BASE), 2),
    pytest.param(EngineConfig(kernels="triton", use_graphs=False, **BASE), 1, marks=LONG),
    (EngineConfig(kernels="triton", use_graphs=False, verify_mode="rejection",
                  sampler=SamplerConfig(logprobs_mode="processed"), **BASE), 1),
], ids=["torch", "torch-processed-rejection", "triton", "triton-processed-rejection"])
def test_two_ranks_give_the_unsharded_engines_outputs(config, steps, tmp_path):
    seed = 7
    expected = _drive(_captured(StepEngine(WEIGHT, config)), seed, steps)
    assert any(out.errors[0] for out in expected) and any(sum(out.num_accepted) for out in expected)
    results = run_ranks(2, _sharded_worker, (config, seed, steps), tmp_path)
    kind = "ShardedKernelHead" if config.resolved_kernels() == "triton" else "ShardedLocalHead"
    for rank, (head, outs, received) in enumerate(results):
        assert head == kind
        assert len(outs) == len(expected)
        for step, (got, want) in enumerate(zip(outs, expected)):
            assert got == want, f"rank {rank}, step {step}"
        assert received > 0


def test_a_shard_gives_the_whole_heads_logits_bits():
    """The assumption the exchange rests on, checked here: each logit of a shard's GEMM
    (padded or not) has the bits the whole head's GEMM gives it, at every row count."""
    shards = vocab_shards(VOCAB, 2)
    hidden = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(4))
    for rows in (1, 2, 9):
        whole = get_logits(hidden[:rows], WEIGHT, batch_invariant=True)
        for rank in range(2):
            part = get_logits(hidden[:rows], shards.shard(WEIGHT, rank), batch_invariant=True)
            start, size = shards.starts[rank], shards.sizes[rank]
            assert torch.equal(part, whole[:, start : start + size])


def test_a_shard_of_the_wrong_size_is_refused(tmp_path):
    def worker(rank: int, world: int) -> str:
        try:
            ShardedLocalHead(WEIGHT[:100], VOCAB, EngineConfig(device="cpu"), None)
        except ValueError as err:
            return str(err)
        return "accepted"

    for message in run_ranks(2, worker, (), tmp_path):
        assert "lm_head_shard: shape (100, 32)" in message and "holds" in message


def test_the_config_picks_the_sharded_kernel_head(tmp_path):
    def worker(rank: int, world: int) -> tuple[str, str, int]:
        shard = vocab_shards(VOCAB, world).shard(WEIGHT, rank)
        kinds = [type(sharded_head(shard, VOCAB, EngineConfig(device="cpu", kernels=k))).__name__
                 for k in ("torch", "triton")]
        return kinds[0], kinds[1], dist.get_world_size()

    for torch_kind, triton_kind, world in run_ranks(2, worker, (), tmp_path):
        assert (torch_kind, triton_kind, world) == (ShardedLocalHead.__name__, ShardedKernelHead.__name__, 2)
