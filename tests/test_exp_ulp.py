"""profiling/exp_ulp.py: the measurement of how often one ulp of exp moves a decision."""
from __future__ import annotations

import torch

from profiling import exp_ulp


def test_measure_counts_rows_and_moves_nothing_without_a_perturbation(monkeypatch):
    result = exp_ulp.measure(rows=300, vocab=64, batch=128)
    assert result["rows"] == 300 and set(result["counts"]) == set(exp_ulp.PERTURBATIONS)
    for counts in result["counts"].values():
        assert 0 <= counts["any"] <= 300
        assert max(counts["min_p_set"], counts["top_p_cut"], counts["token"]) <= counts["any"]
    # A perturbation that changes nothing moves no decision; one that moves every weight a lot does.
    monkeypatch.setattr(exp_ulp, "_perturbed", lambda weights, how, gen: weights)
    assert all(c["any"] == 0 for c in exp_ulp.measure(rows=200, vocab=64, batch=128)["counts"].values())
    monkeypatch.setattr(exp_ulp, "_perturbed", lambda weights, how, gen: torch.where(weights < 1, weights * 0.5, weights))
    assert all(c["any"] > 0 for c in exp_ulp.measure(rows=200, vocab=64, batch=128)["counts"].values())


def test_one_ulp_moves_every_weight_but_the_exact_ones():
    weights = torch.tensor([[0.0, 0.25, 1.0, 3e-30]])
    gen = torch.Generator().manual_seed(0)
    up, down = exp_ulp._perturbed(weights, "up", gen), exp_ulp._perturbed(weights, "down", gen)
    assert up[0, 0] == 0 and up[0, 2] == 1 and down[0, 2] == 1
    assert (up[0, [1, 3]] > weights[0, [1, 3]]).all() and (down[0, [1, 3]] < weights[0, [1, 3]]).all()
