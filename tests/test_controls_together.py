"""Every sampling control at once, through the loop (issue 14).

The penalties, the logit bias and the allowed tokens live in control slots
(`engine/step/control_state.py`); bad words reach the logits through the per-row
token bitmask (`engine/sampling/token_bitmask.py`). A step with both runs the
masked graph set, which applies the controls as well. These tests mix
requests that use one, the other, both and neither in one batch (n > 1 among
them) and check what the contract promises of the mix: strict drafts emit
the tokens of one-token decoding, replay equals eager, a request is the same
alone and in a crowd, and what the controls forbid never appears.
"""
from __future__ import annotations

import numpy as np

from engine import EngineConfig, SamplingParams
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
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
