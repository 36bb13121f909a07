"""Batch invariance checked where it runs: the probe (engine.invariance) against planted
kernels, and the kernels the engine and the invariant model pick against a plain check
(a row alone vs the same row at random places in batches of arbitrary sizes), at 1 and 2
torch threads."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine, invariance, ops
from engine.models.llama import LlamaModel
from engine.models.llama_weights import LlamaConfig
from engine.models.protocol import ForwardBatch
from engine.ops import BLOCK_KERNELS, BlockGemm, block_gemm, get_logits

SMOLLM2_V, SMOLLM2_H = 49152, 576


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch):
    """Replace block kernels for one test; the probe's verdicts are forgotten before and after."""
    invariance.clear_cache()

    def plant(bad: object, kernels: tuple[str, ...] = tuple(BLOCK_KERNELS)) -> None:
        for name in kernels:
            monkeypatch.setitem(BLOCK_KERNELS, name, bad(BLOCK_KERNELS[name]))
        invariance.clear_cache()  # verdicts on the real kernels no longer apply

    yield plant
    monkeypatch.undo()
    invariance.clear_cache()


def last_row_off(when: object = lambda gemm: True):
    """A kernel that adds a tiny epsilon to the last row of every block (when `when(gemm)`)."""
    def wrap(kernel):
        def bad(gemm: BlockGemm, block: torch.Tensor) -> torch.Tensor:
            out = kernel(gemm, block)
            if when(gemm) and gemm.block_rows > 1:
                out[-1] = out[-1] + out[-1].abs() * 2**-20
            return out
        return bad
    return wrap


