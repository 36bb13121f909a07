"""Token constraints on the host (engine/host/token_constraints.py, wired into
PersistentBatch): grammar masks against a fresh xgrammar GrammarMatcher the
test builds itself, bad words against a plain loop, draft awareness (row j ==
the mask after drafts 0..j-1), rollback, and the errors at submission."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine
from engine.host.token_constraints import TokenConstraints
from engine.models.tokenizer import ByteChatMLTokenizer
from engine.step.batch import PersistentBatch

BYTE_VOCAB, BYTE_EOS = 264, 257  # the byte tokenizer's 258 ids, padded like a model's vocabulary
WORDS = -(-BYTE_VOCAB // 32)


def reference_matcher(kind: str, text: str) -> xgr.GrammarMatcher:
    """A matcher built here, not through the module: bytes 0-255, the rest special."""
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [""] * (BYTE_VOCAB - 256), xgr.VocabType.RAW,
                             vocab_size=BYTE_VOCAB, stop_token_ids=[BYTE_EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compiled = {"regex": compiler.compile_regex, "json_schema": compiler.compile_json_schema,
                "grammar": compiler.compile_grammar}[kind](text)
    return xgr.GrammarMatcher(compiled)


def reference_mask(matcher: xgr.GrammarMatcher) -> np.ndarray:
    out = torch.full((1, WORDS), -1, dtype=torch.int32)
    matcher.fill_next_token_bitmask(out)
    return out.numpy()[0]


def allowed_ids(words: np.ndarray) -> list[int]:
    return [t for t in range(BYTE_VOCAB) if (int(words[t // 32]) >> (t % 32)) & 1]


# Random regexes over a few letters: literals, classes, alternation, repetition.
letters = st.sampled_from(["a", "b", "c", "[ab]", "[a-c]", "x"])
regexes = st.recursive(
    letters,
    lambda inner: st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, inner).map(lambda p: f"({p[0]}|{p[1]})"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{1,3}"])).map(lambda p: f"({p[0]}){p[1]}"),
    ),
    max_leaves=6,
)
SPECS = [
    ("json_schema", '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'),
    ("json_schema", '{"enum": ["red", "green", "blue"]}'),
    ("grammar", 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9]+ | "x"'),
]


def walk(rng: np.random.Generator, matcher: xgr.GrammarMatcher, steps: int) -> list[int]:
    """A random path through the grammar: each token drawn from the matcher's allowed ones."""
    tokens = []
    for _ in range(steps):
        if matcher.is_terminated():
            break
        choices = allowed_ids(reference_mask(matcher))
        token = int(rng.choice(choices))
        assert matcher.accept_token(token)
        tokens.append(token)
    return tokens


def constraints() -> TokenConstraints:
    return TokenConstraints(BYTE_VOCAB, ByteChatMLTokenizer(), BYTE_EOS)


def check_spec(kind: str, text: str, seed: int) -> None:
    """After a random walk of emitted tokens, each row's mask with random valid drafts
    equals a fresh matcher's mask after the same tokens."""
    rng = np.random.default_rng(seed)
    path_matcher = reference_matcher(kind, text)
    path = walk(rng, path_matcher, int(rng.integers(0, 8)) + 4)
    cut = int(rng.integers(0, len(path) + 1))
    emitted, drafts = path[:cut], path[cut : cut + 3]
    if rng.random() < 0.3 and drafts:
        drafts[-1] = ord("Z")  # a draft the grammar rejects: later rows are never emitted
    constraint = constraints().make("r", SamplingParams(**{kind: text}))
    constraint.advance(emitted)
    rows = np.full((1 + len(drafts), WORDS), -1, dtype=np.int32)
    constraint.fill(rows, drafts)
    for j in range(len(rows)):
        fresh = reference_matcher(kind, text)
        ok = all(fresh.accept_token(t) for t in emitted + drafts[:j])
        if not ok:
            break  # past a rejected draft any mask will do
        if fresh.is_terminated():
            assert allowed_ids(rows[j]) == [BYTE_EOS]
        else:
            np.testing.assert_array_equal(rows[j], reference_mask(fresh), err_msg=f"row {j} after {emitted + drafts[:j]}")
    # `fill` leaves the matcher where it was: the same call gives the same rows.
    again = np.full_like(rows, -1)
    constraint.fill(again, drafts)
    np.testing.assert_array_equal(again, rows)


