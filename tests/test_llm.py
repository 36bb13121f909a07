"""`engine.LLM` as a new user meets it, on the tiny random model (no weights, a byte
tokenizer): built once, text in, vLLM-shaped outputs, fresh and reproducible seeds,
streaming equal to generate, every bad input refused before any compute."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine import LLM, CompletionOutput, LoopConfig, RequestOutput, SamplingParams
from engine.loop.decode_loop import DecodeLoop
from engine.loop.generate import generate
from engine.models.tiny import tiny_model
from engine.models.tokenizer import ByteChatMLTokenizer, PlainTokenizer, as_tokenizer
from engine.step.engine_config import EngineConfig
from engine.step.step_engine import StepEngine

PROMPTS = ["Hello", "Name three colors."]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # Eager steps keep the module cheap; `test_graphs_are_captured_once...` replays graphs.
    return LLM("tiny", max_num_reqs=2, engine_config=EngineConfig(use_graphs=False))


@pytest.fixture
def no_compute(llm, monkeypatch):
    """Any model forward or engine step fails the test: a refused call computes nothing."""
    def refuse(*args, **kwargs):
        raise AssertionError("computed before refusing")

    monkeypatch.setattr(llm.model, "forward", refuse)
    monkeypatch.setattr(llm.engine, "run", refuse)
    yield llm
    assert not llm.loop.has_work() and not llm.loop.finished


def test_graphs_are_captured_once_at_construction_and_replayed_by_every_call(monkeypatch):
    llm = LLM("tiny", max_num_reqs=1, engine_config=EngineConfig(sampler_variants=False, token_bitmask=False))
    assert llm.startup.capture > 0 and llm.startup.total >= llm.startup.load + llm.startup.capture
    monkeypatch.setattr(StepEngine, "capture", lambda *a, **k: pytest.fail("captured again"))
    for _ in range(2):
        before = llm.engine.stats.replays
        [out] = llm.generate("Hi", SamplingParams(max_tokens=3))
        assert llm.engine.stats.replays - before == len(out.outputs[0].token_ids) and not llm.engine.stats.eager_steps


def test_a_new_users_script_gets_request_outputs_with_text_and_fresh_reproducible_seeds(llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)
    first = llm.generate(PROMPTS, params)
    assert [type(o) for o in first] == [RequestOutput, RequestOutput]
    for out, prompt in zip(first, PROMPTS):
        assert out.prompt == prompt and out.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert out.prompt_logprobs is None and out.finished
        [sample] = out.outputs
        assert isinstance(sample, CompletionOutput) and sample.index == 0 and sample.finished()
        assert sample.text == llm.tokenizer.decode(sample.token_ids) and 1 <= len(sample.token_ids) <= 8
        assert sample.finish_reason in ("stop", "length") and isinstance(sample.seed, int)
    second = llm.generate(PROMPTS, params)
    assert [o.outputs[0].seed for o in second] != [o.outputs[0].seed for o in first]
    assert [o.outputs[0].text for o in second] != [o.outputs[0].text for o in first]
    # Each reported seed reproduces its text, alone or together.
    again = llm.generate(PROMPTS, [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=o.outputs[0].seed)
                                   for o in first])
    assert [o.outputs[0].text for o in again] == [o.outputs[0].text for o in first]
    alone = llm.generate(PROMPTS[1], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8,
                                                    seed=first[1].outputs[0].seed))
    assert alone[0].outputs[0].token_ids == first[1].outputs[0].token_ids
    assert not llm.loop.finished and not llm.loop.has_work()  # nothing kept per finished request


@pytest.mark.parametrize("prompts, params, match", [
    ([[1, "a", 3]], None, r"prompts\[0\]\[1\]='a': must be an int token id, not a str"),
    ([[1, 2], [5, 9999]], None, r"prompts\[1\]\[1\]=9999: outside \[0, 288\)"),
    (["fine", 3.5], None, r"prompts\[1\]=3.5: a float; a prompt is a str, a list of token ids"),
    ([{"prompt": 7}], None, r"prompts\[0\]\['prompt'\]=7: must be a str"),
    ([[{"role": "user"}]], None, r"prompts\[0\]\[0\]=.*a message is a dict with str 'role' and 'content'"),
    ([""], None, r"prompts\[0\]='': an empty prompt"),
    ([], None, r"prompts=\[\]: no prompt"),
    (PROMPTS, [SamplingParams()], r"sampling_params: 1 entries for 2 prompts"),
    (PROMPTS, {"temperature": 0.5}, r"sampling_params=\{'temperature': 0.5\}: must be a SamplingParams"),
    (PROMPTS, [SamplingParams(), SamplingParams(logprobs=500)], r"prompts\[1\]: params.logprobs=500: more than"),
    (PROMPTS, SamplingParams(stop_token_ids=(4000,)), r"prompts\[0\]: .*stop_token_ids"),
    (["x" * 2000], None, r"prompts\[0\]: prompt \(2000 tokens\) \+ max_tokens \(16\) needs a context of 2015"),
])
def test_every_bad_prompt_or_parameter_raises_naming_it_before_any_compute(no_compute, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        no_compute.generate(prompts, params)


def test_a_bad_parameter_is_refused_where_it_is_built():
    with pytest.raises(ValueError, match=r"temperature=-1: must be a finite number >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"json_schema='\{not json': not valid JSON"):
        SamplingParams(json_schema="{not json")


def test_prompts_come_as_text_ids_chats_or_vllm_dicts(llm):
    chat = [{"role": "user", "content": "Hi"}]
    greedy = SamplingParams(temperature=0, max_tokens=3)
    outs = llm.generate(["Hi", [72, 105], chat, {"prompt": "Hi"}, {"prompt_token_ids": np.array([72, 105])}], greedy)
    assert [o.prompt_token_ids for o in outs[:2]] == [[72, 105]] * 2 and outs[1].prompt is None
    assert outs[2].prompt_token_ids == llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert outs[2].prompt == llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert outs[2].outputs[0].token_ids == llm.chat(chat, greedy)[0].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[3].outputs[0].token_ids
    one_flat = llm.generate([72, 105], greedy)  # a flat list of ids is one prompt
    assert len(one_flat) == 1 and one_flat[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_n_samples_logprobs_and_prompt_logprobs_in_vllms_shape(llm):
    [out] = llm.generate("Hi", SamplingParams(n=2, max_tokens=4, logprobs=2, prompt_logprobs=1, seed=5))
    assert [s.index for s in out.outputs] == [0, 1] and out.outputs[0].seed == 5
    assert out.outputs[0].seed != out.outputs[1].seed
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for position, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:]):
        assert token in position and position[token].rank >= 1
    for sample in out.outputs:
        assert len(sample.logprobs) == len(sample.token_ids)
        for position, token in zip(sample.logprobs, sample.token_ids):
            assert list(position)[0] == token and 1 <= len(position) <= 3
            assert position[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
        assert sample.cumulative_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(sample.logprobs,
                                                                                              sample.token_ids)))


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**32), cut=st.integers(1, 8), length=st.integers(1, 3))
@example(seed=0, cut=1, length=2)  # a two-character stop string: the hold-back decides the last delta
def test_stream_deltas_join_to_the_generated_text_with_stop_strings(llm, seed, cut, length):
    plain = SamplingParams(temperature=1.0, max_tokens=10, seed=seed)
    text = llm.generate("Hello", plain)[0].outputs[0].text
    stop = text[cut : cut + length] or "zz"
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=seed, stop=[stop, "\x00never"])
    expected = llm.generate("Hello", params)[0].outputs[0]
    deltas = list(llm.stream("Hello", params))
    assert "".join(deltas) == expected.text and all(deltas)
    assert stop not in expected.text or expected.finish_reason != "stop"


def test_a_stream_closed_early_leaves_the_llm_clean_and_others_wait_for_it(llm):
    stream = llm.stream("Hello", SamplingParams(max_tokens=30, seed=1))
    with pytest.raises(ValueError, match=r"a stream \(request \d+\) is still open"):
        llm.generate("Hi")
    next(stream)
    stream.close()
    assert not llm.loop.has_work() and not llm.loop.finished
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"sampling_params.n=2: stream runs one sample"):
        llm.stream("Hi", SamplingParams(n=2))


def test_structured_output_uses_the_tokenizer_the_llm_holds(llm):
    [out] = llm.generate("Hi", SamplingParams(temperature=1.0, max_tokens=6, regex="[ab]+", seed=2))
    assert set(out.outputs[0].text) <= {"a", "b"} and out.outputs[0].text


def test_construction_refuses_what_it_cannot_build_before_loading(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    for kwargs, match in [
        (dict(model="nonesuch"), r"model='nonesuch': no such folder; give 'smollm2', 'tiny'"),
        (dict(model=str(tmp_path)), r"config.json does not parse"),
        (dict(model=3), r"model=3: a int"),
        (dict(model="tiny", tokenizer=ByteChatMLTokenizer()), r"tokenizer=: LLM\('tiny'\) loads the model's own"),
        (dict(model="tiny", seed=1, config=LoopConfig(seed_base=2)), r"seed=1: config=LoopConfig\(seed_base=2\)"),
        (dict(model="tiny", batch_invariant=False, engine_config=EngineConfig()), r"batch_invariant=False"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(**kwargs)


def test_a_model_object_with_an_hf_protocol_tokenizer_and_token_ids_without_one():
    model, tokenizer = tiny_model(num_slots=1)
    bare = LLM(model, max_num_reqs=1, engine_config=EngineConfig(use_graphs=False))
    [out] = bare.generate([[72, 105]], SamplingParams(temperature=0, max_tokens=2))
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"prompts\[0\]='Hi': text, but this LLM has no tokenizer"):
        bare.generate("Hi")


def test_the_tokenizers_speak_hugging_faces_protocol():
    tok = ByteChatMLTokenizer()
    chat = [{"role": "user", "content": "héllo"}]
    assert tok("héllo").input_ids == tok.encode("héllo") == list("héllo".encode())
    batch = tok(["a", "bc"])
    assert batch["input_ids"] == [[97], [98, 99]] and batch.attention_mask == [[1], [1, 1]]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == tok.chat_prompt(chat)
    assert tok.apply_chat_template(chat, tokenize=False) == "<|im_start|>user\nhéllo<|im_end|>\n"
    assert tok.eos_token_id == tok.token_id("<|im_end|>") == 257
    assert tok.decode(tok.encode("<|im_end|>x"), skip_special_tokens=False) == "<|im_end|>x"
    with pytest.raises(ValueError, match=r"conversation\[0\]=.*a message is a dict"):
        tok.apply_chat_template([{"content": "no role"}])


def test_as_tokenizer_takes_ours_a_tokenizers_tokenizer_and_a_transformers_one():
    from tokenizers import Tokenizer, models, pre_tokenizers

    ours = ByteChatMLTokenizer()
    assert as_tokenizer(ours) is ours
    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "there": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    plain = as_tokenizer(raw, eos_token_id=0)
    assert isinstance(plain, PlainTokenizer) and plain.encode("hi there") == [1, 2] and plain.eos_token_id == 0
    with pytest.raises(ValueError, match=r"has no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"tokenizer=dict: must be one of the engine's tokenizers"):
        as_tokenizer({})
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="[UNK]")
    wrapped = as_tokenizer(hf)
    assert wrapped.encode("hi there") == [1, 2] and wrapped.eos_token_id == 0 and wrapped("hi").input_ids == [1]


def test_loop_seeds_are_fresh_by_default_and_derived_with_a_seed_base():
    model, tokenizer = tiny_model(num_slots=2)

    def seeds(config: LoopConfig) -> list[int]:
        loop = DecodeLoop(model, config, engine_config=EngineConfig(use_graphs=False), capture=False)
        for i in range(2):
            loop.submit(i, [72, 105], SamplingParams(max_tokens=1))
        return [c.seed for _, c in sorted(loop.run().items())]

    fresh, again = seeds(LoopConfig(max_num_reqs=2)), seeds(LoopConfig(max_num_reqs=2))
    assert fresh != again and len(set(fresh)) == 2
    assert seeds(LoopConfig(max_num_reqs=2, seed_base=3)) == seeds(LoopConfig(max_num_reqs=2, seed_base=3))


def test_generate_refuses_text_and_flat_prompts_before_building_an_engine(monkeypatch):
    model, _ = tiny_model(num_slots=1)
    monkeypatch.setattr(StepEngine, "__init__", lambda *a, **k: pytest.fail("built an engine first"))
    with pytest.raises(ValueError, match=r"prompts\[0\]='Hello': text, not token ids; encode it first"):
        generate(model, ["Hello"])
    with pytest.raises(ValueError, match=r"a flat list of ints; generate takes a list of prompts"):
        generate(model, [1, 2, 3])
    with pytest.raises(ValueError, match=r"prompts='Hello': a str"):
        generate(model, "Hello")



# -- library errors a new user met (issue 27, list 9) ------------------------------------------

def test_a_vocabulary_smaller_than_the_top_n_is_refused_when_the_engine_is_built():
    import torch

    from engine import SamplerConfig

    with pytest.raises(ValueError, match=r"EngineConfig.sampler.max_logprobs=20: exceeds the LM head's vocabulary "
                                         r"V=5; build it with EngineConfig\(sampler=SamplerConfig\(max_logprobs=5\)\)"):
        StepEngine(torch.randn(5, 16), EngineConfig(device="cpu", max_num_reqs=2))
    engine = StepEngine(torch.randn(5, 16), EngineConfig(device="cpu", max_num_reqs=2,
                                                        sampler=SamplerConfig(max_logprobs=5)))
    assert engine.capture().buckets


def test_a_kv_cache_past_the_machines_memory_is_refused_naming_num_slots():
    from engine.models.llama import LlamaModel
    from engine.models.llama_weights import LlamaConfig, random_weights

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position=1024, eos_token_id=1)
    with pytest.raises(ValueError, match=r"num_slots=100000000: the KV cache would take .* GiB .* lower num_slots"):
        LlamaModel(config, random_weights(config, 0), num_slots=10**8, max_context=1024)
