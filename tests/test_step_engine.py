"""StepEngine: replay equals eager bit for bit, padding never leaks, the graph
really reads the static buffers, bad input is rejected before any buffer is
touched (docs/contract.md §4, §6; issue 4 item 7)."""
from __future__ import annotations

import dataclasses

import warnings

import numpy as np
import pytest
import torch

import engine.step.lm_head as lm_head_module
from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine
from graphs.replay import BucketTable
from graphs.capture_safety import CaptureSafetyError

VOCAB, HIDDEN, MAX_REQS = 384, 32, 16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _weight(device: str) -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)).to(device)


def random_batch(n: int, seed: int, *, max_drafts: int = 0) -> tuple[list[SeqMeta], torch.Tensor, list]:
    """n requests: prefill chunks (last and not), decodes with 0..max_drafts
    drafts, greedy and filtered sampling, logprobs on and off."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n):
        kind = rng.integers(3)
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.0, 1.3])),
            top_k=int(rng.choice([0, 1, 5, 50])),
            top_p=float(rng.choice([1.0, 0.9, 0.5])),
            min_p=float(rng.choice([0.0, 0.05])),
            seed=int(rng.integers(2**63)) if rng.random() < 0.7 else None,
            logprobs=int(rng.choice([0, 3])) if rng.random() < 0.5 else None,
            min_tokens=int(rng.integers(3)),
        )
        prompt_len = int(rng.integers(1, 12))
        tokens = rng.integers(0, VOCAB, prompt_len)
        if kind == 0:  # whole prompt or a chunk of it
            k = int(rng.integers(1, prompt_len + 1))
            q = int(rng.integers(1, k + 1))
            seqs.append(SeqMeta(f"r{i}", True, q, k, prompt_len, prompt_tokens=tokens, params=params))
        else:
            drafts = int(rng.integers(max_drafts + 1))
            gen = int(rng.integers(1, 20))
            seqs.append(
                SeqMeta(f"r{i}", False, 1 + drafts, prompt_len + gen + drafts, prompt_len, prompt_tokens=tokens,
                        num_generated=gen, params=params, mtp_write_slot=i + 1)
            )
    rows = sum(s.seqlen_q for s in seqs)
    hidden = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))
    drafts = [None if s.is_prompt else rng.integers(0, VOCAB, s.seqlen_q - 1).tolist() for s in seqs]
    return seqs, hidden, drafts


def _same(a, b) -> None:
    assert a.tokens == b.tokens
    assert a.logprobs == b.logprobs
    assert a.seeds == b.seeds


@pytest.fixture(scope="module", params=DEVICES)
def engines(request):
    device = request.param
    w = _weight(device)
    replayed = StepEngine(w, EngineConfig(max_num_reqs=MAX_REQS, device=device, max_draft_tokens=2, draft_pool_slots=64))
    replayed.capture()
    eager = StepEngine(w, EngineConfig(max_num_reqs=MAX_REQS, device=device, max_draft_tokens=2, draft_pool_slots=64, use_graphs=False))
    return replayed, eager, device


def _sizes_around_buckets(buckets) -> list[int]:
    sizes = set()
    for b in buckets:
        sizes.update({b - 1, b, b + 1})
    return sorted(s for s in sizes if s >= 1)


def test_replay_equals_eager_around_every_bucket_and_above(engines):
    replayed, eager, device = engines
    sizes = _sizes_around_buckets(replayed.buckets)
    assert max(sizes) > replayed.buckets.largest  # one step above the largest bucket
    for n in sizes:
        seqs, hidden, drafts = random_batch(n, seed=n, max_drafts=2)
        a = replayed.step(hidden.to(device), seqs, drafts)
        b = eager.step(hidden.to(device), seqs, drafts)
        _same(a, b)
        if n <= replayed.buckets.largest:
            assert a.replayed and a.bucket == replayed.buckets.bucket_for(n)
        else:
            assert a.bucket is None and not a.replayed
    assert replayed.stats.eager_fallbacks == 1 and eager.stats.replays == 0


def test_replaying_twice_is_identical_and_follows_the_index_contents(engines):
    replayed, _, device = engines
    seqs, hidden, drafts = random_batch(6, seed=101)
    first = replayed.step(hidden.to(device), seqs)
    again = replayed.step(hidden.to(device), seqs)
    _same(first, again)
    # Reverse the batch: every request's rows move, so the gather indices and
    # the parameter slots change; each request must still get its own token.
    order = list(reversed(range(len(seqs))))
    starts = np.cumsum([0] + [s.seqlen_q for s in seqs])
    rows = torch.cat([hidden[starts[i] : starts[i + 1]] for i in order])
    moved = replayed.step(rows.to(device), [seqs[i] for i in order])
    assert moved.tokens == [first.tokens[i] for i in order]
    assert moved.logprobs == [first.logprobs[i] for i in order]
    # New hidden contents at the same indices change the sampled tokens.
    other = replayed.step((hidden * -3).to(device), seqs)
    assert other.tokens != first.tokens


def test_padding_rows_never_leak(engines):
    replayed, eager, device = engines
    for n in (1, 3, 5, 11):
        seqs, hidden, drafts = random_batch(n, seed=200 + n, max_drafts=2)
        clean = eager.step(hidden.to(device), seqs, drafts)
        replayed.buffers.fill_garbage(torch.Generator(device=device).manual_seed(n))
        dirty = replayed.step(hidden.to(device), seqs, drafts)
        _same(clean, dirty)


def test_strict_drafts_emit_what_one_token_steps_would(engines):
    """Drafts right, wrong and partly right, k = 0..2 per request, 60 sequences:
    the emitted tokens equal one-token decode steps with the same seeds."""
    replayed, _, device = engines
    rng = np.random.default_rng(5)
    for trial in range(60):
        seqs, hidden, _ = random_batch(int(rng.integers(1, 6)), seed=1000 + trial, max_drafts=2)
        starts = np.cumsum([0] + [s.seqlen_q for s in seqs])
        one_by_one = []  # per request: the draw of each row as its own one-token step
        for i, s in enumerate(seqs):
            draws = []
            for j in range(s.seqlen_q if not s.is_prompt else 0):
                single = SeqMeta(s.request_id, False, 1, s.seqlen_k - s.seqlen_q + 1 + j, s.prompt_len,
                                 num_generated=s.num_generated + j, params=s.params, mtp_write_slot=1)
                row = hidden[starts[i] + j : starts[i] + j + 1].to(device)
                draws.append(replayed.step(row, [single]).tokens[0][0])
            one_by_one.append(draws)
        drafts = []
        for s, draws in zip(seqs, one_by_one):
            if s.is_prompt:
                drafts.append(None)
                continue
            proposal = list(draws[:-1])  # all right
            if proposal and rng.random() < 0.6:  # wrong from a random draft on
                m = int(rng.integers(len(proposal)))
                proposal[m] = (proposal[m] + 1 + int(rng.integers(VOCAB - 1))) % VOCAB
            drafts.append(proposal)
        out = replayed.step(hidden.to(device), seqs, drafts)
        for i, s in enumerate(seqs):
            if s.is_prompt:
                continue
            accepted = 0
            while accepted < len(drafts[i]) and drafts[i][accepted] == one_by_one[i][accepted]:
                accepted += 1
            assert out.num_accepted[i] == accepted
            assert out.tokens[i] == one_by_one[i][: accepted + 1]


def test_a_request_samples_the_same_alone_and_in_a_crowd():
    w = _weight("cpu")
    engine = StepEngine(w, EngineConfig(max_num_reqs=64, device="cpu", buckets=(1, 8, 64)))
    engine.capture()
    crowd, hidden, drafts = random_batch(40, seed=7)
    starts = np.cumsum([0] + [s.seqlen_q for s in crowd])
    together = engine.step(hidden, crowd, drafts)
    for i in (0, 13, 39):
        alone = engine.step(hidden[starts[i] : starts[i + 1]], [crowd[i]], [drafts[i]])
        assert alone.tokens[0] == together.tokens[i]
        assert alone.logprobs[0] == together.logprobs[i]


def test_zero_copy_source_matches_the_copy_path(engines):
    replayed, _, device = engines
    seqs, hidden, drafts = random_batch(5, seed=9)
    copied = replayed.step(hidden.to(device), seqs)
    copies = replayed.stats.source_copies
    replayed.source[: hidden.shape[0]].copy_(hidden)
    direct = replayed.step(replayed.source, seqs)
    _same(copied, direct)
    assert replayed.stats.source_copies == copies


def test_chunked_prefill_reports_tokens_and_prompt_logprobs_on_the_last_chunk():
    engine = StepEngine(_weight("cpu"), EngineConfig(max_num_reqs=4, device="cpu"))
    prompt = np.arange(10, 19)
    params = SamplingParams(temperature=0.0, prompt_logprobs=2)
    out1 = engine.step(torch.randn(4, HIDDEN), [SeqMeta("p", True, 4, 4, 9, prompt_tokens=prompt, params=params)])
    assert out1.tokens == [[]] and out1.prompt_logprobs == [[]]
    out2 = engine.step(torch.randn(5, HIDDEN), [SeqMeta("p", True, 5, 9, 9, prompt_tokens=prompt, params=params)])
    assert len(out2.tokens[0]) == 1
    assert [lp.token for lp in out2.prompt_logprobs[0]] == prompt[1:].tolist()


def _never_captured(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "never captured" in str(w.message)]


def test_use_graphs_without_capture_warns_once_per_engine_and_runs_eagerly():
    seqs, hidden, _ = random_batch(3, seed=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = [StepEngine(_weight("cpu"), EngineConfig(max_num_reqs=4, device="cpu")) for _ in range(2)]
        outs = [first.step(hidden, seqs) for _ in range(3)]
        assert len(_never_captured(caught)) == 1  # not one per step
        second.step(hidden, seqs)
    messages = _never_captured(caught)
    assert len(messages) == 2  # one per engine
    assert "capture()" in messages[0] and "use_graphs=False" in messages[0]
    assert not any(out.replayed for out in outs)
    assert first.stats.eager_steps == 3 and first.stats.replays == 0
    captured = StepEngine(_weight("cpu"), EngineConfig(max_num_reqs=4, device="cpu"))
    captured.capture()
    eager = StepEngine(_weight("cpu"), EngineConfig(max_num_reqs=4, device="cpu", use_graphs=False))
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        replayed = captured.step(hidden, seqs)
        eager.step(hidden, seqs)
    assert _never_captured(quiet) == [] and replayed.replayed
    _same(outs[0], replayed)


def _buffer_snapshot(engine: StepEngine) -> list[torch.Tensor]:
    return [t.clone() for t in engine.buffers.static_tensors().values()] + [engine.buffers.staging.clone()]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda seqs, h: (seqs, h[:, :-1]), "hidden_states: shape"),
        (lambda seqs, h: (seqs, h[:-1]), r"hidden_states: \d+ rows, but the batch"),
        (lambda seqs, h: (seqs[:1] + [SeqMeta("r1", False, 1, 9, 4, num_generated=5,
                                               params=SamplingParams(logprobs=99))], h.repeat(4, 1)), "request 'r1': params.logprobs=99"),
        (lambda seqs, h: (seqs[:1] + [SeqMeta("r1", False, 1, 9, 4, num_generated=5,
                                               params=SamplingParams(stop_token_ids=(VOCAB,)))], h.repeat(4, 1)), "request 'r1': params.stop_token_ids"),
        (lambda seqs, h: (seqs[:1] + [SeqMeta("r1", True, 3, 3, 3, prompt_tokens=[1, VOCAB + 5, 2],
                                               params=SamplingParams(prompt_logprobs=True))], h.repeat(4, 1)), "request 'r1': prompt_tokens"),
        (lambda seqs, h: (seqs[:1] + [seqs[0]], h.repeat(4, 1)), "request 'r0': request_id appears twice"),
    ],
)
def test_bad_input_is_rejected_before_any_buffer_is_touched(mutate, match):
    engine = StepEngine(_weight("cpu"), EngineConfig(max_num_reqs=4, device="cpu"))
    engine.capture()
    seqs, hidden, drafts = random_batch(2, seed=3)
    engine.step(hidden, seqs)
    before = _buffer_snapshot(engine)
    bad_seqs, bad_hidden = mutate(seqs, hidden)
    with pytest.raises(ValueError, match=match):
        engine.step(bad_hidden, bad_seqs)
    for a, b in zip(before, _buffer_snapshot(engine)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_num_reqs=0), "max_num_reqs=0"),
        (dict(buckets=(4, 2)), r"buckets\[1\]"),
        (dict(max_draft_tokens=-1), "max_draft_tokens=-1"),
        (dict(max_num_reqs=64, max_draft_tokens=3, max_source_rows=100), "max_source_rows=100"),
        (dict(eos_token_id=VOCAB), "eos_token_id"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepEngine(_weight("cpu"), EngineConfig(device="cpu", **kwargs))


@pytest.mark.parametrize(
    "plant, match",
    [
        (lambda out: out.tokens.sum().item(), "item|_local_scalar_dense"),
        (lambda out: out.tokens[out.tokens > 3], "bool|mask|index"),
        (lambda out: torch.rand(3), "rand|RNG|random"),
    ],
)
def test_capture_rejects_a_planted_hazard_inside_the_step(monkeypatch, plant, match):
    real_sample = lm_head_module.sample

    def sample_with_hazard(*args, **kwargs):
        out = real_sample(*args, **kwargs)
        plant(out)
        return out

    monkeypatch.setattr(lm_head_module, "sample", sample_with_hazard)
    engine = StepEngine(_weight("cpu"), EngineConfig(max_num_reqs=2, device="cpu"))
    with pytest.raises(CaptureSafetyError, match=match):
        engine.capture()


def _few_candidate_batch(n: int, seed: int, weight: torch.Tensor, *, top_k_zero_row: bool = False):
    """Greedy and top-k (1..32) requests, some of them aimed at a 64-way tie of
    logits, so a top-k cut falls inside a tie."""
    rng = np.random.default_rng(seed)
    seqs, rows = [], []
    for i in range(n):
        greedy = rng.random() < 0.4
        params = SamplingParams(
            temperature=0.0 if greedy else float(rng.choice([0.7, 1.0])),
            top_k=0 if greedy and rng.random() < 0.5 else int(rng.choice([1, 5, 20, 32])),
            top_p=float(rng.choice([1.0, 0.9])),
            min_p=float(rng.choice([0.0, 0.05])),
            seed=int(rng.integers(2**63)),
            logprobs=int(rng.choice([0, 3])) if rng.random() < 0.6 else None,
            min_tokens=int(rng.integers(3)),
            stop_token_ids=[int(t) for t in rng.integers(0, VOCAB, 2)],
        )
        if top_k_zero_row and i == n - 1:
            params = SamplingParams(temperature=0.9, seed=1)  # a plain row: full candidates
        gen = int(rng.integers(1, 5))
        seqs.append(SeqMeta(f"r{i}", False, 1, 5 + gen, 5, prompt_tokens=np.arange(5), num_generated=gen, params=params))
        tie = rng.random() < 0.5
        rows.append(weight[100] * 4 if tie else torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed * 97 + i)))
    return seqs, torch.stack(rows)


def _greedy_or_plain_batch(n: int, *, seed: int, weight: torch.Tensor, greedy: bool | None, forced: bool = False):
    """`n` decode requests, all greedy or all sampled without filters (`greedy` None: every
    other one greedy), half on tied logits; with `forced`, every third a forced token."""
    seqs, rows = [], []
    for i in range(n):
        temperature = 0.0 if (greedy if greedy is not None else i % 2 == 1) else 0.9
        params = SamplingParams(temperature=temperature, seed=seed * 31 + i,
                                min_tokens=3 if i % 3 == 0 and seed % 2 else 0)
        seqs.append(SeqMeta(f"r{i}", False, 1, 7, 5, prompt_tokens=np.arange(5), num_generated=2, params=params,
                            forced_token=(seed * 7 + i) % VOCAB if forced and i % 3 == 1 else None))
        tie = i % 2 == 0
        rows.append(weight[100] * 4 if tie else torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed * 97 + i)))
    return seqs, torch.stack(rows)


def test_the_lighter_cpu_steps_sample_exactly_what_the_full_step_does():
    """The lighter steps the CPU head picks per step run fewer stages, never other
    definitions: every step equals the same step on an engine that runs every stage."""
    weight = _weight("cpu")
    weight[100:164] = weight[100]  # 64 tokens share one logit: greedy ties, EOS suppression among them
    light = StepEngine(weight, EngineConfig(max_num_reqs=MAX_REQS, device="cpu", eos_token_id=100))
    full = StepEngine(weight, EngineConfig(max_num_reqs=MAX_REQS, device="cpu", eos_token_id=100, sampler_variants=False))
    assert str(light.capture()).startswith("captured 5 buckets on cpu")  # one graph a bucket
    full.capture()
    sizes = [1, 4, 9, 16] * 3
    for seed, n in enumerate(sizes):
        for greedy in (True, False):
            seqs, hidden = _greedy_or_plain_batch(n, seed=seed, weight=weight, greedy=greedy)
            _same(light.step(hidden, seqs), full.step(hidden, seqs))
    # Greedy steps with EOS suppressed on a row (odd seeds) run the plain draw.
    suppressing = sum(seed % 2 for seed in range(len(sizes)))
    assert (light.stats.greedy_steps, light.stats.plain_steps) == (len(sizes) - suppressing, len(sizes) + suppressing)
    assert full.stats.greedy_steps == full.stats.plain_steps == 0
    seqs, hidden = _few_candidate_batch(5, seed=50, weight=weight)  # filtered requests, some wanting logprobs
    assert any(s.params.logprobs is not None for s in seqs)
    _same(light.step(hidden, seqs), full.step(hidden, seqs))
    assert light.stats.greedy_steps + light.stats.plain_steps == 2 * len(sizes)
    seqs, hidden = _greedy_or_plain_batch(4, seed=60, weight=weight, greedy=True)
    seqs[0] = dataclasses.replace(seqs[0], params=dataclasses.replace(seqs[0].params, logprobs=3))  # logprobs: not the argmax alone
    _same(light.step(hidden, seqs), full.step(hidden, seqs))
    assert light.stats.greedy_steps == len(sizes) - suppressing
    # Greedy rows among sampled ones, forced tokens, stop ids suppressed on some rows: each
    # step's variant says which of them it holds (`sampler_variant`), and skips the rest.
    for seed, n in enumerate([1, 2, 5, 9, 16, 3]):
        for greedy, forced in ((None, False), (None, True), (False, True), (True, True)):
            seqs, hidden = _greedy_or_plain_batch(n, seed=seed, weight=weight, greedy=greedy, forced=forced)
            _same(light.step(hidden, seqs), full.step(hidden, seqs))


@pytest.mark.parametrize("value", [0, 1, "yes", None])
def test_sampler_variants_must_be_a_bool(value):
    with pytest.raises(ValueError, match="sampler_variants"):
        EngineConfig(sampler_variants=value)


def test_bucket_parts_slice_a_step_above_the_largest_bucket():
    """BucketTable.parts against a per-request reference: consecutive slices of at most
    the largest bucket, each in the smallest bucket that holds it."""
    table = BucketTable(16, (2, 8))
    for n in range(1, 60):
        parts = table.parts(n)
        assert [r for a, b, _ in parts for r in range(a, b)] == list(range(n))
        assert all(b - a <= 16 and bucket == min(s for s in table if s >= b - a) for a, b, bucket in parts)
        assert len(parts) == -(-n // 16)
