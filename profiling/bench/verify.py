"""Verify-step latency against plain decode at the same request count.

`python -m profiling.bench [--threads N] verify [--quick] [--vocab 32000]
[--hidden 576] [--repeats N]`. Two tables, each with ratios against plain decode
measured in the same run:
- engine: `StepEngine.step` (captured graphs on CUDA, the replay path on CPU)
  for B decode requests with k drafts each (B * (1 + k) rows, strict mode)
  against the same B requests without drafts;
- ops: the device math alone on random logits. plain = `sample` over B rows;
  strict = `sample` over B * (1 + k) rows + `accept_strict`; rejection =
  `sample` + `target_probs` + `verify_rejection` (one-hot drafts) over the
  same rows.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import SamplerConfig, sample
from engine.sampling.verify import accept_strict, target_probs, verify_rejection
from profiling.bench._timing import median_us, print_table, ratio

MAX_DRAFTS = 3


def _decode_batch(num_reqs: int, drafts: int, vocab: int, rng: np.random.Generator) -> tuple[list[SeqMeta], list[list[int]] | None]:
    """Decode requests, half plain sampling, half top-k 50."""
    seqs = []
    for i in range(num_reqs):
        params = SamplingParams(temperature=1.0, top_k=50 if i % 2 else 0, seed=i)
        prompt_len, generated = 32, 8
        seqs.append(
            SeqMeta(f"r{i}", False, 1 + drafts, prompt_len + generated + drafts, prompt_len,
                    prompt_tokens=rng.integers(0, vocab, prompt_len), num_generated=generated, params=params,
                    mtp_write_slot=i + 1)
        )
    draft_tokens = [rng.integers(0, vocab, drafts).tolist() for _ in range(num_reqs)] if drafts else None
    return seqs, draft_tokens


def _engine_table(
    vocab: int, hidden_size: int, batch_sizes: tuple[int, ...], repeats: int, warmup: int, device: torch.device, sync) -> list[list]:
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(dtype).to(device)
    engine = StepEngine(weight, EngineConfig(max_num_reqs=max(batch_sizes), max_draft_tokens=MAX_DRAFTS, device=device.type))
    engine.capture()
    rng = np.random.default_rng(0)
    table = []
    for num_reqs in batch_sizes:
        plain_seqs, _ = _decode_batch(num_reqs, 0, vocab, rng)
        hidden = torch.randn(num_reqs * (1 + MAX_DRAFTS), hidden_size, generator=gen).to(dtype).to(device)
        plain = median_us(lambda: engine.step(hidden, plain_seqs), repeats=repeats, warmup=warmup, sync=sync)
        for drafts in (1, 3):
            seqs, draft_tokens = _decode_batch(num_reqs, drafts, vocab, rng)
            verify = median_us(lambda: engine.step(hidden, seqs, draft_tokens=draft_tokens), repeats=repeats, warmup=warmup, sync=sync)
            table.append([num_reqs, drafts, num_reqs * (1 + drafts), plain, verify, ratio(verify, plain)])
    return table


def _row_params(num_reqs: int, drafts: int, device: torch.device) -> RowParams:
    return RowParams.from_numpy(
        temperatures=np.ones(num_reqs, np.float32),
        top_ks=np.where(np.arange(num_reqs) % 2 == 1, 50, 0).astype(np.int32),
        top_ps=np.ones(num_reqs, np.float32),
        min_ps=np.zeros(num_reqs, np.float32),
        seeds=np.arange(num_reqs, dtype=np.uint64),
        sample_positions=np.full(num_reqs, 40, np.int64),
        row_to_req=np.repeat(np.arange(num_reqs), 1 + drafts),
        local_step=np.tile(np.arange(1 + drafts), num_reqs),
        device=device,
    )


def _ops_table(vocab: int, batch_sizes: tuple[int, ...], repeats: int, warmup: int, device: torch.device, sync) -> list[list]:
    gen = torch.Generator().manual_seed(1)
    cfg = SamplerConfig()
    table = []
    for num_reqs in batch_sizes:
        plain_logits = (torch.randn(num_reqs, vocab, generator=gen) * 2).to(device)
        plain_params = _row_params(num_reqs, 0, device)
        plain_out = SampleOutput.allocate(num_reqs, cfg.max_logprobs, device)
        plain = median_us(lambda: sample(plain_logits, plain_params, cfg, plain_out), repeats=repeats, warmup=warmup, sync=sync)
        for drafts in (1, 3):
            rows = num_reqs * (1 + drafts)
            logits = (torch.randn(rows, vocab, generator=gen) * 2).to(device)
            params = _row_params(num_reqs, drafts, device)
            out = SampleOutput.allocate(rows, cfg.max_logprobs, device)
            last = params.local_step == drafts
            row_drafts = torch.where(last, -1, torch.randint(vocab, (rows,), generator=gen).to(device))
            position = params.sample_positions[params.row_to_req] + params.local_step
            out_tokens = torch.empty(rows, dtype=torch.int64, device=device)
            num_accepted = torch.empty(num_reqs, dtype=torch.int64, device=device)

            def strict() -> None:
                sample(logits, params, cfg, out)
                accept_strict(out.tokens, row_drafts, params.row_to_req, params.local_step, num_reqs, out=num_accepted)

            def rejection() -> None:
                sample(logits, params, cfg, out)
                p = target_probs(logits, params)
                verify_rejection(
                    p, row_drafts, None, params.seeds, position, params.row_to_req, params.local_step, num_reqs,
                    out_tokens, row_tokens=out.tokens, out=num_accepted,
                )

            strict_us = median_us(strict, repeats=repeats, warmup=warmup, sync=sync)
            rejection_us = median_us(rejection, repeats=repeats, warmup=warmup, sync=sync)
            table.append(
                [num_reqs, drafts, rows, plain, strict_us, ratio(strict_us, plain), rejection_us, ratio(rejection_us, plain)]
            )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench verify", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke test)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    if args.quick:
        vocab, hidden_size, batch_sizes, repeats, warmup = 1024, 32, (2, 4), args.repeats or 2, 1
    else:
        vocab, hidden_size, batch_sizes, warmup = args.vocab, args.hidden, (16, 64), 2
        repeats = args.repeats or (30 if device.type == "cuda" else 7)
    print(f"verify vs plain decode on {device.type}, V={vocab}, H={hidden_size}, threads={torch.get_num_threads()}, median of {repeats}")
    print("engine: StepEngine.step, strict verification")
    print_table(["B", "k", "rows", "plain us", "verify us", "verify/plain"], _engine_table(vocab, hidden_size, batch_sizes, repeats, warmup, device, sync))
    print("ops: sampler + verification math")
    print_table(
        ["B", "k", "rows", "plain us", "strict us", "strict/plain", "rejection us", "rejection/plain"],
        _ops_table(vocab, batch_sizes, repeats, warmup, device, sync),
    )
    return 0
