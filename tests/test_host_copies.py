"""One copy each way per step (issue 35 item 3): the fake-CUDA dry run counts the host's
device-to-host reads and pageable host-to-device copies of the steps the graphs serve,
and its JSON carries them; the step's outputs come back in one packed copy, and the
control state of requests that join travels with the step's packed input copy."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams, StepEngine
from engine.host.params import SeqMeta
from engine.models.llama_weights import LlamaConfig
from engine.sampling.sample_output import SampleOutput
from engine.step.control_state import SamplingControls
from engine.step.static_buffers import OutputArea, OutputCopy
from profiling.cuda_dry_run import DryRunConfig, main, run

SMALL = DryRunConfig(hidden=64, vocab=2048, max_num_reqs=2, max_draft_tokens=1, tp=2, model=LlamaConfig.tiny())


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_graph_step_copies_once_each_way(kernels: str) -> None:
    """Every scenario's bucketed steps (requests with controls joining among them): at most
    one device-to-host read a step, no pageable host-to-device copy. The steps left out of
    the bar (prompt logprobs, above the largest bucket) are counted apart, not dropped."""
    report = run(DryRunConfig(**{**SMALL.__dict__, "kernels": kernels}))
    host = report.host_summary()
    assert host["steps"] >= 14, host
    assert host["d2h_reads"] <= host["steps"], (host, report.host_reads)
    assert host["pageable_h2d"] == 0, report.pageable_copies
    # One packed copy a step (on the kernel head's engine a step restricted by a token bitmask
    # among them); apart, pinned: the rejection scenario's draft distributions (two requests
    # hand them in each of its two steps with drafts) and a step's row index (not zero-copy).
    assert host["h2d_copies"] == host["steps"] + 5, report.h2d_copies
    other = host["other"]
    assert other["steps"] == 2 and other["d2h_reads"] >= 1  # prompt logprobs and the eager fallback
    assert sum(report.host_reads.values()) == host["d2h_reads"] + other["d2h_reads"]


def test_cost_json_carries_the_host_counts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--cost", "--json", "--hidden", "64", "--vocab", "2048", "--max-num-reqs", "2", "--drafts", "1",
            "--buckets", "2"]
    assert main(argv) == 0
    host = json.loads(capsys.readouterr().out)["host"]
    assert {"steps", "d2h_reads", "pageable_h2d", "h2d_copies", "other"} <= set(host)
    assert host["steps"] >= 14 and host["d2h_reads"] <= host["steps"] and host["pageable_h2d"] == 0, host


VOCAB, HIDDEN = 269, 16  # not a multiple of 32: the last bitmask word is partial


def _expected_words(tokens: list[int]) -> np.ndarray:
    """The packed bitmask of `tokens`, bit by bit: word t // 32, bit t % 32."""
    words = [0] * -(-VOCAB // 32)
    for t in tokens:
        words[t // 32] |= 1 << (t % 32)
    return np.array([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=np.int32)


def _slot_state(controls: SamplingControls, slot: int) -> dict[str, np.ndarray]:
    return {name: getattr(controls, name)[slot].numpy().copy()
            for name in ("penalties", "bias_ids", "bias_values", "prompt_words", "allowed_words", "restricted")}


def _expected_state(params: SamplingParams, prompt: list[int], max_bias: int) -> dict[str, np.ndarray]:
    bias = list((params.logit_bias or {}).items())
    return {"penalties": np.array([params.repetition_penalty, params.frequency_penalty, params.presence_penalty],
                                  np.float32),
            "bias_ids": np.array([t for t, _ in bias] + [0] * (max_bias - len(bias)), np.int64),
            "bias_values": np.array([v for _, v in bias] + [0.0] * (max_bias - len(bias)), np.float32),
            "prompt_words": _expected_words(prompt),
            "allowed_words": _expected_words(list(params.allowed_token_ids or ())),
            "restricted": np.array(params.allowed_token_ids is not None)}


def _random_params(rng: np.random.Generator) -> SamplingParams:
    bias = {int(t): float(rng.normal()) for t in rng.choice(VOCAB, rng.integers(0, 5), replace=False)}
    allowed = tuple(int(t) for t in rng.choice(VOCAB, rng.integers(1, 40), replace=False)) if rng.random() < 0.5 else None
    return SamplingParams(temperature=0.0, repetition_penalty=float(rng.uniform(1.0, 2.0)),
                          frequency_penalty=float(rng.uniform(0.0, 1.0)), presence_penalty=float(rng.uniform(0.0, 1.0)),
                          logit_bias=bias or None, allowed_token_ids=allowed)


@pytest.mark.parametrize("seed", range(8))
def test_control_writes_wait_for_the_next_step_and_the_latest_wins(seed: int) -> None:
    """Joins and changes write nothing to the device state but the counts' reset; the next
    step's copy carries them, a slot written twice before it keeps the second. Checked
    against the state built bit by bit from the parameters."""
    rng = np.random.default_rng(seed)
    max_bias = 8
    engine = StepEngine(torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)), EngineConfig(
        max_num_reqs=4, max_control_slots=4, device="cpu", use_graphs=False, max_logit_bias=max_bias,
        max_allowed_token_ids=64))
    controls = engine.controls
    before = {slot: _slot_state(controls, slot) for slot in range(1, 5)}
    prompts = [[int(t) for t in rng.integers(0, VOCAB, rng.integers(1, 8))] for _ in range(3)]
    params = [_random_params(rng) for _ in range(3)]
    slots = [controls.join(p, prompt) for p, prompt in zip(params, prompts)]
    changed = _random_params(rng)
    controls.rewrite(slots[1], changed)
    params[1] = changed
    for slot in range(1, 5):  # nothing reached the device yet
        for name, value in _slot_state(controls, slot).items():
            np.testing.assert_array_equal(value, before[slot][name], err_msg=f"slot {slot} {name} before the step")
    seqs = [SeqMeta("r", True, 2, 2, 2, prompt_tokens=[1, 2], params=SamplingParams(temperature=0.0))]
    engine.step(torch.randn(2, HIDDEN), seqs)
    assert controls.writes.pending() is None
    for slot, p, prompt in zip(slots, params, prompts):
        for name, value in _expected_state(p, prompt, max_bias).items():
            np.testing.assert_array_equal(_slot_state(controls, slot)[name], value, err_msg=f"slot {slot} {name}")


def test_the_output_area_holds_every_output_once_and_one_fetch_brings_them_back() -> None:
    """Every field SampleOutput.allocate declares, with its dtype and width, plus the drafts
    accepted, the emitted tokens and the counts' index, in disjoint views of one buffer; the
    narrow ones first. A fetch returns what the views held, in a twin the next fetch leaves
    alone (double-buffered)."""
    max_rows, max_reqs, num_top = 12, 3, 5
    area = OutputArea.allocate(max_rows, max_reqs, num_top, torch.device("cpu"))
    declared = SampleOutput.allocate(max_rows, num_top)
    views = {f.name: getattr(area.out, f.name) for f in dataclasses.fields(SampleOutput)}
    views.update(num_accepted=area.num_accepted, emitted=area.emitted, counted_index=area.counted_index)
    for name, like in vars(declared).items():
        assert views[name].dtype == like.dtype and views[name].shape == like.shape, name
    assert area.num_accepted.shape == (max_reqs,) and area.emitted.shape == area.counted_index.shape == (max_rows,)
    assert (area.emitted == -1).all() and (area.counted_index == -1).all()
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size(), name) for name, v in views.items())
    assert all(end <= start for (_, end, _), (start, _, _) in zip(spans, spans[1:])), spans  # disjoint
    base = area.packed.data_ptr()
    assert max(end for _, end, name in spans if views[name].dim() == 1) - base <= area.narrow_bytes
    assert min(start for start, _, name in spans if views[name].dim() == 2) - base >= area.narrow_bytes

    def scribble(seed: int) -> dict[str, np.ndarray]:
        gen = torch.Generator().manual_seed(seed)
        for view in views.values():
            if view.dtype == torch.bool:
                view.copy_(torch.rand(view.shape, generator=gen) < 0.5)
            elif view.is_floating_point():
                view.copy_(torch.randn(view.shape, generator=gen))
            else:
                view.copy_(torch.randint(-9, 2**40, view.shape, generator=gen))
        return {name: view.numpy().copy() for name, view in views.items()}

    copy = OutputCopy(area)
    first_values = scribble(1)
    first = copy.fetch(wide=True)
    second_values = scribble(2)
    second = copy.fetch(wide=False)
    for name, values in first_values.items():  # the second fetch went into the other twin
        np.testing.assert_array_equal(first.rows(name, 7), values[:7], err_msg=name)
    for name, values in second_values.items():
        if views[name].dim() == 1:
            np.testing.assert_array_equal(second.rows(name, 7), values[:7], err_msg=name)
    with pytest.raises(ValueError, match="top_ids"):
        second.rows("top_ids", 7)


