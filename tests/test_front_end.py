"""The front end as a hostile or hurried user meets it (issue 36 items 3 and 4): one
`LLM` shared by two threads, streams closed or dropped at any point, `forget` of one
sample of a family, every `LLM` argument checked, `seed` seeding sampling only; and
the vLLM habits a user brings (use_tqdm, skip_special_tokens, top_k=-1, bad words as
strings, StructuredOutputsParams, logprobs=-1)."""
from __future__ import annotations

import gc
import re
import threading
import warnings

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.models.tiny import tiny_model
from engine.step.engine_config import EngineConfig

EAGER = EngineConfig(use_graphs=False)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", max_num_reqs=2, engine_config=EAGER)


def assert_clean(llm: LLM) -> None:
    """Nothing queued, running or kept per request: the next call starts from scratch."""
    assert not llm.loop.has_work() and not llm.loop.finished and not llm.loop.families
    assert not llm.loop._known and len(llm.loop.batch) == 0


# -- item 3.1: one LLM, two threads ----------------------------------------------------


def test_a_second_thread_waits_its_turn_and_both_get_what_they_would_alone(llm):
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=s) for s in (1, 2)]
    alone = [llm.generate(["Hello", "Name three colors."], p) for p in params]
    forward = llm.model.forward
    first_forward, second_done = threading.Event(), threading.Event()
    results: dict[int, object] = {}

    def slow_forward(*args, **kwargs):
        # The first caller's first forward lets the second caller in and gives it time to
        # run (or, with the lock, to queue on it) before going on.
        if threading.current_thread().name == "first" and not first_forward.is_set():
            first_forward.set()
            second_done.wait(timeout=2)
        return forward(*args, **kwargs)

    def call(index: int) -> None:
        try:
            if index == 1:
                first_forward.wait(timeout=10)
            results[index] = llm.generate(["Hello", "Name three colors."], params[index])
        except BaseException as err:  # noqa: BLE001 (the test reports it below)
            results[index] = err
        finally:
            if index == 1:
                second_done.set()

    llm.model.forward = slow_forward
    try:
        threads = [threading.Thread(target=call, args=(i,), name=("first", "second")[i]) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        del llm.model.forward
    for index in (0, 1):
        assert not isinstance(results[index], BaseException), results[index]
        assert [o.outputs[0].token_ids for o in results[index]] == [o.outputs[0].token_ids for o in alone[index]]
    assert_clean(llm)
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_a_stream_open_in_one_thread_refuses_another_threads_call_clearly(llm):
    stream = llm.stream("Hello", SamplingParams(max_tokens=30, seed=1))
    next(stream)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            llm.generate("Hi", SamplingParams(max_tokens=2))
        except ValueError as err:
            errors.append(err)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "a stream (request" in str(errors[0]) and "is still open" in str(errors[0])
    stream.close()
    assert_clean(llm)


# -- item 3.2: streams closed or dropped at any point ----------------------------------


@pytest.mark.parametrize("deltas_read", [0, 1, 3])
def test_a_stream_closed_at_any_point_aborts_its_request(llm, deltas_read):
    stream = llm.stream("Hello", SamplingParams(max_tokens=30, seed=1, temperature=1.0))
    for _ in range(deltas_read):
        next(stream)
    stream.close()
    assert_clean(llm)
    with pytest.raises(StopIteration):
        next(stream)
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    assert "".join(llm.stream("Hi", SamplingParams(max_tokens=3, seed=2))) == \
        llm.generate("Hi", SamplingParams(max_tokens=3, seed=2))[0].outputs[0].text


@pytest.mark.parametrize("deltas_read", [0, 1])
def test_a_stream_dropped_without_close_aborts_its_request(llm, deltas_read):
    stream = llm.stream("Hello", SamplingParams(max_tokens=30, seed=1, temperature=1.0))
    for _ in range(deltas_read):
        next(stream)
    del stream
    gc.collect()
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    assert_clean(llm)


def test_a_stream_used_as_a_context_manager_closes_on_exit(llm):
    with llm.stream("Hello", SamplingParams(max_tokens=30, seed=1)) as stream:
        next(stream)
    assert_clean(llm)


# -- item 3.3: forget of one sample of a family ----------------------------------------


def test_forget_of_one_sample_is_refused_and_the_family_stays_whole():
    model, tokenizer = tiny_model(num_slots=4)
    loop = DecodeLoop(model, LoopConfig(max_num_reqs=2, token_budget=64), tokenizer=tokenizer,
                      engine_config=EAGER)
    loop.submit("g", [72, 105], SamplingParams(n=2, max_tokens=3, seed=3))
    loop.run()
    with pytest.raises(ValueError, match=r"request \('g', 0\): one of the 2 samples of request 'g'; forget 'g'"):
        loop.forget(("g", 0))
    done = loop.forget("g")
    assert [c.request_id for c in done] == [("g", 0), ("g", 1)]
    assert not loop.finished and not loop.families and not loop._known
    loop.submit("g", [72, 105], SamplingParams(max_tokens=2, seed=3))  # the id is free again
    loop.run()
    assert loop.forget("g").tokens


def test_abort_of_one_sample_still_hands_the_family_over_whole():
    model, tokenizer = tiny_model(num_slots=4)
    loop = DecodeLoop(model, LoopConfig(max_num_reqs=2, token_budget=64), tokenizer=tokenizer,
                      engine_config=EAGER)
    loop.submit("g", [72, 105], SamplingParams(n=2, max_tokens=3, seed=3))
    assert loop.abort(("g", 1)).finish_reason == "abort"
    with pytest.raises(ValueError, match=r"request \('g', 1\): one of the 2 samples of request 'g'"):
        loop.forget(("g", 1))
    loop.run()
    assert [c.finish_reason for c in loop.forget("g")] == ["length", "abort"]
    assert not loop.finished and not loop._known


# -- item 3.4: every LLM argument checked ----------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_reqs=0), r"^max_num_reqs=0: must be an int >= 1"),
    (dict(max_num_reqs=-2), r"^max_num_reqs=-2: must be an int >= 1"),
    (dict(max_num_reqs=2.0), r"^max_num_reqs=2.0: must be an int >= 1"),
    (dict(max_num_reqs=True), r"^max_num_reqs=True: must be an int >= 1"),
    (dict(max_context=0), r"^max_context=0: must be an int >= 1"),
    (dict(max_context=1.5), r"^max_context=1.5: must be an int >= 1"),
    (dict(max_context="64"), r"^max_context='64': must be an int >= 1"),
    (dict(seed=-1), r"^seed=-1: must be None \(fresh seeds per request\) or an int in \[0, 2\*\*64\)"),
    (dict(seed=1.0), r"^seed=1.0: must be None \(fresh seeds per request\) or an int in \[0, 2\*\*64\)"),
    (dict(seed=2**64), r"^seed=18446744073709551616: must be None"),
    (dict(device=3), r"^device=3: must be 'auto', 'cpu' or 'cuda'"),
    (dict(device="tpu"), r"^device='tpu': must be 'auto', 'cpu' or 'cuda'"),
    (dict(progress="yes"), r"^progress='yes': must be a bool"),
    (dict(batch_invariant=1), r"^batch_invariant=1: must be a bool"),
    (dict(config=dict(max_num_reqs=2)), r"^config=\{'max_num_reqs': 2\}: must be a LoopConfig"),
    (dict(engine_config="eager"), r"^engine_config='eager': must be an EngineConfig"),
])
def test_every_llm_argument_is_checked_naming_it_before_loading(monkeypatch, kwargs, match):
    monkeypatch.setattr("engine.llm.llm.load", lambda *a, **k: pytest.fail("loaded before refusing"))
    with pytest.raises(ValueError, match=match):
        LLM("tiny", **kwargs)


