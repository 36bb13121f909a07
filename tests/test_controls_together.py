"""Every sampling control at once, through the loop (issue 14).

The penalties, the logit bias and the allowed tokens live in control slots
(`engine/step/control_state.py`); bad words reach the logits through the per-row
token bitmask (`engine/sampling/token_bitmask.py`). On the CPU a step runs the
controls where a request holds a slot or a row is masked, the bitmask where a row
is restricted. These tests mix
requests that use one, the other, both and neither in one batch (n > 1 among
them) and check what the contract promises of the mix: the CUDA graph's every
stage for every row gives the CPU's per-step choice, strict drafts emit
the tokens of one-token decoding, replay equals eager, a request is the same
alone and in a crowd, and what the controls forbid never appears.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine import EngineConfig, SamplingParams
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.step.lm_head import StepKind
from tests.test_decode_loop import CONFIG, tiny_model

VOCAB = CONFIG.vocab_size
ODD = tuple(range(1, VOCAB, 2))


def _mixed_requests() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(7)
    prompts = []
    for _ in range(6):
        motif = rng.integers(3, VOCAB, int(rng.integers(2, 4))).tolist()
        prompts.append((motif * 5)[: int(rng.integers(5, 12))])
    sampled = dict(temperature=0.9, top_p=0.95, max_tokens=12, logprobs=1)
    params = [
        # Everything on one request: penalties, bias, allowed tokens and bad words.
        SamplingParams(**sampled, seed=1, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3,
                       logit_bias={5: 4.0, 6: -50.0}, allowed_token_ids=ODD,
                       bad_words=((prompts[0][-1],), (7, 9))),
        # Bad words alone (the bitmask, no control slot).
        SamplingParams(**sampled, seed=2, bad_words=tuple((t,) for t in range(0, VOCAB, 3))),
        # Controls alone (a control slot, no bitmask).
        SamplingParams(**sampled, seed=3, repetition_penalty=0.7, logit_bias={11: 2.5}),
        # Plain.
        SamplingParams(**sampled, seed=4),
        # Greedy with penalties and bad words (one sample: greedy with n > 1 is refused, as vLLM).
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.8, presence_penalty=1.0,
                       bad_words=((prompts[4][0], prompts[4][1]),)),
        # Two sampled samples with both kinds.
        SamplingParams(**sampled, seed=6, n=2, frequency_penalty=1.2, bad_words=((13,), (14, 15))),
    ]
    return prompts, params


def _flatter_model():
    """The tiny random model with its logits scaled down: unscaled, one token
    outweighs the rest by more than any penalty, and every control would
    leave the tokens as they were."""
    model = tiny_model(10)
    model.weights.final_norm.mul_(0.1)
    return model


def _run(prompts, params, *, drafts: int, graphs: bool = False, max_num_reqs: int = 8, ids=None):
    loop = DecodeLoop(_flatter_model(), LoopConfig(seed_base=0, max_num_reqs=max_num_reqs, token_budget=96, max_draft_tokens=drafts),
                      engine_config=EngineConfig(device="cpu", use_graphs=graphs), capture=graphs)
    ids = list(range(len(prompts))) if ids is None else ids
    for rid, prompt, p in zip(ids, prompts, params):
        loop.submit(rid, prompt, p)
    done = loop.run()
    result = {key: (c.tokens, c.finish_reason, [lp.logprob for lp in c.logprobs or []]) for key, c in done.items()}
    return result, loop


def test_strict_drafts_with_every_control_emit_what_one_token_decoding_emits():
    prompts, params = _mixed_requests()
    plain, _ = _run(prompts, params, drafts=0)
    drafted, loop = _run(prompts, params, drafts=3)
    assert drafted == plain
    assert loop.stats.drafts_accepted > 0  # the drafts were verified, and some taken
    assert loop.engine.controls.free_slots == loop.engine.config.max_control_slots  # every slot given back


def test_replay_equals_eager_and_a_request_is_the_same_alone_and_in_the_crowd():
    prompts, params = _mixed_requests()
    eager, _ = _run(prompts, params, drafts=2)
    replayed, _ = _run(prompts, params, drafts=2, graphs=True)
    assert replayed == eager
    for i in (0, 1, 5):
        alone, _ = _run([prompts[i]], [params[i]], drafts=2, ids=[i], max_num_reqs=2)
        assert alone == {key: value for key, value in eager.items() if key == i or (isinstance(key, tuple) and key[0] == i)}


def test_what_the_controls_forbid_never_appears():
    prompts, params = _mixed_requests()
    done, _ = _run(prompts, params, drafts=2)
    tokens = {key: value[0] for key, value in done.items()}
    assert set(tokens[0]) <= set(ODD)
    assert prompts[0][-1] not in tokens[0]
    assert all(t % 3 for t in tokens[1])
    output = tokens[4]  # a word's prefix is matched on the output only, as vLLM
    generated_pairs = {(output[i - 1], output[i]) for i in range(1, len(output))}
    assert (prompts[4][0], prompts[4][1]) not in generated_pairs
    for j in range(2):
        assert 13 not in tokens[(5, j)]
    assert tokens[(5, 0)] != tokens[(5, 1)]  # samples draw with their own seeds
    for key in tokens:
        assert done[key][1] in ("stop", "length")


def _every_stage(loop: DecodeLoop) -> None:
    """The torch head as its CUDA graph runs: every stage for every row (the full sampler,
    the controls through the neutral slot 0 where a request holds none, the token bitmask
    with unrestricted rows as all ones), however little the step's requests need."""
    head = loop.engine.head
    head.per_step = False
    head.kind = StepKind(head.full, controls=head.controls is not None, masked=head.applies_token_bitmask)


