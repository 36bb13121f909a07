"""Sampling controls (penalties, logit bias, allowed tokens, the token bitmask) against plain sampling.

`python -m profiling.bench [--threads N] controls [--quick] [--batch 64]
[--vocab 128256] [--repeats N] [--json]`. B decode requests over fp32 logits
shaped like a language model's (`sample.lm_like_logits`), temperature 0.8,
top-p 0.9. "plain": the engine's sampler with the controls off (`sample`);
each other column: the controls graph's work on the same rows, i.e. the
rows' controls gathered (`SamplingControls.rows`) and the same sampler, which
copies the unprocessed logits and applies them. Cases:
penalties (repetition 1.2, frequency 0.5, presence 0.5 over a 512-token prompt
and 256 generated tokens), a 256-entry logit bias, 1024 allowed tokens, all
three together ("all"), a per-row token bitmask allowing half the vocabulary
(structured output and bad words arrive this way; "bitmask"), and everything
at once ("all+bitmask"). Both sides restore the logits from a copy first (the controls
rewrite them in place), and the sides alternate within each repeat. Medians in
milliseconds; ratio = case / plain (lower is better; the bar for "all+bitmask" is 1.3x).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from engine import EngineConfig, SamplingParams, StepEngine
from engine.sampling.sampler import sample
from engine.step.batch import PersistentBatch
from profiling.bench._timing import print_table, ratio
from profiling.bench.sample import lm_like_logits

PROMPT_LEN, GENERATED = 512, 256


def _cases(vocab: int, rng: np.random.Generator) -> dict[str, tuple[dict, bool]]:
    """case -> (SamplingParams controls, whether the rows carry a token bitmask)."""
    bias = {int(t): float(v) for t, v in zip(rng.choice(vocab, 256, replace=False), rng.uniform(-5, 5, 256))}
    allowed = tuple(int(t) for t in rng.choice(vocab, min(1024, vocab), replace=False))
    penalties = dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5)
    every = dict(**penalties, logit_bias=bias, allowed_token_ids=allowed)
    return {
        "penalties": (penalties, False),
        "bias": (dict(logit_bias=bias), False),
        "allowed": (dict(allowed_token_ids=allowed), False),
        "all": (every, False),
        "bitmask": ({}, True),
        "all+bitmask": (every, True),
    }


def _half_allowed_bitmask(rows: int, vocab: int, rng: np.random.Generator) -> torch.Tensor:
    """[rows, ceil(V/32)] int32: each token allowed with probability 1/2."""
    words = -(-vocab // 32)
    return torch.from_numpy(rng.integers(-(2**31), 2**31, (rows, words), dtype=np.int64).astype(np.int32))


def _staged_engine(batch: int, vocab: int, controls: dict, rng: np.random.Generator) -> StepEngine:
    """An engine whose static buffers hold a decode step of `batch` requests with `controls`,
    each with a prompt and generated tokens counted."""
    engine = StepEngine(torch.zeros(vocab, 8), EngineConfig(max_num_reqs=batch, max_control_slots=batch, device="cpu",
                                                            use_graphs=False, sampler_variants=False))
    table = PersistentBatch(engine)
    ids = list(range(batch))
    for i in ids:
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=i, **controls)
        table.add(i, rng.integers(0, vocab, PROMPT_LEN).tolist(), params)
        slot = int(table.table.control_slot[table.table.row(i)])
        if slot == 0:
            continue  # no control slot (the bitmask-only case): slot 0 stays neutral
        history = torch.from_numpy(rng.integers(0, vocab, GENERATED))
        engine.controls.counts[slot].index_add_(0, history, torch.ones(GENERATED, dtype=torch.int32))
    table.table.record_emitted(table.rows_of(ids), np.full(batch, GENERATED, np.int32))
    step = table.prepare(ids, [1] * batch, [PROMPT_LEN + GENERATED] * batch)
    engine.stage_step(torch.zeros(batch, 8), step.arrays, batch)
    return engine


def _sampler(engine: StepEngine, batch: int, saved: torch.Tensor, controlled: bool,
             token_bitmask: torch.Tensor | None = None):
    """One timed call: restore the logits, (gather the rows' controls,) sample (the
    sampler applies them, and the bitmask when given)."""
    b, cfg = engine.buffers, engine.config.sampler
    params, out = b.params(batch), b.outputs(batch)
    logits = b.logits[:batch]

    def run() -> None:
        logits.copy_(saved)
        controls = engine.controls.rows(b, batch) if controlled else None
        sample(logits, params, cfg, out, controls=controls, token_bitmask=token_bitmask)

    return run


def _alternating_ms(sides: list, repeats: int, warmup: int = 1) -> list[float]:
    """Median milliseconds of each side, the sides taking turns within each repeat."""
    for fn in sides:
        for _ in range(warmup):
            fn()
    samples = [[] for _ in sides]
    for _ in range(repeats):
        for i, fn in enumerate(sides):
            t0 = time.perf_counter()
            fn()
            samples[i].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(s) for s in samples]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench controls", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--batch", type=int, default=None, help="requests B (default 64)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary V (default 128256)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object after the table")
    args = parser.parse_args(argv)
    batch = args.batch or (8 if args.quick else 64)
    vocab = args.vocab or (4096 if args.quick else 128256)
    repeats = args.repeats or (3 if args.quick else 7)
    rng = np.random.default_rng(0)
    saved = lm_like_logits(batch, vocab)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B={batch}, V={vocab}, repeats={repeats}")

    rows, figures = [], {}
    for case, (controls, masked) in _cases(vocab, rng).items():
        engine = _staged_engine(batch, vocab, controls, rng)
        mask = _half_allowed_bitmask(batch, vocab, rng) if masked else None
        plain_ms, case_ms = _alternating_ms([_sampler(engine, batch, saved, False),
                                             _sampler(engine, batch, saved, bool(controls), mask)], repeats)
        rows.append([case, plain_ms, case_ms, ratio(case_ms, plain_ms)])
        figures[case] = {"plain_ms": plain_ms, "controls_ms": case_ms, "ratio": case_ms / plain_ms}
    print_table(["case", "plain ms", "controls ms", "controls/plain"], rows)
    if args.json:
        print(json.dumps({"batch": batch, "vocab": vocab, "threads": torch.get_num_threads(), "cases": figures}))
    return 0