def test_max_num_reqs_and_max_context_are_what_the_llm_runs_with():
    llm = LLM("tiny", max_num_reqs=3, max_context=40, engine_config=EAGER)
    assert llm.config.max_num_reqs == 3 and llm.model.max_context == 40
    with pytest.raises(ValueError, match=r"max_context is 40"):
        llm.generate([1] * 30, SamplingParams(max_tokens=16))


# -- item 3.5: seed seeds sampling only ------------------------------------------------


def test_the_llm_seed_seeds_sampling_not_the_tiny_models_weights():
    llms = [LLM("tiny", max_num_reqs=1, seed=seed, engine_config=EAGER) for seed in (None, 1, 2)]
    weights = [llm.model.lm_head_weight for llm in llms]
    assert all(torch.equal(weights[0], w) for w in weights[1:])
    params = SamplingParams(temperature=1.0, max_tokens=8)
    texts = [llm.generate("Hello", params)[0].outputs[0].token_ids for llm in llms[1:]]
    assert texts[0] != texts[1]  # the seeds differ where they should: in the samples
    again = LLM("tiny", max_num_reqs=1, seed=1, engine_config=EAGER).generate("Hello", params)
    assert again[0].outputs[0].token_ids == texts[0]
    # A seed reported by one instance reproduces on an instance with another seed.
    seeded = llms[1].generate("Hello", params)[0].outputs[0]
    redo = llms[2].generate("Hello", SamplingParams(temperature=1.0, max_tokens=8, seed=seeded.seed))
    assert redo[0].outputs[0].token_ids == seeded.token_ids


