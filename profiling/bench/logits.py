"""LM-head logits: plain GEMM vs batch-invariant fixed row blocks.

`python -m profiling.bench [--threads N] logits [--quick] [--hidden 576] [--vocab 32000]
[--block-rows N] [--dtype float32]`. For each dtype and row count it prints the
median time of the plain GEMM, of the batch-invariant blocks the engine's LM
head uses (the block GEMM its invariance probe picks here, named in the
table), and their ratio (batch-invariant / plain, measured in the same run,
the two sides alternating).
"""
from __future__ import annotations

import argparse

import torch

from engine.invariance import choose_block_gemm, lm_head_candidates
from engine.ops import default_block_rows, get_logits
from profiling.bench._timing import median_us, print_table, ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench logits", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke test)")
    parser.add_argument("--hidden", type=int, default=576, help="hidden size H (576: SmolLM2-135M, 1024 also typical)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--block-rows", type=int, default=None, help="default: engine.ops.default_block_rows(device)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), nargs="*", default=None, help="default: both")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    args.block_rows = args.block_rows or default_block_rows(device)
    if args.quick:
        hidden_size, vocab, row_counts, repeats = 64, 2048, (1, 16, 64), args.repeats or 3
    else:
        hidden_size, vocab, row_counts, repeats = args.hidden, args.vocab, (1, 16, 64, 256), args.repeats or 15
    print(
        f"get_logits on {device.type}, H={hidden_size}, V={vocab}, block_rows={args.block_rows}, "
        f"threads={torch.get_num_threads()}, median of {repeats}"
    )
    gen = torch.Generator().manual_seed(0)
    table = []
    for dtype in [getattr(torch, name) for name in args.dtype or ("bfloat16", "float32")]:
        weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(dtype).to(device)
        kernel, verified = choose_block_gemm(lm_head_candidates(weight, args.block_rows))
        for rows in row_counts:
            hidden = torch.randn(rows, hidden_size, generator=gen).to(device)
            out = torch.empty(rows, vocab, device=device)
            plain, invariant = [], []
            for i in range(repeats):  # alternate the sides: the machine drifts
                sides = ((plain, False), (invariant, True))
                for sink, on in sides if i % 2 == 0 else sides[::-1]:
                    sink.append(median_us(
                        lambda: get_logits(hidden, weight, out=out, batch_invariant=on, block_rows=args.block_rows,
                                           kernel=kernel if on else None),
                        repeats=1, warmup=1 if i == 0 else 0, sync=sync))
            plain_us, invariant_us = sorted(plain)[repeats // 2], sorted(invariant)[repeats // 2]
            name = f"{kernel.kernel}[{kernel.block_rows}]" + ("" if verified else " (not invariant)")
            table.append([str(dtype).removeprefix("torch."), rows, name, plain_us, invariant_us, ratio(invariant_us, plain_us)])
    print_table(["dtype", "rows", "invariant kernel", "plain us", "invariant us", "invariant/plain"], table)
    return 0
