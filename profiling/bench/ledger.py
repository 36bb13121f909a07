"""Host time per decode step for the row ledger plus every parameter array.

Ours: the persistent `RequestTable` path the engine runs each step (take the
draft-info read slots, gather the batch's columns, the vectorised walk, the
§1.5 checks). Reference: the plain per-request loop of tests/ledger_reference.py
over `SeqMeta` objects, converted to numpy arrays, measured in the same run.

    python -m profiling.bench ledger [--quick] [--repeats N]
"""
from __future__ import annotations

import argparse

import numpy as np

from engine.host.params import SamplingParams, SeqMeta
from engine.host.persistent_batch import DraftSlots, RequestTable
from profiling.bench._timing import median_us, print_table, ratio

try:
    from tests.ledger_reference import reference_ledger
except ImportError:  # run from outside the repository root
    reference_ledger = None

BATCHES = (1, 16, 64, 256, 1024)
DRAFTS = (0, 3)


def _decode_batch(n: int, drafts: int, rng: np.random.Generator):
    """A decode step of n running requests, each verifying `drafts` drafts."""
    max_draft = max(drafts, 1)
    table = RequestTable(n)
    slots = DraftSlots(n + 1)
    prompt_lens = rng.integers(16, 2048, n)
    generated = rng.integers(1, 512, n)
    write_slots = np.empty(n, np.int32)
    seqs = []
    for i in range(n):
        params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=i, min_tokens=int(i % 3) * 100)
        write_slots[i] = slots.allocate()
        table.add(i, params, np.arange(prompt_lens[i]), mtp_write_slot=int(write_slots[i]))
        seqs.append(
            SeqMeta(i, is_prompt=False, seqlen_q=1 + drafts,
                    seqlen_k=int(prompt_lens[i] + generated[i] + drafts),
                    prompt_len=int(prompt_lens[i]), num_generated=int(generated[i]), params=params,
                    mtp_read_slot=int(write_slots[i]), mtp_write_slot=int(write_slots[i]))
        )
    table.record_emitted(np.arange(n), generated.astype(np.int32))
    rows = np.arange(n)
    is_prompt = np.zeros(n, bool)
    seqlen_q = np.full(n, 1 + drafts, np.int32)
    seqlen_k = (prompt_lens + generated + drafts).astype(np.int32)

    def ours():
        slots.mark_written(write_slots)  # last step's draft head wrote every slot
        read = slots.take_read_slots(write_slots, ~is_prompt)
        return table.ledger(rows, is_prompt, seqlen_q, seqlen_k, read, max_draft_tokens=max_draft)

    def reference():
        out = reference_ledger(seqs, max_draft_tokens=max_draft)
        return {k: np.asarray(v) for k, v in out.items() if isinstance(v, list)}

    return ours, reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench ledger", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, batches up to 256")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    if reference_ledger is None:
        print("run from the repository root: the reference loop lives in tests/ledger_reference.py")
        return 2
    batches = BATCHES[:-1] if args.quick else BATCHES
    repeats = args.repeats or (20 if args.quick else 200)
    rng = np.random.default_rng(0)
    rows, ours_at = [], {}
    for drafts in DRAFTS:
        for n in batches:
            ours, reference = _decode_batch(n, drafts, rng)
            t_ours = median_us(ours, repeats=repeats, warmup=10)
            t_ref = median_us(reference, repeats=max(5, repeats // 10), warmup=2)
            ours_at[n, drafts] = t_ours
            rows.append([n, drafts, t_ours, t_ref, ratio(t_ref, t_ours)])
    print("Ledger + parameter arrays, one decode step (host, µs, median)")
    print_table(["requests", "drafts", "ours µs", "reference µs", "speed-up"], rows)
    if (256, 3) in ours_at:
        print(f"\nbar: 256 requests x 3 drafts = {ours_at[256, 3]:.1f} µs (target <= 50 µs)")
    if (1024, 3) in ours_at:
        print(f"growth: 1024 / 256 requests (3 drafts) = {ours_at[1024, 3] / ours_at[256, 3]:.2f}x (target <= 5x)")
    return 0
