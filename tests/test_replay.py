"""GraphReplayer on a toy step over static buffers: replay equals eager bit for
bit at every bucket, replays really read the static buffers, capture rejects
an unsafe step, counters and errors. The StepEngine's replay, on a fresh
engine whose static buffers hold garbage, against a reference that shares no
code with it (integer logits + the numpy sampler). CUDA tests run when a GPU
is present."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine
from engine.sampling.sampler import SamplerConfig
from graphs.capture_safety import CaptureSafetyError
from graphs.replay import BucketTable, GraphReplayer
from tests import numpy_sampler_reference as ref

MAX_REQS, HIDDEN, VOCAB = 20, 16, 48
SOURCE_ROWS = 2 * MAX_REQS
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class ToyStep:
    """Pick rows, project to logits, temperature, greedy token and its logprob."""

    def __init__(self, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(1234)
        self.static = {
            "hidden": torch.randn(SOURCE_ROWS, HIDDEN, generator=gen).to(device),  # [source rows, hidden]
            "weight": torch.randn(VOCAB, HIDDEN, generator=gen).to(device),  # [vocab, hidden]
            "row_index": torch.zeros(MAX_REQS, dtype=torch.int64, device=device),
            "temperature": torch.ones(MAX_REQS, device=device),
            "tokens": torch.zeros(MAX_REQS, dtype=torch.int64, device=device),
            "logprobs": torch.zeros(MAX_REQS, device=device),
        }

    def __call__(self, bucket: int) -> None:
        s = self.static
        rows = s["hidden"].index_select(0, s["row_index"][:bucket])  # [bucket, hidden]
        logits = rows @ s["weight"].t() / s["temperature"][:bucket, None]  # [bucket, vocab] fp32
        logprobs = torch.log_softmax(logits, dim=-1)
        torch.argmax(logprobs, dim=-1, out=s["tokens"][:bucket])
        s["logprobs"][:bucket] = logprobs.gather(1, s["tokens"][:bucket, None]).squeeze(1)

    def load(self, row_index: torch.Tensor, temperature: torch.Tensor) -> None:
        n = row_index.numel()
        self.static["row_index"][:n].copy_(row_index)
        self.static["temperature"][:n].copy_(temperature)

    def outputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Copied out: the next replay overwrites the static outputs.
        return self.static["tokens"][:n].clone(), self.static["logprobs"][:n].clone()


def reference(step: ToyStep, row_index: torch.Tensor, temperature: torch.Tensor) -> tuple[list[int], list[float]]:
    """Per-request loop in float64: greedy token and its logprob."""
    hidden = step.static["hidden"].double().cpu()
    weight = step.static["weight"].double().cpu()
    tokens, logprobs = [], []
    for r, t in zip(row_index.tolist(), temperature.tolist()):
        logits = [float(weight[v] @ hidden[r]) / t for v in range(VOCAB)]
        best = max(range(VOCAB), key=lambda v: (logits[v], -v))
        lse = torch.logsumexp(torch.tensor(logits, dtype=torch.float64), 0).item()
        tokens.append(best)
        logprobs.append(logits[best] - lse)
    return tokens, logprobs


def random_batch(n: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    row_index = torch.randint(0, SOURCE_ROWS, (n,), generator=gen)
    temperature = torch.rand(n, generator=gen) + 0.25
    return row_index.to(device), temperature.to(device)


def make_replayer(step: ToyStep, device: str = "cpu", **kwargs) -> GraphReplayer:
    return GraphReplayer(step, BucketTable(MAX_REQS), step.static, device, **kwargs)


def check_replay_equals_eager(device: str) -> None:
    step = ToyStep(device)
    replayer = make_replayer(step, device)
    report = replayer.capture(progress=False)
    assert report.buckets == (20, 16, 8, 4, 2, 1)
    for n in range(1, MAX_REQS + 1):
        bucket = replayer.buckets.bucket_for(n)
        row_index, temperature = random_batch(n, seed=n, device=device)
        # Padding requests of the bucket hold whatever the previous step left.
        step.load(row_index, temperature)
        replayer.replay(bucket)
        replayed = step.outputs(n)
        replayer.run_eager(bucket)
        eager = step.outputs(n)
        assert torch.equal(replayed[0], eager[0]) and torch.equal(replayed[1], eager[1]), n
        ref_tokens, ref_logprobs = reference(step, row_index.cpu(), temperature.cpu())
        assert replayed[0].tolist() == ref_tokens, n
        assert torch.allclose(replayed[1].cpu().double(), torch.tensor(ref_logprobs, dtype=torch.float64), atol=1e-4)


def check_replay_reads_static_buffers(device: str) -> None:
    step = ToyStep(device)
    replayer = make_replayer(step, device)
    replayer.capture(progress=False)
    for bucket in replayer.buckets:
        first = random_batch(bucket, seed=100 + bucket, device=device)
        second = (first[0].flip(0) + 1) % SOURCE_ROWS, first[1].flip(0) * 2
        step.load(*first)
        replayer.replay(bucket)
        out_first = step.outputs(bucket)
        replayer.replay(bucket)
        assert all(torch.equal(a, b) for a, b in zip(out_first, step.outputs(bucket))), "replay not repeatable"
        step.load(*second)  # only the buffer contents change, never their addresses
        replayer.replay(bucket)
        out_second = step.outputs(bucket)
        assert out_second[0].tolist() == reference(step, second[0].cpu(), second[1].cpu())[0]
        assert not torch.equal(out_first[1], out_second[1]), bucket


def test_replay_equals_eager_at_every_size() -> None:
    check_replay_equals_eager("cpu")


def test_replay_reads_static_buffers() -> None:
    check_replay_reads_static_buffers("cpu")


def test_capture_report_progress_and_counters(capsys: pytest.CaptureFixture[str]) -> None:
    step = ToyStep()
    replayer = make_replayer(step)
    assert not replayer.captured
    report = replayer.capture(progress=True)
    assert replayer.captured
    assert report.pool_bytes is None and report.seconds >= 0 and report.device == torch.device("cpu")
    assert "captured 6 buckets on cpu" in str(report)
    err = capsys.readouterr().err
    # No graphs on a CPU: the bar says what really runs there.
    assert "checking each bucket's step (CPU: no graphs)" in err and "6/6 (bucket 1)" in err
    assert "capturing" not in err

    step.load(*random_batch(3, seed=0))
    replayer.replay(4)
    replayer.replay(4)
    replayer.replay(1)
    replayer.run_eager(8)
    assert replayer.replays == {1: 1, 2: 0, 4: 2, 8: 0, 16: 0, 20: 0}
    assert replayer.eager_runs == 1

    with pytest.warns(RuntimeWarning, match="21 requests exceeds the largest graph bucket \\(20\\)"):
        replayer.record_eager_fallback(21)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        replayer.record_eager_fallback(50)
    assert later == [], "the fallback warning is issued once per replayer"
    assert replayer.eager_fallbacks == 2
    with pytest.raises(ValueError, match="num_reqs = 7 fits bucket 8"):
        replayer.record_eager_fallback(7)


def test_capture_rejects_an_unsafe_step() -> None:
    step = ToyStep()

    def unsafe(bucket: int) -> None:
        step(bucket)
        if step.static["tokens"][:bucket].max().item() > VOCAB:  # a host sync
            raise AssertionError("unreachable")

    replayer = GraphReplayer(unsafe, BucketTable(MAX_REQS), step.static, "cpu")
    with pytest.raises(CaptureSafetyError, match=r"Tensor.item\(\)"):
        replayer.capture(progress=False)
    assert not replayer.captured


def test_debug_mode_checks_addresses_at_each_replay() -> None:
    checked_step, plain_step = ToyStep(), ToyStep()
    checked = make_replayer(checked_step, check_addresses_each_replay=True)
    plain = make_replayer(plain_step)
    checked.capture(progress=False)
    plain.capture(progress=False)
    checked_step.static["logprobs"].set_(torch.zeros(MAX_REQS))  # a buffer the graph holds moves
    plain_step.static["logprobs"].set_(torch.zeros(MAX_REQS))
    with pytest.raises(CaptureSafetyError, match="static buffer 'logprobs' changed"):
        checked.replay(1)
    plain.replay(1)  # without the debug mode nothing checks


def test_misuse_errors() -> None:
    step = ToyStep()
    replayer = make_replayer(step)
    with pytest.raises(RuntimeError, match="before capture"):
        replayer.replay(1)
    replayer.capture(progress=False)
    with pytest.raises(RuntimeError, match="already ran"):
        replayer.capture(progress=False)
    with pytest.raises(ValueError, match="bucket = 3: not one of the captured buckets"):
        replayer.replay(3)
    with pytest.raises(ValueError, match="bucket = 21"):
        replayer.run_eager(21)
    with pytest.raises(ValueError, match="warmup_runs = 0"):
        make_replayer(step, warmup_runs=0)
    with pytest.raises(ValueError, match="device = meta"):
        make_replayer(step, device="meta")


def test_static_buffer_on_wrong_device() -> None:
    step = ToyStep()
    step.static["weight"] = torch.zeros(VOCAB, HIDDEN, device="meta")
    with pytest.raises(ValueError, match="static buffer 'weight' is on meta"):
        make_replayer(step)


@pytest.mark.parametrize("check", [check_replay_equals_eager, check_replay_reads_static_buffers])
@pytest.mark.cuda
@requires_cuda
def test_cuda_replay(check) -> None:
    check("cuda")


@pytest.mark.cuda
@requires_cuda
def test_cuda_capture_report() -> None:
    step = ToyStep("cuda")
    report = make_replayer(step, "cuda").capture(progress=False)
    assert report.pool_bytes is not None and report.pool_bytes >= 0
    assert report.buckets == (20, 16, 8, 4, 2, 1)


# --- the engine's replay against an independent reference ----------------------
# On CPU "replay" runs the same step function as eager, so replay == eager alone
# proves little. Here the LM head and hidden states hold small integers: every
# logit is an exact integer in float32 whatever the GEMM's summation order, so
# the reference computes them in numpy and samples with the numpy reference,
# following the ledger rules of docs/contract.md §1 written out below.

ENGINE_VOCAB, ENGINE_HIDDEN, EOS = 96, 12, 5


def integer_lm_head(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-2, 3, (ENGINE_VOCAB, ENGINE_HIDDEN))


def integer_batch(n: int, seed: int, *, max_drafts: int = 0):
    """n requests with explicit seeds: prefill chunks (last and not) and decodes
    with up to max_drafts drafts; greedy and filtered; min_tokens with EOS."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n):
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.5, 1.0, 1.6])),
            top_k=int(rng.choice([0, 1, 3, 20])),
            top_p=float(rng.choice([1.0, 0.9, 0.4])),
            min_p=float(rng.choice([0.0, 0.1, 1.0])),
            seed=int(rng.integers(2**64, dtype=np.uint64)),
            logprobs=int(rng.choice([0, 2])) if rng.random() < 0.6 else None,
            min_tokens=int(rng.integers(3)),
            stop_token_ids=(int(rng.integers(ENGINE_VOCAB)),) if rng.random() < 0.5 else (),
        )
        prompt_len = int(rng.integers(1, 10))
        tokens = rng.integers(0, ENGINE_VOCAB, prompt_len)
        if rng.random() < 0.35:
            k = int(rng.integers(1, prompt_len + 1))
            seqs.append(SeqMeta(f"r{i}", True, int(rng.integers(1, k + 1)), k, prompt_len, tokens, params=params))
        else:
            drafts = int(rng.integers(max_drafts + 1))
            gen = int(rng.integers(0, 4))
            seqs.append(SeqMeta(f"r{i}", False, 1 + drafts, prompt_len + gen + drafts, prompt_len, tokens,
                                num_generated=gen, params=params, mtp_write_slot=i + 1))
    hidden = rng.integers(-2, 3, (sum(s.seqlen_q for s in seqs), ENGINE_HIDDEN))
    drafts = [None if s.is_prompt else rng.integers(0, ENGINE_VOCAB, s.seqlen_q - 1).tolist() for s in seqs]
    return seqs, hidden, drafts