# -- item 4: vLLM habits ---------------------------------------------------------------


def test_the_vllm_snippet_runs_and_top_k_minus_one_is_off(llm):
    prompts = ["Hello", "Name three colors."]
    outs = llm.generate(prompts, SamplingParams(top_k=-1, bad_words=["foo"], skip_special_tokens=False, seed=4),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == prompts and all(o.outputs[0].token_ids for o in outs)
    plain = llm.generate(prompts, SamplingParams(top_k=0, seed=4))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0) and SamplingParams(seed=-1).seed is None
    with pytest.raises(ValueError, match=r"top_k=-2: must be an int >= 0, or -1 \(0 and -1 mean off\)"):
        SamplingParams(top_k=-2)


def test_use_tqdm_draws_a_bar_over_the_prompts(llm, capsys):
    llm.generate(["Hi", "Ho", "Hu"], SamplingParams(max_tokens=2, n=2), use_tqdm=True)
    assert "processed prompts [########################] 3/3" in capsys.readouterr().err
    llm.generate("Hi", SamplingParams(max_tokens=2))
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match=r"use_tqdm='yes': must be a bool"):
        llm.generate("Hi", use_tqdm="yes")
    assert_clean(llm)


def test_greedy_with_n_above_one_is_refused_as_vllm_does():
    with pytest.raises(ValueError, match=r"n=2: must be 1 when temperature=0 \(greedy\)"):
        SamplingParams(n=2, temperature=0)
    assert SamplingParams(n=2, temperature=0.5).n == 2


@pytest.mark.parametrize("tokens, skip, spaces, text", [
    ([72, 105], True, True, "Hi"),
    ([72, 256, 256, 105, 33], True, True, "Hi!"),
    ([72, 256, 256, 105, 33], False, True, "H <|im_start|> <|im_start|> i!"),
    ([72, 256, 256, 105, 33], False, False, "H<|im_start|><|im_start|>i!"),
    ([257, 72], False, True, "<|im_end|> H"),
])
def test_special_tokens_in_the_text_as_vllm_detokenizes(tokens, skip, spaces, text):
    from engine.loop.detokenize import output_decoder
    from engine.models.tokenizer import ByteChatMLTokenizer

    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert output_decoder(ByteChatMLTokenizer(), params).decode(tokens) == text