def _run_every_stage(prompts, params, drafts: int, mode: str):
    loop = DecodeLoop(_flatter_model(), LoopConfig(seed_base=0, max_num_reqs=8, token_budget=96, max_draft_tokens=drafts),
                      engine_config=EngineConfig(device="cpu", use_graphs=False, verify_mode=mode))
    _every_stage(loop)
    for rid, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(rid, prompt, p)
    done = loop.run()
    return {key: (c.tokens, c.finish_reason, [lp.logprob for lp in c.logprobs or []]) for key, c in done.items()}


@pytest.mark.parametrize("drafts, mode", [(0, "strict"), (2, "strict"), (2, "rejection")])
def test_one_step_of_every_stage_gives_the_tokens_of_the_per_step_choice(drafts, mode):
    """One step function per bucket: the CPU head picks per step what the requests need;
    the CUDA graph runs every stage for every row. Both give the same tokens and logprobs,
    steps with a bitmask, with controls, with both and with neither (requests finish at
    different steps: later steps run over bitmask rows a masked step left behind)."""
    prompts, params = _mixed_requests()
    # The requests without bad words (2, 3) go last and outlive the others: their last steps
    # have no bitmask, and their rows held the bad-words rows of the steps before.
    order = [0, 1, 4, 5, 2, 3]
    prompts = [prompts[i] for i in order]
    params = [dataclasses.replace(params[i], max_tokens=params[i].max_tokens + 8 * (i in (2, 3))) for i in order]
    loop = DecodeLoop(_flatter_model(), LoopConfig(seed_base=0, max_num_reqs=8, token_budget=96, max_draft_tokens=drafts),
                      engine_config=EngineConfig(device="cpu", use_graphs=False, verify_mode=mode))
    for rid, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(rid, prompt, p)
    chosen = {key: (c.tokens, c.finish_reason, [lp.logprob for lp in c.logprobs or []]) for key, c in loop.run().items()}
    assert loop.engine.stats.steps > 12
    assert _run_every_stage(prompts, params, drafts, mode) == chosen