def reference_rows(weight: np.ndarray, hidden: np.ndarray, seqs) -> list[tuple[bool, list[ref.RowResult]]]:
    """Per request: whether its step emits tokens, and the numpy reference's
    result for each of its sample rows."""
    logits = (hidden @ weight.T).astype(np.float32)  # exact small integers
    requests, out_offset = [], 0
    for s in seqs:
        p = s.params
        if s.is_prompt:
            rows, first_position = [out_offset + s.seqlen_q - 1], s.seqlen_k
        else:
            rows, first_position = [out_offset + j for j in range(s.seqlen_q)], s.seqlen_k - s.seqlen_q + 1
        out_offset += s.seqlen_q
        emits = not s.is_prompt or s.seqlen_k == s.prompt_len
        stop = (EOS, *p.stop_token_ids)  # EOS is held back under min_tokens even with ignore_eos (vLLM)
        row_results = []
        for j, row in enumerate(rows):
            spec = ref.RowSpec(p.temperature, p.top_k, p.top_p, p.min_p, p.seed, first_position + j,
                               suppressed=stop if emits and s.num_generated + j < p.min_tokens else ())
            row_results.append(ref.sample_row(logits[row], spec, num_top=max(p.num_logprobs, 0)))
        requests.append((emits, row_results))
    return requests