def test_residual_draws_carry_their_own_raw_logprob_and_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rejection mode: a row that emits a residual draw (not its own) reports that token's raw
    logprob and rank, read back in one copy; every emitted token is checked against a float64
    log-softmax of its row's logits (rank: 1 + the tokens with a larger logit). 6 seeds x 4
    requests x 3 drafts of a uniform draft distribution, so most drafts are rejected."""
    import engine.step.step_output as collect_module

    rescored = []
    original = collect_module._rescore
    monkeypatch.setattr(collect_module, "_rescore",
                        lambda *a, **kw: rescored.append(len(a[4])) or original(*a, **kw))
    vocab, hidden_size, k, n = 96, 16, 3, 4
    weight = torch.randn(vocab, hidden_size, generator=torch.Generator().manual_seed(1)) * 2
    engine = StepEngine(weight, EngineConfig(max_num_reqs=n, max_draft_tokens=k, device="cpu",
                                             verify_mode="rejection", use_graphs=False, draft_pool_slots=n + 1))
    uniform = np.full((k, vocab), -np.log(vocab), dtype=np.float32)
    for seed in range(6):
        gen = torch.Generator().manual_seed(100 + seed)
        hidden = torch.randn(n * (1 + k), hidden_size, generator=gen)
        seqs = [SeqMeta(f"r{seed}.{i}", False, 1 + k, 15 + k, 10, num_generated=5,
                        params=SamplingParams(temperature=1.0, seed=seed * 10 + i, logprobs=0), mtp_write_slot=i + 1)
                for i in range(n)]
        drafts = [[int(t) for t in torch.randint(0, vocab, (k,), generator=gen)] for _ in range(n)]
        out = engine.step(hidden, seqs, drafts, [uniform] * n)
        logits = hidden.double() @ weight.double().T  # [rows, V]
        for i in range(n):
            for j, (token, scored) in enumerate(zip(out.tokens[i], out.logprobs[i])):
                row = logits[i * (1 + k) + j]
                assert scored.token == token
                assert scored.logprob == pytest.approx(float(torch.log_softmax(row, 0)[token]), abs=1e-4)
                assert scored.rank == 1 + int((row > row[token]).sum()), (seed, i, j)
    assert sum(rescored) > 0  # residual draws happened
