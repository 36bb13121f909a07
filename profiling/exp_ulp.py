"""How often one ulp of `exp` changes a sampling decision (docs/contract.md §2).

    python -m profiling.exp_ulp                     # 10^6 rows of V = 1024
    python -m profiling.exp_ulp --rows 20000 --vocab 49152 --json

Two implementations of float32 `exp` can differ in the last bit (torch's CPU `exp`, CUDA's
libdevice `expf`, numpy's: see `--compare`). Every kept set and draw of the sampler is
defined from exp(z), so such a difference can move a decision that sits exactly on a
boundary: a weight against min-p, a mass crossing top-p's level, a running mass crossing
the draw's target. This measures how often, on LM-like rows (`profiling.bench.sample`),
with random controls per row: temperature in [0.3, 1.5], top-p 1 or in [0.5, 0.99], min-p
0 or in [0.005, 0.3], top-k 0, 20 or 200, and a uniform u.

Each row is decided with torch's exp and again with every weight moved by one ulp: all up,
all down, or each token at random up, down or not at all (the weight 1 of z = 0, exact in
every implementation, stays). The cuts are taken by the sort-based walk of
`engine.sampling.filters` (same definitions as the radix select) in vLLM's order (min-p,
top-k, then top-p over what both leave), the draw by `engine.sampling.draw`. Printed: the
rows whose min-p set, top-p cut or drawn token differ from the unperturbed decision.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch

from engine.sampling.draw import inverse_cdf_draw
from engine.sampling.thresholds import block_sums, token_masses
from profiling.bench.sample import lm_like_logits

PERTURBATIONS = ("up", "down", "random")


def _perturbed(weights: torch.Tensor, how: str, gen: torch.Generator) -> torch.Tensor:
    """`weights` [rows, V] f32 moved by one ulp (0 and the exact 1 of z = 0 stay)."""
    up = torch.nextafter(weights, torch.tensor(math.inf))
    down = torch.nextafter(weights, torch.tensor(0.0))
    if how == "up":
        moved = up
    elif how == "down":
        moved = down
    else:
        pick = torch.randint(0, 3, weights.shape, generator=gen)
        moved = torch.where(pick == 0, down, torch.where(pick == 1, weights, up))
    return torch.where((weights > 0) & (weights < 1), moved, weights)


def _decide(z_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, controls: dict[str, torch.Tensor],
            vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(min-p set [rows, V] bool, top-p cut [rows] f32, drawn token [rows] int64) for
    weights [rows, V] f32 in token-id order; `z_sorted`/`order` the row sorted by z desc."""
    min_p_set = weights >= controls["min_p"][:, None]
    ws = weights.gather(1, order)
    ranks = torch.arange(vocab)[None, :]
    in_k = (controls["top_k"][:, None] <= 0) | (z_sorted >= z_sorted.gather(1, (controls["top_k"].clamp(1, vocab) - 1)[:, None]))
    alive = min_p_set.gather(1, order) & in_k & (z_sorted > -math.inf)
    mass = torch.where(alive, token_masses(ws, vocab), 0.0)
    cum = mass.cumsum(-1)
    reached = cum >= (controls["top_p"] * cum[:, -1])[:, None]
    first = torch.where(reached, ranks, vocab).amin(-1, keepdim=True).clamp(max=vocab - 1)
    cut = torch.where(controls["top_p"] < 1, z_sorted.gather(1, first).squeeze(1), -math.inf)
    kept_sorted = alive & (z_sorted >= cut[:, None])
    kept = torch.zeros_like(kept_sorted).scatter_(1, order, kept_sorted)
    kept_weights = torch.where(kept, weights, 0.0)
    token = inverse_cdf_draw(kept_weights, block_sums(kept_weights), controls["u"])
    return min_p_set, cut, token


def _controls(rows: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def pick(values: list[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)[torch.randint(0, len(values), (rows,), generator=gen)]

    uniform = lambda lo, hi: lo + (hi - lo) * torch.rand(rows, generator=gen)  # noqa: E731
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.3, 1.0, uniform(0.5, 0.99)).to(torch.float32)
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 0.0, uniform(0.005, 0.3)).to(torch.float32)
    return dict(temperature=uniform(0.3, 1.5).to(torch.float32), top_p=top_p.to(torch.float64),
                min_p=torch.where(min_p > 0, min_p, -1.0), top_k=pick([0, 20, 200], torch.int64),
                u=torch.rand(rows, generator=gen, dtype=torch.float64).clamp(2.0**-33, 1 - 2.0**-33))


def measure(rows: int, vocab: int, batch: int = 4096, seed: int = 0) -> dict[str, object]:
    """Counts of rows whose decisions one ulp of exp moves, per perturbation."""
    gen = torch.Generator().manual_seed(seed)
    counts = {how: dict(min_p_set=0, top_p_cut=0, token=0, any=0) for how in PERTURBATIONS}
    done = 0
    while done < rows:
        n = min(batch, rows - done)
        logits = lm_like_logits(n, vocab, seed=seed + done)
        controls = _controls(n, gen)
        z = (logits - logits.amax(-1, keepdim=True)) / controls["temperature"][:, None]  # [n, V] f32
        z_sorted, order = torch.sort(z, dim=1, descending=True, stable=True)
        weights = z.exp()
        base = _decide(z_sorted, order, weights, controls, vocab)
        for how in PERTURBATIONS:
            other = _decide(z_sorted, order, _perturbed(weights, how, gen), controls, vocab)
            moved = [(a != b).any(-1) if a.dim() == 2 else (a != b) for a, b in zip(base, other)]
            for name, flag in zip(("min_p_set", "top_p_cut", "token"), moved):
                counts[how][name] += int(flag.sum())
            counts[how]["any"] += int((moved[0] | moved[1] | moved[2]).sum())
        done += n
    return dict(rows=rows, vocab=vocab, counts=counts)


def compare_implementations(n: int = 10_000_000, seed: int = 0) -> dict[str, float]:
    """Fractions of float32 z in [-30, 0] where two exps differ (torch, numpy, and torch's
    exp of float64 rounded to float32, the correctly rounded value but for double rounding)."""
    gen = torch.Generator().manual_seed(seed)
    z = -30 * torch.rand(n, generator=gen)
    torch_exp, numpy_exp = z.exp(), torch.from_numpy(np.exp(z.numpy()))
    rounded = z.double().exp().float()
    return dict(torch_vs_numpy=float((torch_exp != numpy_exp).double().mean()),
                torch_vs_rounded=float((torch_exp != rounded).double().mean()),
                numpy_vs_rounded=float((numpy_exp != rounded).double().mean()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.exp_ulp", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true", help="also: how often torch's, numpy's and rounded exp differ")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = measure(args.rows, args.vocab, args.batch, args.seed)
    if args.compare:
        result["implementations"] = compare_implementations(seed=args.seed)
    result["seconds"] = round(time.perf_counter() - start, 1)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.rows} rows, V={args.vocab}, {result['seconds']} s: rows whose decision moves with one ulp of exp")
    print(f"{'exp moved':<10} {'min-p set':>10} {'top-p cut':>10} {'token':>10} {'any':>10}")
    for how, c in result["counts"].items():
        print(f"{how:<10} " + " ".join(f"{c[k]:>10}" for k in ("min_p_set", "top_p_cut", "token", "any")))
    for name, fraction in result.get("implementations", {}).items():
        print(f"{name}: {fraction:.4%} of float32 exp values differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