def reference_step(weight: np.ndarray, hidden: np.ndarray, seqs, drafts) -> list[tuple[list[int], list | None] | None]:
    """Per request: (emitted tokens, their (token, logprob, rank, top) tuples or
    None), or None where the numpy reference calls a row undecided. Strict
    verification: drafts are accepted while they equal the row's own draw."""
    results = []
    for s, proposal, (emits, row_results) in zip(seqs, drafts, reference_rows(weight, hidden, seqs)):
        wants_logprobs = s.params.num_logprobs >= 0
        if not all(r.decided for r in row_results):
            results.append(None)
            continue
        if not emits:
            results.append(([], [] if wants_logprobs else None))
            continue
        accepted = 0
        while proposal is not None and accepted < len(proposal) and proposal[accepted] == row_results[accepted].token:
            accepted += 1
        emitted = row_results[: accepted + 1]
        logprobs = [(r.token, r.logprob, r.rank, tuple(zip(r.top_ids, r.top_logprobs))) for r in emitted]
        results.append(([r.token for r in emitted], logprobs if wants_logprobs else None))
    return results


def right_drafts(weight: np.ndarray, hidden: np.ndarray, seqs, drafts, rng: np.random.Generator) -> list:
    """The drafts with about half of them replaced by the reference's own draws
    (so they are accepted), some of those wrong from a random index on."""
    out = []
    for s, proposal, (_, rows) in zip(seqs, drafts, reference_rows(weight, hidden, seqs)):
        if proposal and rng.random() < 0.5:
            proposal = [r.token for r in rows[:-1]]
            if rng.random() < 0.3:
                proposal[-1] = (proposal[-1] + 1) % ENGINE_VOCAB
        out.append(proposal)
    return out


