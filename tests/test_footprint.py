"""How much project code a steady decode step walks (issue 34's measure, repeated here).

`LLM("tiny")` decodes 8 sampled requests (T = 0.8, top-p 0.9, ignore_eos) at one thread; a step's
calls are those of a 12-token generate less those of a 2-token one, over the 10 steps between,
counted with `sys.setprofile` in the project's files outside the model (engine/models/, engine/ops.py).
The bounds are where the step stands now: a change that makes every step walk more code fails here.
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

from engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
SKIP = ("engine/models/", "engine/ops.py")
MAX_CALLS, MAX_FILES = 150, 15


def _calls(llm: LLM, prompts: list[str], tokens: int) -> collections.Counter[str]:
    files: collections.Counter[str] = collections.Counter()
    root = str(ROOT) + "/"

    def profile(frame, event, arg) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root) and "/.venv" not in name:
                rel = name[len(root):]
                if rel.startswith("engine/") or rel.startswith("graphs/"):
                    if not rel.startswith(SKIP):
                        files[rel] += 1

    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=tokens, ignore_eos=True, seed=1)
    sys.setprofile(profile)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        sys.setprofile(None)
    return files


def test_a_steady_decode_step_walks_few_calls_in_few_files():
    torch.set_num_threads(1)
    llm = LLM("tiny")
    prompts = [f"hello {i}" for i in range(8)]
    llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)  # warm: graphs, caches
    short, long = _calls(llm, prompts, 2), _calls(llm, prompts, 12)
    per_step = {f: (long[f] - short.get(f, 0)) / 10 for f in long if long[f] > short.get(f, 0)}
    calls, files = sum(per_step.values()), len(per_step)
    busiest = sorted(per_step.items(), key=lambda kv: -kv[1])[:5]
    assert calls <= MAX_CALLS and files <= MAX_FILES, (calls, files, busiest)
