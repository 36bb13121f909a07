"""The sampler (radix-select cuts, fixed work) vs the sort-based reference and a warper chain + multinomial.

Logits are shaped like a language model's: a Zipf-like profile over a random
permutation of the vocabulary, with a per-row head sharpness so that top-p 0.9
keeps anywhere from one token to thousands. Cases: top-k 50 + top-p 0.9,
top-p 0.9, plain temperature. "ours" is `sample` alone: it decides every row
itself. Logprobs are off in every column (neither reference computes them);
"ours+lp" adds ours with raw logprobs, top-20.
Medians in microseconds; ratio = reference / ours (higher is better for us).
Kept sets of ours and of the sort-based reference are compared per case.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from engine.sampling.exact import kept_sets
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import SamplerConfig, sample
from profiling.bench._timing import median_us, print_table, ratio

CASES = {
    "top-k50+top-p0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top-p0.9": dict(temperature=0.8, top_k=0, top_p=0.9),
    "plain": dict(temperature=1.0, top_k=0, top_p=1.0),
}


def lm_like_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[rows, vocab] f32: logit = -s * log(rank) + noise over a random permutation of ids."""
    gen = torch.Generator().manual_seed(seed)
    rank = torch.arange(1, vocab + 1, dtype=torch.float32)
    # Sharpness from 0.4 (flat: top-p 0.9 needs thousands) to 4 (one token).
    sharpness = torch.logspace(np.log10(0.4), np.log10(4.0), rows)[torch.randperm(rows, generator=gen)]
    profile = -sharpness[:, None] * torch.log(rank)[None, :] * 2.0
    profile += 0.3 * torch.randn(rows, vocab, generator=gen)
    order = torch.argsort(torch.rand(rows, vocab, generator=gen), dim=1)
    return torch.empty_like(profile).scatter_(1, order, profile)


def _params(rows: int, temperature: float, top_k: int, top_p: float) -> RowParams:
    return RowParams.from_numpy(
        temperatures=np.full(rows, temperature, np.float32),
        top_ks=np.full(rows, top_k, np.int32),
        top_ps=np.full(rows, top_p, np.float32),
        min_ps=np.zeros(rows, np.float32),
        seeds=np.arange(rows, dtype=np.uint64),
        sample_positions=np.full(rows, 100, np.int64),
        row_to_req=np.arange(rows),
        local_step=np.zeros(rows, np.int64),
    )


def sort_based_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[rows, V] bool kept mask the way engines do it natively: sort, mask,
    cumsum; the cumulative mass in float64 (a float32 cumsum drifts by more
    than the gaps between probabilities on rows keeping tens of thousands of
    tokens, and then no two implementations agree)."""
    # Shift by the row maximum before dividing, as the sampler's definition
    # does: z = (raw - max) / T. Dividing first rounds differently in float32
    # and flips a boundary token on rows keeping ~18k tokens.
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature
    values, ids = torch.sort(scaled, dim=-1, descending=True)
    keep = torch.ones_like(values, dtype=torch.bool)
    if top_k > 0:
        keep[:, top_k:] = False
    if top_p < 1.0:
        probs = torch.softmax(values.masked_fill(~keep, -float("inf")).double(), dim=-1)
        mass_before = probs.cumsum(-1) - probs
        keep &= mass_before < top_p
    return torch.zeros_like(keep).scatter_(1, ids, keep)


def sort_based_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Sort-based filtering plus an exponential race over the whole vocabulary."""
    if top_k > 0 or top_p < 1.0:
        keep = sort_based_kept(logits, temperature, top_k, top_p)
        scaled = (logits / temperature).masked_fill_(~keep, -float("inf"))
    else:
        scaled = logits / temperature
    probs = torch.softmax(scaled, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=gen)
    return probs.div_(race).argmax(dim=-1)


def warper_multinomial(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """A warper chain (temperature, top-k, top-p, each masking with -inf) and torch.multinomial."""
    scores = logits / temperature
    if top_k > 0:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        values, ids = torch.sort(scores, descending=False)
        cum = values.softmax(-1).cumsum(-1)
        remove = cum <= (1 - top_p)
        remove[:, -1] = False
        scores = scores.masked_fill(remove.scatter(1, ids, remove), -float("inf"))
    return torch.multinomial(scores.softmax(-1), 1, generator=gen).squeeze(1)


def _ours(logits: torch.Tensor, params: RowParams, cfg: SamplerConfig, out: SampleOutput, logprobs: bool) -> torch.Tensor:
    sample(logits, params, cfg, out, compute_logprobs=logprobs)
    return out.tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench sample", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--batch", type=int, nargs="*", help="batch sizes (default 1 16 64 256)")
    parser.add_argument("--vocab", type=int, nargs="*", help="vocab sizes (default 32768 131072)")
    parser.add_argument("--cap", type=int, default=1024, help="candidate_cap C: the widest top-k found by a topk")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    batches = args.batch or ([1, 8] if args.quick else [1, 16, 64, 256])
    vocabs = args.vocab or ([4096] if args.quick else [32768, 131072])
    repeats = args.repeats or (3 if args.quick else 5)
    cfg = SamplerConfig(candidate_cap=args.cap, max_logprobs=20)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, C={cfg.candidate_cap}, repeats={repeats}")

    table = []
    for vocab in vocabs:
        for batch in batches:
            logits = lm_like_logits(batch, vocab)
            for case, kw in CASES.items():
                params = _params(batch, **kw)
                out = SampleOutput.allocate(batch, cfg.max_logprobs)
                t_ours = median_us(lambda: _ours(logits, params, cfg, out, False), repeats=repeats, warmup=1)
                t_lp = median_us(lambda: _ours(logits, params, cfg, out, True), repeats=repeats, warmup=1)
                t_sort = median_us(lambda: sort_based_sample(logits, gen=gen, **kw), repeats=repeats, warmup=1)
                t_warp = median_us(lambda: warper_multinomial(logits, gen=gen, **kw), repeats=repeats, warmup=1)
                tokens = _ours(logits, params, cfg, out, False)
                if case == "plain":
                    same, sizes = "all V", "V"
                else:
                    ours_kept = kept_sets(logits, params)
                    same = "yes" if torch.equal(ours_kept, sort_based_kept(logits, **kw)) else "NO"
                    assert bool(ours_kept.gather(1, tokens[:, None]).all()), "draw outside the kept set"
                    counts = ours_kept.sum(-1)
                    sizes = f"{int(counts.min())}..{int(counts.max())}"
                table.append([case, batch, vocab, t_ours, t_lp, t_sort, t_warp, ratio(t_sort, t_ours), ratio(t_warp, t_ours),
                              sizes, same])
    print_table(["case", "B", "V", "ours us", "ours+lp us", "sort us", "warp+mult us", "x sort", "x warp",
                 "kept sizes", "same kept"], table)
    return 0
