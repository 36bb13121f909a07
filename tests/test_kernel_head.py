"""The kernel head (EngineConfig(kernels="triton"), engine/step/kernel_head.py) against the torch head.

Two engines over one weight, one with the torch-op head (the CPU path, the reference),
one with the fused Triton kernels, run in Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1 without CUDA). Both get the same requests
through a PersistentBatch each (controls, bad words through the token bitmask,
min_tokens and stop ids, forced tokens), the same hidden states (NaN rows among
them) and the same drafts, step after step, so the penalty counts and the draft pool
carry over. Tokens, errors, accepted drafts, ranks and top-N ids must be identical;
logprobs within 2 ulp (exp may differ by an ulp between implementations,
docs/contract.md §2). Small shapes: the interpreter runs each program in Python.
"""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, SamplingParams, StepEngine
from engine.sampling.sampler import SamplerConfig
from engine.step.batch import PersistentBatch
from engine.step.kernel_head import KERNELS, KernelHead
from engine.step.lm_head import LocalHead

VOCAB, HIDDEN = 300, 64  # not a multiple of 32: the bitmask's last word is partial
MAX_REQS, MAX_DRAFTS = 4, 1
EOS = 2
WEIGHT = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(5))
# The interpreter costs about a second per sample row and step here: few examples, more with ENGINE_LONG_TESTS=1.
EXAMPLES = 12 if os.environ.get("ENGINE_LONG_TESTS") else 2
# No shrinking: a failing example is reported as drawn (shrinking one costs minutes here).
PHASES = (Phase.explicit, Phase.reuse, Phase.generate)
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    phases=PHASES)


def _pair(**config: object) -> tuple[StepEngine, StepEngine]:
    base = dict(max_num_reqs=MAX_REQS, max_control_slots=MAX_REQS, device="cpu", eos_token_id=EOS,
                max_source_rows=64, max_logit_bias=8, max_allowed_token_ids=64, use_graphs=False)
    base.update(config)
    return (StepEngine(WEIGHT, EngineConfig(kernels="torch", **base)),
            StepEngine(WEIGHT, EngineConfig(kernels="triton", **base)))


@st.composite
def _params(draw: st.DrawFn, i: int) -> SamplingParams:
    controls = draw(st.booleans())
    return SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
        top_k=draw(st.sampled_from([0, 3, 40])),
        top_p=draw(st.sampled_from([1.0, 0.8])),
        min_p=draw(st.sampled_from([0.0, 0.05])),
        seed=draw(st.integers(0, 2**31)),
        logprobs=draw(st.sampled_from([None, 0, 3])),
        min_tokens=draw(st.sampled_from([0, 3])),
        stop_token_ids=(7,),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3])) if controls else 1.0,
        frequency_penalty=draw(st.sampled_from([0.0, 0.7])) if controls else 0.0,
        presence_penalty=draw(st.sampled_from([0.0, -0.4])) if controls else 0.0,
        logit_bias=draw(st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-5, 5, width=32), max_size=4))
        if controls else None,
        allowed_token_ids=tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30, unique=True)))
        if controls and draw(st.booleans()) else None,
        bad_words=((5, 9), (11,)) if draw(st.booleans()) else None,
    )


@st.composite
def _cases(draw: st.DrawFn) -> tuple[list, int, list[int]]:
    n = draw(st.integers(1, MAX_REQS))  # 3 of 4: a padding request slot in the bucket
    requests = [(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)), draw(_params(i))) for i in range(n)]
    return requests, draw(st.integers(0, 2**31)), draw(st.lists(st.integers(0, n - 1), max_size=1))


def _same(torch_out, triton_out) -> None:
    assert triton_out.tokens == torch_out.tokens
    assert triton_out.errors == torch_out.errors
    assert triton_out.num_accepted == torch_out.num_accepted
    for a, b in zip(torch_out.logprobs, triton_out.logprobs):
        assert (a is None) == (b is None)
        for x, y in zip(a or (), b or ()):
            assert (x.token, x.rank, [t for t, _ in x.top]) == (y.token, y.rank, [t for t, _ in y.top])
            for u, v in [(x.logprob, y.logprob), *((p, q) for (_, p), (_, q) in zip(x.top, y.top))]:
                assert u == v or abs(u - v) <= 2 * math.ulp(np.float32(u)) * 2**29, (u, v)


