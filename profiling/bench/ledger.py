"""Host time per decode step from the scheduler's decision to the arrays a step
stages, three ways, measured in one run:

- persistent batch: `PersistentBatch.prepare_rows` (read slots of the
  draft-info pool, the ledger from the persistent columns, stop ids, the
  staged arrays `StepEngine.run` takes);
- SeqMeta front: `StepEngine.step(hidden, seqs)` up to `run` (run replaced by
  a no-op): the SeqMeta list read into the engine's persistent table, then
  the same ledger and staged arrays;
- plain loop: the per-request reference of tests/ledger_reference.py over the
  same SeqMeta list, its lists converted to numpy (the ledger alone).

Every request decodes, verifying `drafts` drafts from the pool (each
request's rows: 1 + drafts). The three take turns (a few calls each, the
order rotating) and the medians are reported; speed-up = plain loop / that
path.

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

from engine.host.params import SamplingParams, SeqMeta
from engine.step.batch import PersistentBatch
from engine.step.config import EngineConfig
from engine.step.step_engine import StepEngine
from profiling.bench._timing import print_table, ratio

try:
    from tests.ledger_reference import reference_ledger
except ImportError:  # run from outside the repository root
    reference_ledger = None

BATCHES = (1, 16, 64, 256, 1024)
DRAFTS = (0, 3)
PATHS = ("persistent batch", "SeqMeta front", "plain loop")


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
        slot = int(batch.table.cols.mtp_write_slot[row])
        seqs.append(SeqMeta(i, is_prompt=False, seqlen_q=1 + drafts, seqlen_k=int(prompt_lens[i] + generated[i] + drafts),
                            prompt_len=int(prompt_lens[i]), num_generated=int(generated[i]), params=params,
                            mtp_read_slot=slot, mtp_write_slot=slot))
    rows = np.arange(n)
    batch.set_generated(rows, generated.astype(np.int32))
    batch.draft_slots.mark_written(batch.table.cols.mtp_write_slot[rows])  # last step's draft head wrote every slot
    seqlen_q = np.full(n, 1 + drafts, np.int32)
    seqlen_k = (prompt_lens + generated + drafts).astype(np.int32)
    engine.run = lambda *args, **kwargs: None  # the step path up to the replay
    hidden = engine.source

    def plain_loop():
        out = reference_ledger(seqs, max_draft_tokens=engine.config.max_draft_tokens)
        return {k: np.asarray(v) for k, v in out.items() if isinstance(v, list)}

    return {
        "persistent batch": lambda: batch.prepare_rows(rows, seqlen_q, seqlen_k),
        "SeqMeta front": lambda: engine.step(hidden, seqs),
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
                                    speedup=medians["plain loop"] / medians[path]))
    at = {(r["requests"], r["drafts"], r["path"]): r for r in results}
    if args.json:
        print(json.dumps(dict(cpu=cpu_model(), threads=torch.get_num_threads(), repeats=repeats, rows=results), indent=1))
        return 0
    print(f"Decode step, scheduler decision -> staged arrays (host, µs, median of {repeats}, alternating); {cpu_model()}")
    print_table(["requests", "drafts", "path", "µs", "speed-up"],
                [[r["requests"], r["drafts"], r["path"], r["us"],
                  ratio(at[r["requests"], r["drafts"], "plain loop"]["us"], r["us"])] for r in results])
    if (256, 3, "plain loop") in at:
        batch, front = at[256, 3, "persistent batch"], at[256, 3, "SeqMeta front"]
        print(f"\nbar at 256 requests x 4 rows: persistent batch {batch['us']:.1f} µs (target <= 50), "
              f"SeqMeta front {front['us']:.1f} µs (target <= 150) = {front['speedup']:.2f}x the plain loop "
              "(target >= 3x)")
    if (1024, 3, "persistent batch") in at:
        growth = at[1024, 3, "persistent batch"]["us"] / at[256, 3, "persistent batch"]["us"]
        print(f"growth: persistent batch 1024 / 256 requests (3 drafts) = {growth:.2f}x (target <= 5x)")
    return 0