@settings(max_examples=30, deadline=None)
@given(regexes, st.integers(0, 2**32 - 1))
def test_regex_masks_equal_a_fresh_matcher_after_the_same_tokens_and_drafts(regex, seed):
    check_spec("regex", regex, seed)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(SPECS), st.integers(0, 2**32 - 1))
def test_schema_and_grammar_masks_equal_a_fresh_matcher(spec, seed):
    check_spec(*spec, seed)


def test_rollback_restores_the_mask():
    c = constraints().make("r", SamplingParams(regex="a(bc)+d"))
    before = np.full((1, WORDS), -1, dtype=np.int32)
    c.fill(before, ())
    c.advance([ord("a"), ord("b")])
    mid = np.full((1, WORDS), -1, dtype=np.int32)
    c.fill(mid, ())
    c.advance([ord("c")])
    c.rollback_to(2)
    again = np.full((1, WORDS), -1, dtype=np.int32)
    c.fill(again, ())
    np.testing.assert_array_equal(again, mid)
    c.rollback_to(0)
    c.fill(again, ())
    np.testing.assert_array_equal(again, before)
    assert allowed_ids(before[0]) == [ord("a")]


# -- bad words against a plain loop ---------------------------------------------------------


def banned_by_loop(context: list[int], bad_words: list[tuple[int, ...]]) -> set[int]:
    banned = set()
    for word in bad_words:
        prefix = list(word[:-1])
        if len(prefix) == 0 or (len(context) >= len(prefix) and context[len(context) - len(prefix):] == prefix):
            banned.add(word[-1])
    return banned


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_bad_words_ban_exactly_what_a_plain_loop_bans(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 80))
    small = int(rng.integers(2, min(vocab, 6) + 1))  # a small alphabet makes matches likely
    words = [tuple(int(t) for t in rng.integers(0, small, int(rng.integers(1, 4)))) for _ in range(int(rng.integers(1, 5)))]
    output = [int(t) for t in rng.integers(0, small, int(rng.integers(0, 6)))]
    drafts = [int(t) for t in rng.integers(0, small, int(rng.integers(0, 4)))]
    c = TokenConstraints(vocab).make("r", SamplingParams(bad_words=tuple(words)))
    c.advance(output)
    rows = np.full((1 + len(drafts), -(-vocab // 32)), -1, dtype=np.int32)
    c.fill(rows, drafts)
    for j in range(len(rows)):
        context = output + drafts[:j]  # never the prompt (vLLM matches a word on the output only)
        got = {t for t in range(vocab) if not (int(rows[j, t // 32]) >> (t % 32)) & 1}
        assert got == banned_by_loop(context, words), (context, words, j)


# -- wiring and errors ----------------------------------------------------------------------

V, H = 64, 8


def small_engine(**config) -> StepEngine:
    base = dict(max_num_reqs=4, device="cpu", use_graphs=False, eos_token_id=1, max_draft_tokens=2)
    base.update(config)
    return StepEngine(torch.randn(V, H, generator=torch.Generator().manual_seed(0)), EngineConfig(**base))


def test_errors_at_submission_name_the_request_and_the_field_and_change_nothing():
    batch = PersistentBatch(small_engine())
    with pytest.raises(ValueError, match=r"request 'a': params.json_schema: .*needs a tokenizer: PersistentBatch\(\.\.\., tokenizer=\)"):
        batch.add("a", [3], SamplingParams(json_schema={"type": "string"}))
    with pytest.raises(ValueError, match=r"request 'b': params.bad_words\[1\]=\(2, 64\): token 64 is outside the vocabulary"):
        batch.add("b", [3], SamplingParams(bad_words=((5,), (2, 64))))
    assert len(batch) == 0 and not batch._constrained.any()
    decoding_only = PersistentBatch(small_engine(), tokenizer=object())  # no grammar_vocabulary
    with pytest.raises(ValueError, match=r"request 'a': params.regex: .*needs a tokenizer with grammar_vocabulary\(\) "
                                         r"\(GrammarTokenizer\), got a object"):
        decoding_only.add("a", [3], SamplingParams(regex="ab"))
    assert len(decoding_only) == 0
    bytes_batch = PersistentBatch(small_engine(), tokenizer=ByteChatMLTokenizer())
    for kind, text, says in (("regex", "a(", "parenthesis"), ("json_schema", '{"type": "nope"}', "nope"),
                             ("grammar", "root ::= foo", "foo")):
        with pytest.raises(ValueError, match=rf"request 'c': params.{kind}=.*xgrammar cannot compile it: .*{says}"):
            bytes_batch.add("c", [3], SamplingParams(**{kind: text}))
    assert len(bytes_batch) == 0
    row = bytes_batch.add("c", [3], SamplingParams(regex="ab"))
    with pytest.raises(ValueError, match=r"request 'c': params.regex: .*fixed"):
        bytes_batch.update("c", SamplingParams(regex="abc"))
    bytes_batch.remove("c")
    assert row not in bytes_batch.constraints.of
    e = small_engine()
    with pytest.raises(ValueError, match=r"request 'z': params.bad_words: StepEngine.step\(hidden, seqs\) applies no"):
        e.step(torch.zeros(1, H), [SeqMeta("z", True, 1, 1, 1, params=SamplingParams(bad_words=((3,),)))])


def test_drafts_from_the_pool_are_refused_for_a_constrained_request():
    e = small_engine()  # a draft-info pool: drafts not given come from it
    batch = PersistentBatch(e)
    batch.add("a", [3, 4], SamplingParams(bad_words=((5,),)))
    out = e.run(torch.zeros(2, H), *(lambda p: (p.inputs, p.arrays))(step := batch.prepare(["a"], [2], [2])))
    batch.record(step, out)
    with pytest.raises(ValueError, match=r"request 'a': token constraints need the drafts on the host"):
        batch.prepare(["a"], [3], [5])
    assert batch.prepare(["a"], [3], [5], draft_tokens=[[7, 8]]).arrays.token_bitmask.shape == (3, 2)


def test_set_generated_puts_the_matcher_back_as_a_rolled_back_step_needs():
    weight = torch.randn(BYTE_VOCAB, H, generator=torch.Generator().manual_seed(1))
    e = StepEngine(weight, EngineConfig(max_num_reqs=2, device="cpu", use_graphs=False, eos_token_id=BYTE_EOS))
    batch = PersistentBatch(e, tokenizer=ByteChatMLTokenizer())
    row = batch.add("a", [65], SamplingParams(regex="(ab)+c", temperature=0.0))

    def step(q, k):
        prepared = batch.prepare(["a"], [q], [k])
        out = e.run(torch.randn(q, H), prepared.inputs, prepared.arrays)
        batch.record(prepared, out)
        return out.tokens[0]

    assert step(1, 1) == [ord("a")]
    before = batch.prepare(["a"], [1], [2]).arrays.token_bitmask.copy()
    assert allowed_ids(before[0]) == [ord("b")]
    assert step(1, 2) == [ord("b")]
    batch.set_generated(np.array([row]), np.array([1], dtype=np.int32))  # the loop's rollback of that step
    np.testing.assert_array_equal(batch.prepare(["a"], [1], [2]).arrays.token_bitmask, before)


def test_a_failed_loop_step_rolls_the_constraints_back():
    """DecodeLoop's atomic step with a bad-words request: a step that raises after
    its tokens were recorded is undone and redone; the completions equal a clean run."""
    from engine.loop.loop_config import LoopConfig
    from engine.loop.decode_loop import DecodeLoop
    from engine.models.llama import LlamaModel
    from engine.models.llama_weights import LlamaConfig

    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                            bad_words=tuple((t,) for t in range(0, 256, 2)) + ((5, 7), (9, 11, 13)))

    def run(fail_at: set[int]) -> list[int]:
        model = LlamaModel.random(LlamaConfig.tiny(), seed=0, num_slots=2, batch_invariant=True)
        loop = DecodeLoop(model, LoopConfig(seed_base=0, max_num_reqs=2, max_draft_tokens=2), engine_config=EngineConfig(use_graphs=False),
                          capture=False)
        record, calls = loop.batch.record, [0]

        def flaky_record(*args):
            record(*args)
            calls[0] += 1
            if calls[0] in fail_at:
                raise RuntimeError("after the step's tokens were recorded")

        loop.batch.record = flaky_record
        loop.submit("a", [5, 9, 11], params)
        while loop.has_work():
            try:
                loop.step()
            except RuntimeError:
                pass
            for req in loop.running:  # the constraint's context is exactly what the request emitted
                assert loop.batch.constraints.of[req.table_row].output == req.completion.tokens
        return loop.finished["a"].tokens

    clean = run(set())
    assert all(t % 2 for t in clean)
    assert run({2, 3, 6}) == clean


def small_bpe():
    """A byte-level BPE of ten tokens (two of them ChatML specials), built by the loader's own
    `bpe_tokenizer` as a GGUF vocabulary would be."""
    from engine.models.tokenizer import bpe_tokenizer

    tokens = ["<|im_start|>", "<|im_end|>", "a", "b", "c", "Ġ", "ab", "Ġb", "Ġa", "abc"]
    return bpe_tokenizer(tokens, ["a b", "Ġ b", "Ġ a", "ab c"], [3, 3] + [1] * 8)


@pytest.mark.parametrize("wrap", ["chatml", "plain", "transformers"])
def test_every_tokenizer_reads_its_byte_level_vocabulary_as_xgrammar_reads_a_transformers_one(wrap):
    """The masks of a regex through each of our tokenizers over one byte-level BPE equal the
    masks of a matcher over xgrammar's own reading of the transformers tokenizer
    (`TokenizerInfo.from_huggingface`), step by step along every path the grammar allows."""
    transformers = pytest.importorskip("transformers")
    from engine.models.tokenizer import ChatMLTokenizer, HFChatTokenizer, PlainTokenizer

    vocab, eos, regex = 16, 1, "(ab|c)( a| b)?c"
    raw = small_bpe()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>")
    tokenizer = {"chatml": lambda: ChatMLTokenizer(raw), "plain": lambda: PlainTokenizer(raw, eos),
                 "transformers": lambda: HFChatTokenizer(hf)}[wrap]()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_regex(regex)

    def mask(matcher: xgr.GrammarMatcher) -> np.ndarray:
        out = torch.full((1, 1), -1, dtype=torch.int32)
        matcher.fill_next_token_bitmask(out)
        return out.numpy()[0]

    constraints = TokenConstraints(vocab, tokenizer, eos)
    paths, seen = [[]], 0
    while paths:
        path = paths.pop()
        reference = xgr.GrammarMatcher(compiled)
        assert all(reference.accept_token(t) for t in path)
        if reference.is_terminated():
            continue
        want = mask(reference)
        constraint = constraints.make("r", SamplingParams(regex=regex))
        constraint.advance(path)
        got = np.full((1, 1), -1, dtype=np.int32)
        constraint.fill(got, ())
        ids = (1 << vocab) - 1  # the word's bits past the vocabulary are no token
        assert int(got[0, 0]) & ids == int(want[0]) & ids, f"after {path}"
        seen += 1
        paths += [path + [t] for t in range(vocab) if (int(want[0]) >> t) & 1 and t != eos]
    assert seen >= 6  # the walk reached past the first tokens


def test_a_tokenizer_that_is_not_byte_level_is_refused_for_structured_output_naming_the_request():
    from tokenizers import Tokenizer, models

    from engine.models.tokenizer import PlainTokenizer

    words = PlainTokenizer(Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]")), 1)
    batch = PersistentBatch(small_engine(), tokenizer=words)
    with pytest.raises(ValueError, match=r"request 'a': params.regex: tokenizer: its decoder is None; structured "
                                         r"output reads byte-level BPE vocabularies"):
        batch.add("a", [3], SamplingParams(regex="ab"))
    assert len(batch) == 0
    batch.add("b", [3], SamplingParams(bad_words=((2,),)))  # bad words need no vocabulary
