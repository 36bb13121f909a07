"""Host time per decode step from the scheduler's decision to the arrays a step
stages, five ways, measured in one run:

- persistent batch: `PersistentBatch.prepare_rows` (read slots of the
  draft-info pool, the ledger from the persistent columns, stop ids, the
  staged arrays `StepEngine.run` takes);
- SeqMeta front: `StepEngine.step(hidden, seqs)` up to `run` (run replaced by
  a no-op): the SeqMeta list read into the engine's persistent table, then
  the same ledger and staged arrays;
- prepare_sampler_inputs: the ledger alone from the SeqMeta list, pure
  (nothing kept between calls);
- plain numpy loop: the ledger's arrays for this all-decode batch, written as a
  per-request Python loop appending to lists, converted to numpy at the end
  (`plain_numpy_ledger`, in this file: a first version anyone would write);
- plain loop: the per-request reference of tests/ledger_reference.py over the
  same SeqMeta list, its lists converted to numpy (every array of the ledger).

Every request decodes, verifying `drafts` drafts from the pool (each
request's rows: 1 + drafts). The paths take turns (a few calls each, the
order rotating) and the medians are reported; speed-up = plain loop / that
path, "vs numpy loop" = plain numpy loop / that path.

    python -m profiling.bench ledger [--quick] [--repeats N] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engine.host.ledger import prepare_sampler_inputs
from engine.host.params import SamplingParams, SeqMeta
from engine.step.batch import PersistentBatch
from engine.step.engine_config import EngineConfig
from engine.step.step_engine import StepEngine
from profiling.bench._timing import print_table, ratio

try:
    from tests.ledger_reference import reference_ledger
except ImportError:  # run from outside the repository root
    reference_ledger = None

BATCHES = (1, 16, 64, 256, 1024)
DRAFTS = (0, 3)
PATHS = ("persistent batch", "SeqMeta front", "prepare_sampler_inputs", "plain numpy loop", "plain loop")


def plain_numpy_ledger(seqs: list[SeqMeta], max_draft_tokens: int) -> dict[str, np.ndarray]:
    """Every array `prepare_sampler_inputs` gives for a batch of decode requests, one
    request at a time, lists appended and turned into numpy at the end: per sample row
    its output row, request and place, the rows where EOS is masked (min_tokens), the
    draft-info rows read; per request its output and sample layout, the position of its
    first sample row, the slot it writes, its logprob counts and sampling parameters."""
    selected, row_to_req, local_step, read_rows, suppressed = [], [], [], [], []
    out_offsets, counts, positions, write_slots, logprobs, prompt_logprobs = [], [], [], [], [], []
    temperatures, top_ks, top_ps, min_ps, seeds = [], [], [], [], []
    out_row = 0
    for i, seq in enumerate(seqs):
        params = seq.params
        short = params.min_tokens - seq.num_generated
        last = seq.seqlen_q - 1
        for j in range(seq.seqlen_q):
            if j < short:
                suppressed.append(len(selected))
            selected.append(out_row + j)
            row_to_req.append(i)
            local_step.append(j)
            read_rows.append(0 if j == last else seq.mtp_read_slot * max_draft_tokens + j)
        out_offsets.append(out_row)
        counts.append(seq.seqlen_q)
        positions.append(seq.seqlen_k - last)
        write_slots.append(seq.mtp_write_slot)
        logprobs.append(params.num_logprobs)
        prompt_logprobs.append(params.num_prompt_logprobs)
        temperatures.append(params.temperature)
        top_ks.append(params.top_k)
        top_ps.append(params.top_p)
        min_ps.append(params.min_p)
        seeds.append(params.seed)
        out_row += seq.seqlen_q
    i32 = np.int32
    out = {
        "selected_token_indices": np.array(selected, i32), "row_to_req": np.array(row_to_req, i32),
        "local_step": np.array(local_step, i32), "mtp_info_read_rows": np.array(read_rows, i32),
        "eos_suppression_rows": np.array(suppressed, i32), "out_offsets": np.array(out_offsets, i32),
        "out_lens": np.array(counts, i32), "sample_positions": np.array(positions, np.int64),
        "mtp_info_write_slots": np.array(write_slots, i32), "num_logprobs": np.array(logprobs, i32),
        "num_prompt_logprobs": np.array(prompt_logprobs, i32), "temperatures": np.array(temperatures, np.float32),
        "top_ks": np.array(top_ks, i32), "top_ps": np.array(top_ps, np.float32), "min_ps": np.array(min_ps, np.float32),
        "seeds": np.array(seeds, np.uint64),
        "is_prompt": np.zeros(len(seqs), bool), "prompt_row_counts": np.zeros(len(seqs), i32),
    }
    # The decode batch's aliases: queries are output rows, samples start where outputs do.
    out["query_offsets"] = out["sample_offsets"] = out["mtp_first_token_positions"] = out["out_offsets"]
    out["sample_counts"] = out["mtp_seqlens_q"] = out["out_lens"]
    out["is_last_chunk"] = out["is_prompt"]
    return out


def _decode_step(n: int, drafts: int, rng: np.random.Generator) -> dict[str, Callable[[], object]]:
    """One decode step of n running requests, each verifying `drafts` drafts, three ways."""
    engine = StepEngine(torch.zeros(256, 16), EngineConfig(
        max_num_reqs=n, max_draft_tokens=max(drafts, 1), device="cpu", use_graphs=False, batch_invariant=False,
        eos_token_id=2))
    batch = PersistentBatch(engine, n)
    prompt_lens = rng.integers(16, 2048, n)
    generated = rng.integers(1, 512, n)
    seqs = []
    for i in range(n):
        params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=i, min_tokens=int(i % 3) * 100)
        row = batch.add(i, np.arange(prompt_lens[i]) % 256, params)
        slot = int(batch.table.cols["mtp_write_slot"][row])
        seqs.append(SeqMeta(i, is_prompt=False, seqlen_q=1 + drafts, seqlen_k=int(prompt_lens[i] + generated[i] + drafts),
                            prompt_len=int(prompt_lens[i]), num_generated=int(generated[i]), params=params,
                            mtp_read_slot=slot, mtp_write_slot=slot))
    rows = np.arange(n)
    batch.set_generated(rows, generated.astype(np.int32))
    batch.draft_slots.mark_written(batch.table.cols["mtp_write_slot"][rows])  # last step's draft head wrote every slot
    seqlen_q = np.full(n, 1 + drafts, np.int32)
    seqlen_k = (prompt_lens + generated + drafts).astype(np.int32)
    engine.run = lambda *args, **kwargs: None  # the step path up to the replay
    hidden = engine.source

    def plain_loop():
        out = reference_ledger(seqs, max_draft_tokens=engine.config.max_draft_tokens)
        return {k: np.asarray(v) for k, v in out.items() if isinstance(v, list)}

    max_draft = engine.config.max_draft_tokens
    # The two plain loops and the ledger must agree, or the comparison means nothing.
    ours, plain = prepare_sampler_inputs(seqs, max_draft_tokens=max_draft), plain_numpy_ledger(seqs, max_draft)
    for name, want in plain.items():
        got = getattr(ours, name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name
    return {
        "persistent batch": lambda: batch.prepare_rows(rows, seqlen_q, seqlen_k),
        "SeqMeta front": lambda: engine.step(hidden, seqs),
        "prepare_sampler_inputs": lambda: prepare_sampler_inputs(seqs, max_draft_tokens=max_draft),
        "plain numpy loop": lambda: plain_numpy_ledger(seqs, max_draft),
        "plain loop": plain_loop,
    }


def alternating_medians(calls: dict[str, Callable[[], object]], repeats: int, block: int = 5) -> dict[str, float]:
    """Median µs per call of each, over `repeats` calls: the paths take turns, `block`
    timed calls each (after one untimed, so each turn starts warm, as a step does
    after the last), the order rotating every round, so a slow stretch of the
    machine hits every path alike."""
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(-(-repeats // block)):
        for name in names[r % len(names):] + names[: r % len(names)]:
            call = calls[name]
            call()
            for _ in range(block):
                t0 = time.perf_counter()
                call()
                samples[name].append((time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(times) for name, times in samples.items()}


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench ledger", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, batches up to 256")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args(argv)
    if reference_ledger is None:
        print("run from the repository root: the reference loop lives in tests/ledger_reference.py")
        return 2
    batches = BATCHES[:-1] if args.quick else BATCHES
    repeats = args.repeats or (30 if args.quick else 200)
    rng = np.random.default_rng(0)
    results = []
    for drafts in DRAFTS:
        for n in batches:
            medians = alternating_medians(_decode_step(n, drafts, rng), repeats)
            for path in PATHS:
                results.append(dict(requests=n, drafts=drafts, path=path, us=medians[path],
                                    speedup=medians["plain loop"] / medians[path],
                                    vs_numpy_loop=medians["plain numpy loop"] / medians[path]))
    at = {(r["requests"], r["drafts"], r["path"]): r for r in results}
    if args.json:
        print(json.dumps(dict(cpu=cpu_model(), threads=torch.get_num_threads(), repeats=repeats, rows=results), indent=1))
        return 0
    print(f"Decode step, scheduler decision -> staged arrays (host, µs, median of {repeats}, alternating); {cpu_model()}")
    print_table(["requests", "drafts", "path", "µs", "speed-up", "vs numpy loop"],
                [[r["requests"], r["drafts"], r["path"], r["us"],
                  ratio(at[r["requests"], r["drafts"], "plain loop"]["us"], r["us"]),
                  ratio(at[r["requests"], r["drafts"], "plain numpy loop"]["us"], r["us"])] for r in results])
    if (256, 3, "plain loop") in at:
        batch, front = at[256, 3, "persistent batch"], at[256, 3, "SeqMeta front"]
        pure = at[256, 3, "prepare_sampler_inputs"]
        print(f"\nbar at 256 requests x 4 rows: persistent batch {batch['us']:.1f} µs (target <= 50), "
              f"SeqMeta front {front['us']:.1f} µs (target <= 150) = {front['speedup']:.2f}x the plain loop "
              "(target >= 3x)")
        print(f"prepare_sampler_inputs at 256 requests x 4 rows: {pure['us']:.1f} µs (target <= 150) = "
              f"{pure['vs_numpy_loop']:.2f}x the plain numpy loop (target >= 3x)")
    if (1024, 3, "persistent batch") in at:
        growth = at[1024, 3, "persistent batch"]["us"] / at[256, 3, "persistent batch"]["us"]
        print(f"growth: persistent batch 1024 / 256 requests (3 drafts) = {growth:.2f}x (target <= 5x)")
    return 0
