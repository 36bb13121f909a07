"""Vocab-parallel step: bytes exchanged and step time, full gather vs candidate exchange.

`python -m profiling.bench tp [--quick] [--batch 64] [--vocab 128256]
[--hidden 256] [--top-k 50] [--repeats N]`. For tp = 2 and 4 it forks that many
gloo ranks on this machine; each runs ShardedStepEngine steps of `batch`
decode requests (top-k sampling, replayed graphs) with each strategy. Prints,
per tp and strategy, the bytes every rank receives from the step's
collectives, the median step time on rank 0, and both ratios against the
full gather measured in the same run. On one CPU host the ranks share cores,
so times show the cost of the exchange, not a multi-node speed-up.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pickle
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import EngineConfig, SamplingParams, SeqMeta
from engine.parallel import ParallelConfig, ShardedStepEngine, VocabShards
from profiling.bench._timing import median_us, print_table, ratio


def _rank_main(rank: int, tp: int, port: int, out_dir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=datetime.timedelta(seconds=120))
    weight = torch.randn(args.vocab, args.hidden, generator=torch.Generator().manual_seed(0)) / args.hidden**0.5
    shard = VocabShards.split(args.vocab, tp).shard(weight, rank).contiguous()
    del weight
    seqs = [SeqMeta(i, False, 1, 20, 10, num_generated=10, params=SamplingParams(top_k=args.top_k, seed=i))
            for i in range(args.batch)]
    hidden = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(1))
    config = EngineConfig(max_num_reqs=args.batch, buckets=(args.batch,), device="cpu")
    results = {}
    for strategy in ("gather", "candidates"):
        engine = ShardedStepEngine(shard, args.vocab, config, ParallelConfig(strategy=strategy, k_cap=args.top_k))
        engine.capture()
        step = lambda: engine.step(hidden, seqs if rank == 0 else None)  # noqa: E731
        step()
        before = engine.parallel_stats.exchanged_bytes
        time_us = median_us(step, repeats=args.repeats, warmup=1)
        steps = args.repeats + 1
        results[strategy] = ((engine.parallel_stats.exchanged_bytes - before) / steps, time_us,
                             engine.parallel_stats.candidate_fallbacks)
    dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(out_dir, "result.pkl"), "wb") as f:
            pickle.dump(results, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench tp", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke test)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128256, help="128256: Llama 3's 128k vocabulary (uneven last shard)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.vocab, args.hidden = 8, 16384, 64
    args.repeats = args.repeats or (3 if args.quick else 10)

    print(f"vocab-parallel step, gloo on CPU: B={args.batch}, V={args.vocab}, H={args.hidden}, "
          f"top_k={args.top_k}, median of {args.repeats} steps on rank 0")
    table, bars = [], []
    for tp in (2, 4):
        with tempfile.TemporaryDirectory() as out_dir:
            mp.start_processes(_rank_main, args=(tp, _free_port(), out_dir, args), nprocs=tp, start_method="fork")
            with open(os.path.join(out_dir, "result.pkl"), "rb") as f:
                results = pickle.load(f)
        gather_bytes, gather_us, _ = results["gather"]
        for strategy, (nbytes, time_us, fallbacks) in results.items():
            table.append([tp, strategy, f"{nbytes / 2**10:,.1f}", time_us / 1e3,
                          ratio(gather_bytes, nbytes), ratio(time_us, gather_us), fallbacks])
        bars.append(gather_bytes / results["candidates"][0])
    print_table(["tp", "strategy", "KiB/step/rank", "step ms", "bytes: gather/this", "time: this/gather", "fallbacks"], table)
    print(f"candidate exchange moves {min(bars):,.0f}x fewer bytes than the full gather (bar: >= 100x)")
    return 0