@pytest.mark.parametrize("skip, spaces", [(True, True), (False, True), (False, False)])
def test_generate_and_stream_detokenize_as_asked(llm, skip, spaces):
    # Only "H" and <|im_start|> may be sampled: the text shows how specials are written.
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, allowed_token_ids=[72, 256],
                            skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    [out] = llm.generate("Hi", params)
    tokens = out.outputs[0].token_ids
    assert 256 in tokens and 72 in tokens
    pieces = ["<|im_start|>" if t == 256 else "H" for t in tokens if not (skip and t == 256)]
    # The reference: every "H" beside another "H" joins without a space; specials are apart.
    expected = pieces[0] if pieces else ""
    for before, piece in zip(pieces, pieces[1:]):
        apart = spaces and "<|im_start|>" in (before, piece)
        expected += (" " if apart else "") + piece
    assert out.outputs[0].text == expected
    assert "".join(llm.stream("Hi", params)) == expected


class WordTokenizer:
    """Words as tokens: "foo" alone is 1, " foo" (inside a text) is 2; "bar baz" is two
    words either way, so its spaced form has one token more."""

    VOCAB = {"foo": 1, " foo": 2, "bar": 3, " bar": 4, " baz": 5}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.VOCAB[word] for word in re.findall(r" ?\w+", text)]


@pytest.mark.parametrize("words, sequences", [
    (["foo"], [(1,), (2,)]),  # a new first token, same count: both
    (["  foo"], [(1,), (2,)]),  # leading white space stripped first
    (["bar baz"], [(3, 5), (4, 5)]),
    ([(7, 8)], [(7, 8)]),  # token ids as they are
])
def test_bad_words_as_text_are_tokenized_as_vllm_does(words, sequences):
    from engine.host.token_constraints import TokenConstraints

    constraints = TokenConstraints(16, WordTokenizer())
    assert constraints.bad_word_tokens("r", words) == sequences
    with pytest.raises(ValueError, match=r"request 'r': params.bad_words\[0\]='foo': a word as text needs a tokenizer"):
        TokenConstraints(16).bad_word_tokens("r", ["foo"])


def test_a_bad_word_as_text_is_never_completed(llm):
    # Only "H" and "i" may be sampled; "Hi" banned: an "i" never follows an "H".
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, allowed_token_ids=[72, 105], bad_words=["Hi"])
    [out] = llm.generate("Hello", params)
    text = out.outputs[0].text
    assert "H" in text and re.fullmatch("i*H+", text)
    [free] = llm.generate("Hello", SamplingParams(temperature=1.0, seed=3, max_tokens=24, allowed_token_ids=[72, 105]))
    assert "Hi" in free.outputs[0].text  # the ban, not the seed, keeps it out
    with pytest.raises(ValueError, match=r"bad_words\[0\]=' ': a word of white space bans nothing"):
        SamplingParams(bad_words=[" "])


def test_structured_outputs_params_is_vllms_spelling_of_the_flat_fields(llm):
    from engine import StructuredOutputsParams

    nested = SamplingParams(temperature=1.0, max_tokens=6, seed=2,
                            structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    flat = SamplingParams(temperature=1.0, max_tokens=6, seed=2, regex="[ab]+")
    assert nested.structured == flat.structured == ("regex", "[ab]+")
    [a], [b] = llm.generate("Hi", nested), llm.generate("Hi", flat)
    assert a.outputs[0].text == b.outputs[0].text and set(a.outputs[0].text) <= {"a", "b"}
    schema = {"type": "object"}
    assert SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)).structured[0] == "json_schema"
    assert SamplingParams(**vars(nested)) == nested
    with pytest.raises(ValueError, match=r"give exactly one of json, regex or grammar"):
        StructuredOutputsParams(regex="a", grammar="b")
    with pytest.raises(ValueError, match=r"and grammar='x': give the constraint one way, not both"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), grammar="x")


