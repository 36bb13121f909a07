"""`engine.LLM` as a user meets it, in both determinism modes, measured in one run:

- start-up: construction (model load, kernel probes, graph capture);
- a first and a second `generate(["Hello", "Name three colors."],
  SamplingParams(temperature=0.8, top_p=0.9))` (fresh seeds, the default 16 tokens
  at most), and second / (construction + first): what a later call pays of what
  the first one cost with the set-up (target <= 0.2);
- throughput: `--prompts` chat prompts of the demo, greedy, `--max-tokens` each,
  generated tokens per second of the whole call (start-up not counted).

Modes: batch-invariant (the default: a request's tokens do not depend on its
batch neighbours) and fast (`batch_invariant=False`). The throughput runs
alternate between the two modes' LLMs, `--repeats` each, and the medians are
reported; fast/invariant is the ratio of their tokens/s.

    python -m profiling.bench llm [--model smollm2|tiny] [--prompts N] [--max-tokens N] [--repeats N] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.cli.demo_prompts import CHAT_PROMPTS
from engine.host.params import SamplingParams
from engine.llm import LLM
from profiling.bench._timing import print_table, ratio
from profiling.bench.ledger import cpu_model

MODES = {"batch-invariant": True, "fast": False}
SCRIPT_PROMPTS = ["Hello", "Name three colors."]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench llm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="the tiny model, 2 prompts of 8 tokens, 1 repeat, batches of 2")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.prompts, args.max_tokens, args.repeats = "tiny", 2, 8, 1
    script = SamplingParams(temperature=0.8, top_p=0.9)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    chats = [[{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}] for i in range(args.prompts)]
    rows, llms = {}, {}
    for mode, invariant in MODES.items():
        start = time.perf_counter()
        llm = LLM(args.model, batch_invariant=invariant, max_num_reqs=2 if args.quick else None)
        built = time.perf_counter()
        llm.generate(SCRIPT_PROMPTS, script)
        first = time.perf_counter()
        llm.generate(SCRIPT_PROMPTS, script)
        second = time.perf_counter()
        llms[mode] = llm
        rows[mode] = dict(mode=mode, construction_s=built - start, capture_s=llm.startup.capture,
                          first_call_s=first - built, second_call_s=second - first,
                          second_share=(second - first) / (first - start), tokens_per_s=[])
    for _ in range(args.repeats):
        for mode, llm in llms.items():
            t0 = time.perf_counter()
            outputs = llm.chat(chats, greedy)
            seconds = time.perf_counter() - t0
            rows[mode]["tokens_per_s"].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
    for row in rows.values():
        row["tokens_per_s"] = statistics.median(row["tokens_per_s"])
    fast, invariant = rows["fast"]["tokens_per_s"], rows["batch-invariant"]["tokens_per_s"]
    if args.json:
        print(json.dumps(dict(cpu=cpu_model(), threads=torch.get_num_threads(), model=args.model,
                              prompts=args.prompts, max_tokens=args.max_tokens, rows=list(rows.values())), indent=1))
        return 0
    print(f"LLM({args.model!r}): start-up, two calls, throughput ({args.prompts} greedy chats x "
          f"{args.max_tokens} tokens, median of {args.repeats}); {cpu_model()}, {torch.get_num_threads()} threads")
    print_table(["mode", "construction s", "capture s", "first call s", "second call s", "second share",
                 "tokens/s", "vs invariant"],
                [[r["mode"], r["construction_s"], r["capture_s"], r["first_call_s"], r["second_call_s"],
                  f"{r['second_share']:.3f}", r["tokens_per_s"], ratio(r["tokens_per_s"], invariant)]
                 for r in rows.values()])
    print(f"\nfast / batch-invariant tokens/s: {fast / invariant:.2f}x; second share target <= 0.2")
    return 0
