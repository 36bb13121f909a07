"""GraphReplayer on a toy step over static buffers: replay equals eager bit for
bit at every bucket, replays really read the static buffers, capture rejects
an unsafe step, counters and errors. CUDA tests run when a GPU is present."""
from __future__ import annotations

import warnings

import pytest
import torch

from graphs.buckets import BucketTable
from graphs.capture_safety import CaptureSafetyError
from graphs.replay import GraphReplayer

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
    assert "capturing step graphs" in err and "6/6 (bucket 1)" in err

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
