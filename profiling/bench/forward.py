"""Forward-pass throughput of the built-in decoder: prefill and decode, fast vs batch-invariant.

`python -m profiling.bench forward` (SmolLM2-135M, CPU fp32) or `--quick` (tiny random config).
The `vs fast` column is the cost of `batch_invariant=True` (fixed row blocks in every GEMM,
tiled attention) relative to the default mode, measured in the same run. `--dtype bf16`
runs the weights, activations and cache in bf16 (oneDNN uses AVX512-BF16 or AMX where the
CPU has them; greedy tokens then differ from fp32 references).
"""
from __future__ import annotations

import argparse
import time

import torch

from profiling.bench._timing import median_us, print_table, ratio


def _decode_step(model, slots: list[int], context: int):
    from engine.models.protocol import ForwardBatch

    batch = ForwardBatch.of(slots, [1] * len(slots), [context] * len(slots))
    tokens = torch.full((len(slots),), 42, dtype=torch.int64)
    positions = batch.positions()
    # Re-running the same step rewrites the same cache rows, so repeats are idempotent.
    return lambda: model.forward(tokens, positions, batch)


def _prefill(model, slots: list[int], prompt_len: int):
    from engine.models.protocol import ForwardBatch

    batch = ForwardBatch.of(slots, [prompt_len] * len(slots), [prompt_len] * len(slots))
    tokens = torch.randint(3, model.vocab_size, (batch.num_tokens,), generator=torch.Generator().manual_seed(0))
    positions = batch.positions()
    return lambda: model.forward(tokens, positions, batch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench forward", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny random model, few repeats (smoke test)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    from engine.models.llama import LlamaModel
    from engine.models.llama_weights import LlamaConfig

    max_batch = max(args.batches)
    if args.quick:
        base = LlamaModel.random(LlamaConfig.tiny(), seed=0, num_slots=max_batch, max_context=args.prompt_len + 64,
                                 dtype=dtype)
        label, repeats = "tiny (random)", args.repeats or 5
    else:
        from engine.models.gguf_loader import load_smollm2

        t0 = time.perf_counter()
        base, _ = load_smollm2(num_slots=max_batch, max_context=args.prompt_len + 64, dtype=dtype,
                               batch_invariant=False)
        print(f"SmolLM2-135M loaded in {time.perf_counter() - t0:.2f} s (cache: engine.models.gguf_loader.cache_dir())")
        label, repeats = "SmolLM2-135M", args.repeats or 10
    print(f"model: {label}, device cpu {args.dtype}, threads {torch.get_num_threads()}, prompt {args.prompt_len} tokens")

    rows = []
    for phase in ("prefill", "decode"):
        for batch_size in args.batches:
            fast_us = None
            for mode in ("fast", "batch-invariant"):
                model = base.with_options(batch_invariant=mode == "batch-invariant")
                slots = [model.allocate_slot() for _ in range(batch_size)]
                if phase == "decode":
                    _prefill(model, slots, args.prompt_len)()
                    fn = _decode_step(model, slots, args.prompt_len + 1)
                    tokens = batch_size
                else:
                    fn = _prefill(model, slots, args.prompt_len)
                    tokens = batch_size * args.prompt_len
                reps = max(2, repeats // 4) if phase == "prefill" and batch_size > 1 else repeats
                us = median_us(fn, repeats=reps, warmup=1)
                fast_us = us if mode == "fast" else fast_us
                rows.append([phase, batch_size, mode, tokens, us / 1e3, tokens / (us / 1e6), ratio(us, fast_us)])
    print_table(["phase", "batch", "mode", "tokens/call", "median ms", "tokens/s", "vs fast"], rows)
    return 0
