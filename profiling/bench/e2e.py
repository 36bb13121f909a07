"""End to end on CPU: our decode loop + decoder vs Hugging Face `generate`.

SmolLM2-135M-Instruct from the same GGUF file on both sides, the demo's 16
chat prompts, greedy, `--max-tokens` new tokens each. Three runs:
- ours: `DecodeLoop` (all prompts submitted at once, graphs on, no drafts);
- HF one prompt at a time;
- HF batched with left padding.
Every completion must be token-identical across the three (a completion ends
at the first stop token, inclusive). Prints tokens/s and ratios.

Needs the `hf` extra (`.venv/bin/pip install -e '.[hf]'`).

    python -m profiling.bench [--threads N] e2e [--quick] [--max-tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from engine.decode_loop import DecodeLoop, LoopConfig
from engine.demo import CHAT_PROMPTS
from engine.models.gguf_loader import load_smollm2, smollm2_gguf_path
from engine.params import SamplingParams
from engine.step_engine import EngineConfig
from profiling.bench._timing import print_table


def _until_stop(tokens: list[int], stops: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def run_ours(model, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, DecodeLoop]:
    loop = DecodeLoop(model.with_options(), LoopConfig(max_num_reqs=len(prompts), token_budget=512),
                      engine_config=EngineConfig(device="cpu"))  # a fresh KV cache on the same weights
    for i, prompt in enumerate(prompts):
        loop.submit(i, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    start = time.perf_counter()
    done = loop.run()
    return [done[i].tokens for i in range(len(prompts))], time.perf_counter() - start, loop


def load_hf():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def run_hf(model, prompts: list[list[int]], max_tokens: int, *, batched: bool) -> tuple[list[list[int]], float]:
    stops = model.generation_config.eos_token_id
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    kwargs = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    groups = [prompts] if batched else [[p] for p in prompts]
    outputs: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for group in groups:
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            generated = model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, width:]
            outputs.extend(generated.tolist())
    seconds = time.perf_counter() - start
    stop_set = set(stops if isinstance(stops, list) else [stops])
    return [_until_stop(o, stop_set) for o in outputs], seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of ours and HF batched")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("transformers") is None:
        print("e2e: transformers is not installed; install the hf extra: .venv/bin/pip install -e '.[hf]'")
        return 0
    count, max_tokens = (4, 16) if args.quick else (16, args.max_tokens)
    ours_model, tokenizer = load_smollm2(num_slots=count, max_context=1024)
    prompts = [tokenizer.chat_prompt([{"role": "user", "content": text}]) for text in CHAT_PROMPTS[:count]]
    hf_model = load_hf()

    # This VM's speed drifts by up to 2x over minutes: the two batched runs alternate and
    # each reports its median over the repeats.
    t_ours, t_batched = [], []
    for _ in range(args.repeats):
        ours, seconds, loop = run_ours(ours_model, prompts, max_tokens)
        t_ours.append(seconds)
        hf_batched, seconds = run_hf(hf_model, prompts, max_tokens, batched=True)
        t_batched.append(seconds)
    hf_single, t_single = run_hf(hf_model, prompts, max_tokens, batched=False)
    t_ours, t_batched = statistics.median(t_ours), statistics.median(t_batched)
    total = sum(len(t) for t in ours)
    rows = [
        ["ours (DecodeLoop, graphs)", total, f"{t_ours:.2f}", f"{total / t_ours:.1f}", "1.00x"],
        ["HF generate, one at a time", sum(map(len, hf_single)), f"{t_single:.2f}",
         f"{sum(map(len, hf_single)) / t_single:.1f}", f"{t_single / t_ours:.2f}x"],
        ["HF generate, batched", sum(map(len, hf_batched)), f"{t_batched:.2f}",
         f"{sum(map(len, hf_batched)) / t_batched:.1f}", f"{t_batched / t_ours:.2f}x"],
    ]
    print(f"SmolLM2-135M-Instruct, {count} prompts, greedy, {max_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} alternating runs (HF one at a time: 1 run)")
    print_table(["run", "tokens", "seconds", "tokens/s", "ours faster by"], rows)
    stats = loop.stats
    print(f"ours, last run: {stats.steps} steps; model forward {stats.forward_seconds:.2f} s, step engine "
          f"{stats.engine_seconds:.2f} s, scheduling {stats.schedule_seconds:.2f} s; prompt tokens computed "
          f"{stats.prefill_tokens}, copied from a shared prefix {stats.shared_prefix_tokens}; "
          f"{loop.engine.stats.small_candidate_steps} steps sampled from few candidates")
    same_single = sum(a == b for a, b in zip(ours, hf_single))
    same_batched = sum(a == b for a, b in zip(ours, hf_batched))
    print(f"identical greedy completions: {same_single}/{count} vs HF one at a time, "
          f"{same_batched}/{count} vs HF batched")
    return 0 if same_single == count else 1