def not_deterministic(kernel):
    """A kernel whose every other call is off by a tiny epsilon: not even one row holds."""
    calls = [0]

    def bad(gemm: BlockGemm, block: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        out = kernel(gemm, block)
        return out + out.abs() * 2**-20 if calls[0] % 2 else out
    return bad


def assert_rows_invariant(weight: torch.Tensor, kernel: BlockGemm, counts: list[int], seed: int) -> None:
    """A row alone and the same row at a random place among random rows, for each row count:
    the same bits through get_logits' batch-invariant path on `kernel`."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(1, weight.shape[1], generator=gen)
    alone = get_logits(row, weight, batch_invariant=True, kernel=kernel)[0]
    for count in counts:
        batch = torch.randn(count, weight.shape[1], generator=gen)
        place = int(torch.randint(count, (1,), generator=gen))
        batch[place] = row[0]
        got = get_logits(batch, weight, batch_invariant=True, kernel=kernel)
        assert torch.equal(got[place].view(torch.int32), alone.view(torch.int32)), (kernel.name, count, place)


# ---- what the engine and the model pick on this machine -------------------------------------------


@pytest.mark.parametrize("shape, block_rows", [((SMOLLM2_V, SMOLLM2_H), None), ((2048, SMOLLM2_H), 5)])
def test_engine_lm_head_is_verified_and_invariant(threads, shape, block_rows):
    """SmolLM2's LM head at the engine's default block (16 on CPU); and a configured 5-row
    block, which fails at 2 threads on AMD EPYC (MKL gives a block's last row other bits):
    the engine must then pick another."""
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) / SMOLLM2_H**0.5
    engine = StepEngine(weight, EngineConfig(max_num_reqs=16, logits_block_rows=block_rows))
    assert engine.batch_invariant_verified
    kernel = engine.logits_kernel
    assert engine.stats.logits_kernel == kernel.name and kernel.weight.data_ptr() == weight.data_ptr()
    assert invariance.gemm_invariant(kernel)
    assert_rows_invariant(weight, kernel, [1, 3, kernel.block_rows, kernel.block_rows + 1, 37], seed=threads)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from([(256, 64), (2048, 576), (1000, 96)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    block_rows=st.sampled_from([None, 1, 5, 8, 32]),
    counts=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    num_threads=st.sampled_from([1, 2]),
)
def test_any_row_count_padded_to_the_engines_block_is_invariant(shape, dtype, block_rows, counts, seed, num_threads):
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        weight = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
        engine = StepEngine(weight, EngineConfig(max_num_reqs=8, logits_block_rows=block_rows, sampler_variants=False))
        assert engine.batch_invariant_verified, engine.stats.logits_kernel
        assert_rows_invariant(weight, engine.logits_kernel, counts, seed)
    finally:
        torch.set_num_threads(before)


def test_a_plain_engine_promises_nothing():
    engine = StepEngine(torch.randn(64, 16), EngineConfig(batch_invariant=False, max_num_reqs=4))
    assert not engine.batch_invariant_verified and engine.logits_kernel is None
    assert engine.stats.logits_kernel == "plain"


def test_capture_report_names_the_lm_head_kernel():
    engine = StepEngine(torch.randn(64, 16), EngineConfig(max_num_reqs=2, buckets=(1, 2), sampler_variants=False))
    report = engine.capture()
    assert report.logits_kernel == engine.stats.logits_kernel == engine.logits_kernel.name
    assert f"LM head {report.logits_kernel}" in str(report)


def test_model_kernels_at_smollm2_widths_are_verified(threads):
    """SmolLM2-135M's projection shapes (hidden 576, intermediate 1536, 9 heads of 64, 3 KV heads), one layer."""
    config = LlamaConfig.tiny(vocab_size=256, hidden_size=576, intermediate_size=1536, num_layers=1,
                              num_heads=9, num_kv_heads=3, head_dim=64)
    model = LlamaModel.random(config, seed=0, batch_invariant=True, num_slots=6, max_context=80)
    assert model.batch_invariant_verified
    assert set(model.gemm_kernels) == {"qkv", "o_proj", "gate_up", "down"}
    assert all(name.endswith("[16]") for name in model.gemm_kernels.values()), model.gemm_kernels
    alone, crowd = hidden_alone_and_in_a_crowd(model)  # 5 rows against 18, short last blocks where verified
    assert torch.equal(alone, crowd)
    alone, crowd = hidden_alone_and_in_a_crowd(model, before=60)  # 65 rows: whole blocks grouped where verified
    assert torch.equal(alone, crowd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_where_onednn_refuses_the_dtype_gets_another_verified_kernel(dtype, monkeypatch):
    """Planted: oneDNN refusing every dtype, as it refuses bf16 on AVX2. The engine and the
    batch-invariant model must still build, on a kernel their probe verified."""
    monkeypatch.setattr(ops, "onednn_runs", lambda dtype: False)
    weight = torch.randn(256, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert block_gemm(weight, "onednn", 16) is None
    engine = StepEngine(weight, EngineConfig(max_num_reqs=4, sampler_variants=False))
    assert engine.batch_invariant_verified and not engine.logits_kernel.name.startswith("onednn")
    model = LlamaModel.random(LlamaConfig.tiny(), seed=0, batch_invariant=True, num_slots=2, max_context=32, dtype=dtype)
    assert model.batch_invariant_verified
    assert not any(name.startswith("onednn") for name in model.gemm_kernels.values()), model.gemm_kernels


def test_fast_model_promises_nothing():
    model = LlamaModel.random(LlamaConfig.tiny(), seed=0, batch_invariant=False)  # no longer the default
    assert not model.batch_invariant_verified and model.gemm_kernels == {}


# ---- the probe against planted kernels -----------------------------------------------------------


@pytest.mark.parametrize("bug", ["last row", "neighbours", "only when alone", "not deterministic"])
def test_probe_catches_a_planted_kernel(planted, bug):
    def neighbours(kernel):  # a row's bits depend on whether the other rows are zero
        def bad(gemm, block):
            out = kernel(gemm, block)
            return out + out.abs() * 2**-20 * (block.abs().sum() != block[0].abs().sum())
        return bad

    def only_when_alone(kernel):  # the zero-padded last block takes another path
        def bad(gemm, block):
            out = kernel(gemm, block)
            return out + out.abs() * 2**-20 * ((block != 0).any(dim=1).sum() == 1)
        return bad

    wrap = {"last row": last_row_off(), "neighbours": neighbours, "only when alone": only_when_alone,
            "not deterministic": not_deterministic}[bug]
    weight = torch.randn(300, 40)
    assert invariance.gemm_invariant(block_gemm(weight, "mm", 8))
    planted(wrap, ("mm",))
    assert not invariance.gemm_invariant(block_gemm(weight, "mm", 8))


def test_verdicts_are_cached_per_thread_count(planted, monkeypatch, threads):
    weight = torch.randn(100, 24)
    assert invariance.gemm_invariant(block_gemm(weight, "mm", 4))
    monkeypatch.setitem(BLOCK_KERNELS, "mm", last_row_off()(BLOCK_KERNELS["mm"]))
    # The cached verdict for this thread count stands (same kernel, shape, dtype, device).
    assert invariance.gemm_invariant(block_gemm(torch.randn(100, 24), "mm", 4))
    other = 3 - threads
    torch.set_num_threads(other)  # the `threads` fixture restores it
    assert not invariance.gemm_invariant(block_gemm(weight, "mm", 4))


def test_engine_falls_back_from_a_planted_kernel(planted):
    """The configured 16-row block breaks on every kernel: the engine takes the next block
    size (8) on its first kernel, and it is invariant; no warning."""
    planted(last_row_off(lambda gemm: gemm.block_rows == 16))
    weight = torch.randn(500, 48)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = StepEngine(weight, EngineConfig(max_num_reqs=8, logits_block_rows=16))
    first_kernel = next(k for k in BLOCK_KERNELS if block_gemm(weight, k, 8) is not None)
    assert engine.batch_invariant_verified and engine.stats.logits_kernel == f"{first_kernel}[8]"
    assert_rows_invariant(weight, engine.logits_kernel, [1, 16, 17, 40], seed=0)


def test_engine_steps_run_on_the_fallback_kernel(planted):
    """With the 16-row kernels planted to nudge a block's last row, a request's logprob
    alone and as the 16th of 16 requests (the last row of a 16-row block) must agree: the
    step runs the verified 8-row fallback, not the configured block."""
    planted(last_row_off(lambda gemm: gemm.block_rows == 16))
    gen = torch.Generator().manual_seed(4)
    weight, hidden = torch.randn(300, 32, generator=gen), torch.randn(16, 32, generator=gen)
    engine = StepEngine(weight, EngineConfig(max_num_reqs=16, logits_block_rows=16, sampler_variants=False))
    assert engine.logits_kernel.block_rows == 8
    params = SamplingParams(temperature=0.0, logprobs=0)
    seqs = [SeqMeta(i, True, 1, 1, 1, prompt_tokens=[3], params=params) for i in range(16)]
    crowd = engine.step(hidden, seqs)
    alone = engine.step(hidden[15:], seqs[15:])
    assert crowd.logprobs[15] == alone.logprobs[0]


def test_prompt_logprobs_run_on_the_verified_kernel(planted):
    """Prompt-logprob rows go through the LM head too: with 16- and 32-row kernels planted to
    nudge a block's last row, the 32nd prompt row of a chunk (the last row of an unchecked
    32-row block) must read what the same row gives alone, so the prompt logprobs run the
    engine's verified 8-row fallback."""
    planted(last_row_off(lambda gemm: gemm.block_rows in (16, 32)))
    gen = torch.Generator().manual_seed(5)
    weight, hidden = torch.randn(300, 32, generator=gen), torch.randn(33, 32, generator=gen)
    engine = StepEngine(weight, EngineConfig(max_num_reqs=4, sampler_variants=False))
    assert engine.logits_kernel.block_rows == 8
    tokens = torch.randint(0, 300, (33,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, prompt_logprobs=True)
    crowd = engine.step(hidden, [SeqMeta("long", True, 33, 33, 33, prompt_tokens=tokens, params=params)])
    alone = engine.step(hidden[31:], [SeqMeta("pair", True, 2, 2, 2, prompt_tokens=tokens[31:], params=params)])
    assert crowd.prompt_logprobs[0][31] == alone.prompt_logprobs[0][0]


def test_engine_falls_back_to_single_rows_when_every_block_breaks(planted):
    planted(last_row_off())
    weight = torch.randn(500, 48)
    engine = StepEngine(weight, EngineConfig(max_num_reqs=8))
    assert engine.batch_invariant_verified and engine.logits_kernel.block_rows == 1
    assert_rows_invariant(weight, engine.logits_kernel, [2, 16, 33], seed=1)


def test_nothing_passes_sets_unverified_and_warns_once(planted):
    planted(not_deterministic)
    weight = torch.randn(500, 48)
    with pytest.warns(RuntimeWarning, match="batch invariance does not hold") as caught:
        engines = [StepEngine(weight, EngineConfig(max_num_reqs=8)) for _ in range(2)]
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    for engine in engines:
        assert not engine.batch_invariant_verified
        assert engine.stats.logits_kernel == engine.logits_kernel.name  # the configured block, unverified
        assert engine.logits_kernel.block_rows == 16


# ---- the invariant model's probe ---------------------------------------------------------------------


def hidden_alone_and_in_a_crowd(model: LlamaModel, before: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    """A 5-token prefill alone, and the same prefill placed after a `before`-token one."""
    gen = torch.Generator().manual_seed(7)
    target = torch.randint(2, model.vocab_size, (5,), generator=gen)
    other = torch.randint(2, model.vocab_size, (before,), generator=gen)
    alone_slot, crowd_slots = model.allocate_slot(), (model.allocate_slot(), model.allocate_slot())
    batch = ForwardBatch.of([alone_slot], [5], [5])
    alone = model.forward(target, batch.positions(), batch)
    batch = ForwardBatch.of(list(crowd_slots), [before, 5], [before, 5])
    crowd = model.forward(torch.cat([other, target]), batch.positions(), batch)[before:]
    return alone, crowd


def test_model_falls_back_from_a_planted_kernel_and_stays_invariant(planted):
    planted(last_row_off(lambda gemm: gemm.block_rows == 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = LlamaModel.random(LlamaConfig.tiny(), seed=0, batch_invariant=True, num_slots=4)
    first_kernel = next(k for k in BLOCK_KERNELS if block_gemm(model.weights.layers[0].qkv, k, 8) is not None)
    assert model.batch_invariant_verified
    assert model.gemm_kernels == dict.fromkeys(("qkv", "o_proj", "gate_up", "down"), f"{first_kernel}[8]")
    alone, crowd = hidden_alone_and_in_a_crowd(model)
    assert torch.equal(alone, crowd)


def test_planted_kernel_is_used_when_unverified_and_breaks_invariance(planted):
    """The planted kernel really runs in the forward: with nothing verified the model warns,
    says so, and a request's hidden states do depend on its neighbours."""
    planted(not_deterministic)
    with pytest.warns(RuntimeWarning, match="Llama model"):
        model = LlamaModel.random(LlamaConfig.tiny(), seed=0, batch_invariant=True, num_slots=4)
    assert not model.batch_invariant_verified
    alone, crowd = hidden_alone_and_in_a_crowd(model)
    assert not torch.equal(alone, crowd)


def test_model_probe_catches_attention_tiles_that_depend_on_the_item_count(planted, monkeypatch):
    real_bmm = torch.bmm

    def bad_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = real_bmm(a, b)
        return out + out.abs() * 2**-20 if a.shape[0] > 64 else out

    monkeypatch.setattr(torch, "bmm", bad_bmm)
    with pytest.warns(RuntimeWarning, match="attention tiles"):
        model = LlamaModel.random(LlamaConfig.tiny(), seed=0, batch_invariant=True, num_slots=4)
    assert not model.batch_invariant_verified
    assert all(name.endswith("[16]") for name in model.gemm_kernels.values())  # the projections hold


# ---- short calls: a partial last block unpadded where the probe says its bits hold -----------------


def exact_rows(kernel):
    """A block kernel whose rows never depend on their neighbours (float64 products, rounded)."""
    def rows(gemm: BlockGemm, block: torch.Tensor) -> torch.Tensor:
        return (block.double() @ gemm.weight.double().t()).to(block.dtype)
    return rows


def off_below(fewest: int):
    """A kernel whose calls of fewer than `fewest` rows are off by a tiny epsilon."""
    def wrap(kernel):
        def bad(gemm: BlockGemm, block: torch.Tensor) -> torch.Tensor:
            out = kernel(gemm, block)
            return out + out.abs() * 2**-20 if block.shape[0] < fewest else out
        return bad
    return wrap


@pytest.mark.parametrize("fewest", [1, 2, 5, 8])
def test_short_calls_from_finds_the_fewest_rows_that_keep_the_block_bits(planted, fewest):
    planted(exact_rows)
    planted(off_below(fewest))
    gemm = block_gemm(torch.randn(300, 40), "mm", 8)
    assert invariance.short_calls_from(gemm) == fewest  # 8: no short call keeps them
    # The engine's LM head runs a short last block only as a verified call: one row alone
    # and 1 to 20 rows give each row its block's bits.
    engine = StepEngine(torch.randn(300, 40), EngineConfig(max_num_reqs=4, logits_block_rows=8, sampler_variants=False))
    assert engine.batch_invariant_verified and engine.logits_kernel.short_from == fewest
    assert_rows_invariant(engine.logits_kernel.weight, engine.logits_kernel, [1, 2, 3, 5, 9, 20], seed=fewest)


@pytest.mark.parametrize("block_rows, short_from, want", [
    (16, None, [16] * 15), (16, 16, [16] * 15), (16, 1, [4, 4, 4] + list(range(4, 16))),
    (16, 2, [4, 4, 4] + list(range(4, 16))), (16, 6, [6] * 6 + list(range(7, 16))),
    (3, 1, [3, 3]), (4, 2, [4, 4, 4])])
def test_a_short_block_runs_as_a_verified_call_of_at_least_four_rows(block_rows, short_from, want):
    gemm = BlockGemm("mm", torch.zeros(3, 2), block_rows, short_from=short_from)
    assert [gemm.tail_rows(n) for n in range(1, block_rows)] == want


def off_above(most: int):
    """A kernel whose calls of more than `most` rows are off by a tiny epsilon."""
    def wrap(kernel):
        def bad(gemm: BlockGemm, block: torch.Tensor) -> torch.Tensor:
            out = kernel(gemm, block)
            return out + out.abs() * 2**-20 if block.shape[0] > most else out
        return bad
    return wrap


@pytest.mark.parametrize("most_rows, blocks", [(8, 1), (16, 2), (31, 2), (32, 4), (64, 8), (1000, 8)])
def test_long_calls_upto_finds_the_most_blocks_that_keep_the_block_bits(planted, most_rows, blocks):
    planted(exact_rows)
    planted(off_above(most_rows))
    gemm = block_gemm(torch.randn(300, 40), "mm", 8)
    assert invariance.long_calls_upto(gemm) == blocks
    # The engine groups blocks only as far as verified: a row alone and in 1 to 70 rows agree.
    engine = StepEngine(torch.randn(300, 40), EngineConfig(max_num_reqs=4, logits_block_rows=8, sampler_variants=False))
    assert engine.batch_invariant_verified and engine.logits_kernel.long_blocks == blocks
    assert_rows_invariant(engine.logits_kernel.weight, engine.logits_kernel, [1, 9, 16, 17, 40, 70], seed=most_rows)


def test_model_groups_blocks_only_as_far_as_verified(planted):
    """Planted: every kernel off in calls of more than 16 rows. The model's projections may
    then group two 8-row blocks per call, no more: a prefill alone equals the same prefill
    after a 60-token one (65 rows: calls of 16, 16, 16, 16 and 1 rows)."""
    planted(exact_rows)
    planted(off_above(16))
    model = LlamaModel.random(LlamaConfig.tiny(), seed=0, batch_invariant=True, num_slots=4, row_block=8)
    assert model.batch_invariant_verified
    assert {layer.qkv.long_blocks for layer in model.invariant.layers} == {2}
    alone, crowd = hidden_alone_and_in_a_crowd(model, before=60)
    assert torch.equal(alone, crowd)


def test_a_kernel_off_only_where_a_long_call_puts_a_row_is_caught(planted):
    """Planted: a kernel whose rows past the first block of a call are off. A call of two
    blocks puts the probe's second block there, so no call may group blocks."""
    planted(exact_rows, ("mm",))

    def wrap(kernel):
        def bad(gemm: BlockGemm, block: torch.Tensor) -> torch.Tensor:
            out = kernel(gemm, block).clone()
            out[gemm.block_rows :] += out[gemm.block_rows :].abs() * 2**-20
            return out
        return bad
    planted(wrap, ("mm",))
    assert invariance.long_calls_upto(block_gemm(torch.randn(300, 40), "mm", 8)) == 1


@pytest.mark.parametrize("block_rows, long_blocks", [(1, 1), (1, 8), (5, 1), (5, 2), (5, 8), (16, 4)])
def test_block_calls_cover_the_rows_in_verified_sizes(block_rows, long_blocks):
    """`BlockGemm.calls` against a Python loop: whole blocks in the largest power-of-two
    group up to `long_blocks` that fits, then the partial rest as one range."""
    gemm = BlockGemm("mm", torch.zeros(3, 2), block_rows, long_blocks=long_blocks)
    for rows in range(0, 140):
        want, start = [], 0
        while rows - start >= block_rows:
            group = max(g for g in (1, 2, 4, 8) if g <= long_blocks and start + g * block_rows <= rows)
            want.append((start, start + group * block_rows))
            start += group * block_rows
        if start < rows:
            want.append((start, rows))
        assert gemm.calls(rows) == want, rows


def test_model_pads_a_step_only_to_the_short_calls_that_hold(planted):
    """Every kernel's one-row calls are off: a one-token step must run as two rows, so a
    request decoding alone gets the bits it gets beside another one; steps of 2 to 15 and
    17 tokens run unpadded or nearly so."""
    planted(exact_rows)
    planted(off_below(2))
    model = LlamaModel.random(LlamaConfig.tiny(), seed=0, batch_invariant=True, num_slots=4)
    assert model.batch_invariant_verified
    assert [model.invariant.step_rows(t) for t in (1, 2, 15, 16, 17, 18)] == [2, 2, 15, 16, 18, 18]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, model.vocab_size, (6,), generator=gen) for _ in range(2)]
    slots = [model.allocate_slot() for _ in range(3)]
    for slot, prompt in zip(slots, (prompts[0], prompts[0], prompts[1])):
        batch = ForwardBatch.of([slot], [6], [6])
        model.forward(prompt, batch.positions(), batch)
    token = torch.tensor([5])
    batch = ForwardBatch.of([slots[0]], [1], [7])
    alone = model.forward(token, batch.positions(), batch)
    batch = ForwardBatch.of([slots[2], slots[1]], [1, 1], [7, 7])
    crowd = model.forward(torch.tensor([9, 5]), batch.positions(), batch)[1:]
    assert torch.equal(alone, crowd)
