"""Per-step latency of the whole tail, eager vs replay, per bucket.

For each bucket: a decode step of `bucket` requests (each verifying
`--drafts` drafts) through `StepEngine.run`, with the ledger built from a
persistent `RequestTable` as the decode loop does. Columns:
- host µs: ledger + validation + staging (the single packed copy issued),
  measured alone;
- eager / replay µs: the whole step, `use_graphs=False` vs the captured graph;
- speed-up: eager / replay.
Then the host-only bar: ledger + staging at 256 requests with 3 drafts.

    python -m profiling.bench step [--device cuda] [--hidden 7168 --vocab 129280 --dtype bf16]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from engine.host.draft_slots import DraftSlots
from engine.host.params import SamplingParams
from engine.host.request_table import RequestTable
from engine.step.engine_config import EngineConfig
from engine.step.step_engine import StepEngine
from profiling.bench._timing import median_us, print_table, ratio

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class DecodeWorkload:
    """`n` running requests in a table, one decode step each with `drafts` drafts."""

    def __init__(self, n: int, drafts: int, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.n, self.drafts = n, drafts
        self.table = RequestTable(n)
        self.slots = DraftSlots(n + 1)
        prompt_lens = rng.integers(16, 1024, n)
        generated = rng.integers(1, 256, n).astype(np.int32)
        self.write_slots = np.empty(n, np.int32)
        for i in range(n):
            params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i) if i % 2 else SamplingParams(temperature=0.0)
            self.write_slots[i] = self.slots.allocate()
            self.table.add(i, params, rng.integers(0, vocab, prompt_lens[i]), mtp_write_slot=int(self.write_slots[i]))
        self.table.record_emitted(np.arange(n), generated)
        self.rows = np.arange(n)
        self.is_prompt = np.zeros(n, bool)
        self.seqlen_q = np.full(n, 1 + drafts, np.int32)
        self.seqlen_k = (prompt_lens + generated + drafts).astype(np.int32)
        self.stop_ids = np.full((n, 1), -1, np.int64)  # a persistent column in a real loop
        self.drafts = rng.integers(0, vocab, (n, drafts)) if drafts else None

    def ledger(self, max_draft_tokens: int):
        read = self.slots.take_read_slots(self.write_slots, ~self.is_prompt)
        self.slots.mark_written(self.write_slots)
        return self.table.ledger(self.rows, self.is_prompt, self.seqlen_q, self.seqlen_k, read,
                                 max_draft_tokens=max_draft_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=None, help="default 576 on CPU, 7168 on CUDA")
    parser.add_argument("--vocab", type=int, default=None, help="default 49152 on CPU, 129280 on CUDA")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--drafts", type=int, default=0)
    parser.add_argument("--max-bucket", type=int, default=None, help="default 16 on CPU, 64 on CUDA")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    hidden = args.hidden or (7168 if cuda else 576)
    vocab = args.vocab or (129280 if cuda else 49152)
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    max_bucket = args.max_bucket or (64 if cuda else (4 if args.quick else 16))
    repeats = args.repeats or (5 if args.quick else (50 if cuda else 10))
    sync = torch.cuda.synchronize if cuda else None

    weight = (torch.randn(vocab, hidden, device=args.device) * 0.02).to(dtype)
    config = dict(max_num_reqs=max_bucket, max_draft_tokens=args.drafts, device=args.device)
    replayed = StepEngine(weight, EngineConfig(**config))
    report = replayed.capture()
    eager = StepEngine(weight, EngineConfig(**config, use_graphs=False))
    print(f"tail: H={hidden} V={vocab} {str(dtype).replace('torch.', '')} on {args.device}, drafts={args.drafts}; {report}")

    rows = []
    for bucket in replayed.buckets:
        work = DecodeWorkload(bucket, args.drafts, vocab)
        source = replayed.source  # zero-copy: the model would have written its rows here
        source[: bucket * (1 + args.drafts)].normal_()
        eager.source[: bucket * (1 + args.drafts)].copy_(source[: bucket * (1 + args.drafts)])

        def host_only():
            inputs = work.ledger(args.drafts)
            replayed.validate(replayed.source, inputs)
            arrays = replayed.drafts.step_arrays(inputs, work.stop_ids, draft_tokens=work.drafts)
            replayed.stage_step(replayed.source, arrays, bucket)

        def full(engine):
            def one_step():
                inputs = work.ledger(args.drafts)
                return engine.run(engine.source, inputs, engine.drafts.step_arrays(inputs, work.stop_ids, draft_tokens=work.drafts))
            return one_step

        t_host = median_us(host_only, repeats=repeats * 4, warmup=3, sync=sync)
        t_eager = median_us(full(eager), repeats=repeats, warmup=2, sync=sync)
        t_replay = median_us(full(replayed), repeats=repeats, warmup=2, sync=sync)
        rows.append([bucket, bucket * (1 + args.drafts), t_host, t_eager, t_replay, ratio(t_eager, t_replay)])
    print_table(["bucket", "rows", "host µs", "eager µs", "replay µs", "speed-up"], rows)

    if cuda:
        bandwidth = 4.8e12  # H200 HBM3e peak, bytes/s
        floor_us = weight.numel() * weight.element_size() / bandwidth * 1e6
        print(f"LM-head weight-read floor: {floor_us:.1f} µs at {bandwidth / 1e12:.1f} TB/s")

    # The host bar: ledger + validation + staging for 256 requests x 3 drafts,
    # on a small engine (the device part is not run).
    big = StepEngine(torch.zeros(1024, 64, device=args.device), EngineConfig(max_num_reqs=256, max_draft_tokens=3, device=args.device))
    work = DecodeWorkload(256, 3, 1024)

    def host_256():
        inputs = work.ledger(3)
        big.validate(big.source, inputs)
        big.stage_step(big.source, big.drafts.step_arrays(inputs, work.stop_ids, draft_tokens=work.drafts), 256)

    t = median_us(host_256, repeats=50 if args.quick else 300, warmup=10, sync=sync)
    print(f"\nhost bar: ledger + staging at 256 requests x 3 drafts = {t:.1f} µs median (target <= 100 µs)")
    return 0
