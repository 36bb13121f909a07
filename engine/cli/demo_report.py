"""What `python -m engine demo` reports: the run's figures as numbers (`--json`), the
summary a user reads (requests, tokens, tokens/s, time to first token, start-up apart
from the run, steps replayed vs eager, draft acceptance), the engine's internals
behind `--verbose`, and one completion as the terminal or JSON shows it."""
from __future__ import annotations

import math
import statistics
import textwrap
from dataclasses import dataclass, field
from typing import Hashable

from engine.cli.telemetry import TelemetrySummary
from engine.loop.decode_loop import DecodeLoop
from engine.loop.requests import Completion


@dataclass
class RunTimes:
    """When things happened in one run, for the figures the loop does not keep."""

    seconds: float = 0.0  # the run, from the first step to the last (start-up not included)
    capture_seconds: float = 0.0
    graphs_captured: int = 0
    # Per request: seconds from its arrival (the start of its arrival step) to its first token.
    first_token: dict[Hashable, float] = field(default_factory=dict)


@dataclass
class RunResult:
    completions: dict[Hashable, Completion]
    loop: DecodeLoop
    times: RunTimes


def summary(result: RunResult, num_chat: int, num_controls: int, load_seconds: float,
            telemetry: TelemetrySummary) -> dict[str, object]:
    """The run's figures as numbers under snake_case keys (what `--json` prints)."""
    loop, engine, times = result.loop, result.loop.engine, result.times
    stats, estats = loop.stats, engine.stats
    ttft = sorted(times.first_token.values())
    return {
        "requests": num_chat + num_controls,
        "chat_requests": num_chat,
        "control_requests": num_controls,
        "tokens_generated": stats.tokens_generated,
        "prompt_tokens_computed": stats.prefill_tokens,
        "prompt_tokens_shared": stats.shared_prefix_tokens,
        "wall_seconds": times.seconds,
        "tokens_per_second": stats.tokens_generated / times.seconds if times.seconds else None,
        "ttft_median_seconds": statistics.median(ttft) if ttft else None,
        "ttft_max_seconds": ttft[-1] if ttft else None,
        "load_seconds": load_seconds,
        "capture_seconds": times.capture_seconds,
        "graphs_captured": times.graphs_captured,
        "batch_invariant": engine.config.batch_invariant,
        "batch_invariant_verified": bool(getattr(loop.model, "batch_invariant_verified", False))
        and engine.batch_invariant_verified,
        # The loop's clock counts idle steps too (waiting for arrivals); the engine ran the others.
        "steps": stats.steps,
        "engine_steps": estats.steps,
        "idle_steps": stats.steps - estats.steps,
        "replays": estats.replays,
        "eager_steps": estats.eager_steps,
        "eager_fallbacks": estats.eager_fallbacks,
        "bucket_histogram": {str(b): n for b, n in sorted(estats.bucket_histogram.items())},
        "greedy_steps": estats.greedy_steps,
        "plain_steps": estats.plain_steps,
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


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def summary_rows(f: dict, drafts_on: bool, device: str) -> list[tuple[str, str]]:
    """`summary(...)` in a user's words: the table the terminal shows."""
    controls = f"; {f['control_requests']} more show the sampling controls" if f["control_requests"] else ""
    if not drafts_on:
        drafts = "off (--drafts 0)"
    elif not f["drafts_proposed"]:
        drafts = "none proposed (no n-gram of the output matched)"
    else:
        drafts = f"{f['drafts_accepted']} of {f['drafts_proposed']} accepted ({f['draft_acceptance']:.0%})"
    # On CPU there are no graphs: "capture" runs each bucket's step once under the
    # capture-safety check, and a "replay" runs that step again over the same buffers.
    on_cuda = device.startswith("cuda")
    graph = "CUDA-graph replays" if on_cuda else "runs of a bucket's checked step (CPU: no graphs)"
    capture = (f"graph capture {f['capture_seconds']:.1f} s ({f['graphs_captured']} graphs)" if on_cuda else
               f"bucket check {f['capture_seconds']:.1f} s ({f['graphs_captured']} bucket steps run once)")
    eager = f["eager_steps"] + f["eager_fallbacks"]
    idle = f"; the loop also idled {f['idle_steps']} step(s) waiting for arrivals" if f["idle_steps"] else ""
    if f["batch_invariant"]:
        mode = ("batch-invariant: a request's tokens do not depend on what runs beside it"
                + ("" if f["batch_invariant_verified"] else " (NOT verified on this machine: see the warning)"))
    else:
        mode = "fast (--fast): a request's tokens may depend on what runs beside it"
    return [
        ("requests", f"{f['requests']}: {f['chat_requests']} chat (--requests){controls}"),
        ("tokens generated", str(f["tokens_generated"])),
        ("prompt tokens", f"{f['prompt_tokens_computed']} computed, {f['prompt_tokens_shared']} copied from "
                          "a shared prefix"),
        ("throughput", f"{_rate(f['tokens_per_second'])} tokens/s ({f['tokens_generated']} tokens in "
                       f"{f['wall_seconds']:.2f} s, start-up not counted)"),
        ("time to first token", f"median {_seconds(f['ttft_median_seconds'])}, slowest "
                                f"{_seconds(f['ttft_max_seconds'])} (from each request's arrival)"),
        ("start-up", f"model load {f['load_seconds']:.1f} s, {capture}"),
        ("steps", f"{f['engine_steps']} = {f['replays']} {graph} + {eager} eager{idle}"),
        ("speculative drafts (n-gram)", drafts),
        ("determinism", mode),
    ]


def verbose_rows(f: dict) -> list[tuple[str, str]]:
    """The engine's internals (`--verbose`)."""
    hist = ", ".join(f"{b}:{n}" for b, n in f["bucket_histogram"].items()) or "-"
    return [
        ("bucket histogram (bucket:steps)", hist),
        ("eager steps: graphs off / above the largest bucket", f"{f['eager_steps']} / {f['eager_fallbacks']}"),
        ("CPU steps by the argmax alone / without filters", f"{f['greedy_steps']} / {f['plain_steps']}"),
        ("host µs per step (ledger + staging)", f"{f['host_us_per_step']:.0f}"),
        ("time: model forward / step engine / scheduling",
         f"{f['forward_seconds']:.2f} s / {f['engine_seconds']:.2f} s / {f['schedule_seconds']:.2f} s"),
        ("sampling-control state", f["control_state"] or "not allocated"),
    ]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(rows: list[tuple[str, str]], width: int = 100) -> str:
    """Label and value per line; a long value wraps under itself, within `width` columns."""
    label = max(len(k) for k, _ in rows)
    indent = " " * (label + 4)
    return "\n".join(textwrap.fill(v, width, initial_indent=f"  {k.ljust(label)}  ", subsequent_indent=indent)
                     for k, v in rows)


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
