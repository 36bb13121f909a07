"""The Triton kernel head against the torch head on one device: tokens identical, replay times side by side.

    python -m profiling.kernel_head_check                       # CUDA: H=7168, V=129280, bf16, 64 requests
    python -m profiling.kernel_head_check --device cpu --hidden 64 --vocab 300 --reqs 4   # interpreter, seconds

Two StepEngines over one weight, `EngineConfig(kernels="torch")` and `kernels="triton"`,
captured, fed the same steps (mixed sampling parameters, controls, 3 strict drafts from the
second step on). Exits 1 naming the step where a token, an error or an accepted count
differs. Prints each engine's median step time (alternating sides, 5 runs).
profiling/gpu_check.sh runs it when a GPU is lent.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine import EngineConfig, StepEngine
from engine.host.params import SamplingParams
from profiling.dry_run_requests import controlled_params, mixed_params, scenario_requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--reqs", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # the interpreter has no bf16
    gen = torch.Generator(device=args.device).manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen, device=args.device) * 0.02).to(dtype)
    config = dict(device=args.device, max_num_reqs=args.reqs, max_draft_tokens=3, max_control_slots=args.reqs,
                  max_logit_bias=8, max_allowed_token_ids=64, eos_token_id=2, max_source_rows=args.reqs * 8)
    engines = {kind: StepEngine(weight, EngineConfig(kernels=kind, **config)) for kind in ("torch", "triton")}
    for engine in engines.values():
        engine.capture()
    n, k = args.reqs, 3
    hidden = (torch.randn(n * 8, args.hidden, generator=gen, device=args.device)).to(dtype)
    renamed = lambda seqs, tag: [s.__class__(**{**vars(s), "request_id": f"{tag}{s.request_id}"}) for s in seqs]  # noqa: E731
    steps = [
        lambda: (scenario_requests(n, params=mixed_params), None),
        lambda: (scenario_requests(n, decode=True, drafts=k, params=mixed_params), [list(range(10 + i, 10 + i + k)) for i in range(n)]),
        lambda: (renamed(scenario_requests(n, params=controlled_params), "c"), None),
        lambda: (renamed(scenario_requests(n, params=lambda i: SamplingParams(temperature=0.0, logprobs=2)), "g"), None),
    ]
    times: dict[str, list[float]] = {kind: [] for kind in engines}
    for run in range(args.runs):
        outs = {}
        for kind in (("torch", "triton") if run % 2 == 0 else ("triton", "torch")):
            start = time.perf_counter()
            outs[kind] = []
            seen = set()
            for make in steps:
                seqs, drafts = make()
                if run:  # fresh request ids each run: the controls join before any generated token
                    seqs = renamed(seqs, f"r{run}-")
                outs[kind].append(engines[kind].step(hidden, seqs, drafts))
                seen.update(s.request_id for s in seqs)
            for request_id in seen:  # the run's requests end: their control slots are free for the next
                engines[kind].finish(request_id)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times[kind].append((time.perf_counter() - start) / len(steps))
        for i, (a, b) in enumerate(zip(outs["torch"], outs["triton"])):
            if (a.tokens, a.errors, a.num_accepted) != (b.tokens, b.errors, b.num_accepted):
                print(f"FAILED: run {run} step {i}: the kernel head differs from the torch head", file=sys.stderr)
                return 1
    print(f"tokens identical over {args.runs} x {len(steps)} steps; median ms per step (host included): "
          + ", ".join(f"{kind} {statistics.median(t) * 1e3:.2f}" for kind, t in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