def assert_step_matches_reference(out, expected) -> int:
    """Exact tokens, ranks and top ids; logprobs within ref.LOGPROB_ATOL. Returns the requests compared."""
    compared = 0
    for i, want in enumerate(expected):
        if want is None:
            continue
        compared += 1
        tokens, logprobs = want
        assert out.tokens[i] == tokens, (i, out.tokens[i], tokens)
        if logprobs is None:
            assert out.logprobs[i] is None
            continue
        assert len(out.logprobs[i]) == len(logprobs)
        for got, (token, logprob, rank, top) in zip(out.logprobs[i], logprobs):
            assert (got.token, got.rank) == (token, rank)
            assert abs(got.logprob - logprob) <= ref.LOGPROB_ATOL
            assert [t for t, _ in got.top] == [t for t, _ in top]
            assert np.allclose([v for _, v in got.top], [v for _, v in top], atol=ref.LOGPROB_ATOL, rtol=0)
    return compared


@pytest.mark.filterwarnings("ignore:a step with 9 requests exceeds:RuntimeWarning")
@pytest.mark.parametrize(
    "device, use_graphs",
    [("cpu", True), ("cpu", False), pytest.param("cuda", True, marks=[pytest.mark.cuda, requires_cuda])],
)
def test_engine_replay_on_garbage_buffers_matches_the_numpy_reference(device: str, use_graphs: bool) -> None:
    """A fresh engine, static buffers scribbled over before every step, one
    batch size around every bucket and above the largest: each request's
    tokens and logprobs equal the independent reference's."""
    weight = integer_lm_head()
    engine = StepEngine(torch.from_numpy(weight).float().to(device),
                        EngineConfig(max_num_reqs=8, max_draft_tokens=2, device=device, eos_token_id=EOS,
                                     use_graphs=use_graphs, sampler_variants=True,
                                     # 16 candidates: rows whose kept set is wider take the exact path.
                                     sampler=SamplerConfig(candidate_cap=16, max_logprobs=4)))
    if use_graphs:
        engine.capture()
    total = compared = accepted = 0
    for n in (1, 2, 3, 4, 5, 7, 8, 9):
        seqs, hidden, drafts = integer_batch(n, seed=n, max_drafts=2)
        drafts = right_drafts(weight, hidden, seqs, drafts, np.random.default_rng(n))
        engine.buffers.fill_garbage(torch.Generator(device=device).manual_seed(n))
        out = engine.step(torch.from_numpy(hidden).float().to(device), seqs, drafts)
        assert out.replayed == (use_graphs and n <= 8)
        expected = reference_step(weight, hidden, seqs, drafts)
        compared += assert_step_matches_reference(out, expected)
        total += n
        accepted += sum(out.num_accepted)
    assert accepted > 0  # some drafts were right and verified
    assert compared >= total - 3, (compared, total)  # a few requests may sit within rounding of a threshold