def _run(engines: tuple[StepEngine, StepEngine], case, steps: int = 2, rejection: bool = False) -> list:
    """The case's requests through both engines: a prefill, then `steps` decodes with drafts.
    Returns the torch engine's outputs, one per step."""
    requests, seed, nan_reqs = case
    rng = np.random.default_rng(seed)
    batches = [PersistentBatch(engine) for engine in engines]
    try:
        return _steps(engines, batches, requests, rng, nan_reqs, steps, rejection)
    finally:
        for batch in batches:  # the engines' control slots go back for the next example
            for i in range(len(requests)):
                if i in batch:
                    batch.remove(i)


def _steps(engines, batches, requests, rng, nan_reqs, steps, rejection) -> list:
    ids = list(range(len(requests)))
    torch_outs = []
    generated = [0] * len(ids)
    k = engines[0].config.max_draft_tokens
    for step in range(1 + steps):
        prefill = step == 0
        q = [len(p) if prefill else 1 + k for p, _ in requests]
        kv = [len(p) + generated[i] + (0 if prefill else q[i] - 1) for i, (p, _) in enumerate(requests)]
        hidden = torch.from_numpy(rng.standard_normal((sum(q), HIDDEN)).astype(np.float32))
        drafts = None
        if not prefill and k:
            # Half the drafts are the row's argmax, which a greedy row accepts: both verdicts occur.
            best = (hidden @ WEIGHT.T).argmax(-1).tolist()
            drafts = [[best[sum(q[:i]) + j] if rng.random() < 0.5 else int(rng.integers(0, VOCAB)) for j in range(k)]
                      for i in ids]
        for i in nan_reqs:
            hidden[sum(q[:i])] = float("nan")  # the request's first row: its hidden state fails
        q_logprobs = None
        if drafts and rejection:
            q_logprobs = [torch.log_softmax(torch.from_numpy(rng.standard_normal((k, VOCAB))).float() * 3, -1)
                          if rng.random() < 0.7 else None for _ in ids]
        outs = []
        for engine, batch in zip(engines, batches):
            if prefill:
                for i, (prompt, params) in enumerate(requests):
                    batch.add(i, prompt, params)
            prepared = batch.prepare(ids, q, kv, draft_tokens=drafts, draft_logprobs=q_logprobs)
            out = engine.run(hidden, prepared.inputs, prepared.arrays)
            batch.record(prepared, out)
            outs.append(out)
        _same(*outs)
        torch_outs.append(outs[0])
        generated = [g + len(t) for g, t in zip(generated, outs[0].tokens)]
    if engines[0].controls is not None:
        np.testing.assert_array_equal(engines[1].controls.counts.numpy(), engines[0].controls.counts.numpy())
    return torch_outs


def test_the_config_picks_the_head():
    torch_engine, triton_engine = _pair()
    assert isinstance(torch_engine.head, LocalHead) and isinstance(triton_engine.head, KernelHead)
    assert triton_engine.head.name == KERNELS
    assert EngineConfig(device="cpu").resolved_kernels() == "torch"
    assert EngineConfig(device="cuda").resolved_kernels() == "triton"
    with pytest.raises(ValueError, match="EngineConfig.kernels='cuda'"):
        EngineConfig(kernels="cuda")
    with pytest.raises(ValueError, match="top_k_space_verify"):
        StepEngine(WEIGHT, EngineConfig(kernels="triton", device="cpu", top_k_space_verify=True))


PLAIN = _pair()


@SETTINGS
@given(_cases())
def test_every_control_without_drafts(case):
    _run(PLAIN, case, steps=1)


def test_only_the_torch_head_keeps_a_copy_of_the_unprocessed_logits():
    """The torch head applies the controls to its logits in place, their unprocessed copy
    ([max_rows, V] f32) kept in the control state; the kernel head's logits stay
    unprocessed, so its control state has no copy (132 MB at 256 rows of V 129280), and
    its controlled steps still match the torch head's (the test above)."""
    torch_engine, triton_engine = PLAIN
    rows = torch_engine.buffers.max_rows
    assert torch_engine.controls.unprocessed.shape == (rows, VOCAB)
    assert "controls.unprocessed" in torch_engine.controls.static_tensors()
    assert triton_engine.controls.unprocessed is None
    assert not any("unprocessed" in name for name in triton_engine.controls.static_tensors())
    assert not any("unprocessed" in name for name in triton_engine.head.static_tensors())
    assert triton_engine.controls.nbytes == torch_engine.controls.nbytes - rows * VOCAB * 4
    with pytest.raises(RuntimeError, match="keep_unprocessed=False"):
        triton_engine.controls.rows(triton_engine.buffers, MAX_REQS)