def test_logprobs_minus_one_is_the_whole_vocabulary_within_the_cap(llm):
    with pytest.raises(ValueError, match=r"prompts\[0\]: params.logprobs=-1: the whole vocabulary \(288 tokens\) is "
                                         r"more than max_logprobs=20"):
        llm.generate("Hi", SamplingParams(logprobs=-1))
    assert_clean(llm)
    from engine.sampling.sampler_config import SamplerConfig

    wide = LLM("tiny", max_num_reqs=1, engine_config=EngineConfig(use_graphs=False,
                                                                  sampler=SamplerConfig(max_logprobs=288)))
    [out] = wide.generate("Hi", SamplingParams(logprobs=-1, prompt_logprobs=-1, max_tokens=2, seed=1))
    for position in [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]:
        assert sorted(position) == list(range(288))
        assert sum(torch.tensor([p.logprob for p in position.values()], dtype=torch.float64).exp()) == \
            pytest.approx(1.0, abs=1e-5)


# -- item 5: say what is true ----------------------------------------------------------


def test_an_empty_completion_of_raw_text_to_a_chat_model_says_to_use_chat(llm):
    from engine.llm import EmptyCompletionWarning

    at_once = SamplingParams(logit_bias={257: 100.0}, temperature=0)  # <|im_end|> first: nothing said
    with pytest.warns(EmptyCompletionWarning, match=r"prompts\[0\]='Hello': an empty completion of raw text; .*"
                                                    r"use llm.chat"):
        [out] = llm.generate("Hello", at_once)
    assert out.outputs[0].text == "" and out.outputs[0].finish_reason == "stop"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm.chat([{"role": "user", "content": "Hello"}], at_once)  # a chat: nothing to say about it
        llm.generate([72, 105], at_once)  # token ids: the caller chose them
        llm.generate("Hello", SamplingParams(max_tokens=3, seed=1, temperature=1.0))  # text came back


class FakeNvtx:
    """Records what `nvtx.annotate` is given."""

    def __init__(self) -> None:
        self.ranges: list[tuple[str, str, object]] = []

    def annotate(self, message: str, domain: str, payload: object = None):
        import contextlib

        self.ranges.append((message, domain, payload))
        return contextlib.nullcontext()


def test_each_step_is_a_parent_range_with_its_step_requests_rows_and_bucket(llm, monkeypatch):
    from engine import trace

    fake = FakeNvtx()
    monkeypatch.setattr(trace, "_nvtx", fake)
    with trace.record_stages() as recorder:
        llm.generate(["Hello", "Hi"], SamplingParams(max_tokens=2, seed=1, temperature=1.0))
    steps = [e for e in recorder.events if e["name"] == "step"]
    # Both prompts prefill in step 0 (5 + 2 rows), then both decode one token (2 rows).
    assert [e["args"]["requests"] for e in steps] == [2, 2] and [e["args"]["rows"] for e in steps] == [7, 2]
    assert [e["args"]["bucket"] for e in steps] == [2, 2]
    assert steps[1]["args"]["step"] == steps[0]["args"]["step"] + 1
    for stage in ("model forward", "ledger"):
        inside = [e for e in recorder.events if e["name"] == stage]
        assert len(inside) == 2
        for event, step in zip(inside, steps):
            assert step["ts"] <= event["ts"] and event["ts"] + event["dur"] <= step["ts"] + step["dur"]
    named = [r for r in fake.ranges if r[0].startswith("step:")]
    first = steps[0]["args"]["step"]
    assert named[0] == (f"step: step {first}, requests 2, rows 7, bucket 2", "step-engine", first)


def test_the_readme_opens_with_its_title_and_says_what_has_run_where():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    lines = readme.splitlines()
    assert lines[0].startswith("# ") and not readme.startswith("    ")
    commands = [line.strip() for line in lines[1:8] if line.strip()]
    assert commands[0].startswith("make demo") and commands[1].startswith("make test")
    where = readme.split("## What has run where", 1)[1].split("\n## ", 1)[0]
    for fact in ("CPU", "Triton's interpreter", "sm_90", "never yet run on a GPU", "profiling/gpu_check.sh"):
        assert fact in where, fact