def test_the_token_bitmask_and_its_empty_rows_reach_the_kernels():
    """Bad words that leave two requests 3 tokens, and a third none (its rows fail as the
    bitmask's, `RowError.NO_TOKEN_ALLOWED`): the kernel head's steps match the torch head's."""
    few = tuple((t,) for t in range(VOCAB) if t not in (17, 40, 41))
    case = ([([1, 2], SamplingParams(temperature=0.0, bad_words=few, logprobs=2)),
             ([3], SamplingParams(temperature=1.0, seed=5, bad_words=few)),
             ([4], SamplingParams(temperature=0.7, seed=6, bad_words=tuple((t,) for t in range(VOCAB))))], 11, [])
    for out in _run(PLAIN, case, steps=1):
        assert all(set(tokens) <= {17, 40, 41} for tokens in out.tokens[:2]), out.tokens
        assert out.errors[:2] == [None, None] and "no token allowed by the token bitmask" in out.errors[2], out.errors


def _greedy_first(case):
    """The first request greedy without controls: the drafts drawn from its rows' argmax
    are accepted, so both verdicts (and the rows after an accepted draft) occur."""
    requests, seed, nan_reqs = case
    prompt, params = requests[0]
    return [(prompt, SamplingParams(temperature=0.0, logprobs=params.logprobs)), *requests[1:]], seed, nan_reqs


STRICT = _pair(max_draft_tokens=MAX_DRAFTS)


@SETTINGS
@given(_cases())
def test_drafts_strict(case):
    _run(STRICT, _greedy_first(case), steps=1)


REJECTION = _pair(max_draft_tokens=MAX_DRAFTS, verify_mode="rejection")


@SETTINGS
@given(_cases())
def test_drafts_rejection(case):
    _run(REJECTION, _greedy_first(case), steps=1, rejection=True)


PROCESSED = _pair(sampler=SamplerConfig(logprobs_mode="processed", max_logprobs=5), max_control_slots=0)


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, phases=PHASES)
@given(_cases())
def test_processed_logprobs_report_the_same_kept_sets(case):
    requests, seed, nan_reqs = case
    requests = [(prompt, dataclasses.replace(params, logprobs=5, repetition_penalty=1.0, frequency_penalty=0.0,
                                             presence_penalty=0.0, logit_bias=None, allowed_token_ids=None))
                for prompt, params in requests]
    _run(PROCESSED, (requests, seed, nan_reqs), steps=1)


def test_captured_graphs_replay_what_the_eager_step_computes():
    """Captured (the CPU replay under the capture-safety check), one graph per bucket, the same tokens."""
    torch_engine, triton_engine = _pair(use_graphs=True, buckets=(2, 4))
    report = triton_engine.capture()
    assert tuple(report.buckets) == (4, 2)
    torch_engine.capture()
    case = ([([1, 2, 3], SamplingParams(temperature=0.8, top_k=40, seed=3, logprobs=2)),
             ([4], SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={3: 2.0})),
             ([9, 9], SamplingParams(temperature=1.0, top_p=0.8, seed=4, min_tokens=2, bad_words=((5, 9),)))], 7, [])
    _run((torch_engine, triton_engine), case, steps=1)
    assert triton_engine.stats.replays == 2


def test_the_gpu_checks_kernel_head_comparison_runs_twice_on_the_cpu(capsys):
    """`profiling.kernel_head_check` (gpu_check.sh runs it on a GPU) at a small shape: its second
    run's requests find control slots (the first run's are finished) and both heads agree."""
    from profiling.kernel_head_check import main

    assert main(["--device", "cpu", "--hidden", "32", "--vocab", "100", "--reqs", "2", "--runs", "2"]) == 0
    assert "tokens identical over 2 x 4 steps" in capsys.readouterr().out
