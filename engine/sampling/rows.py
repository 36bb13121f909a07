"""Per-row sampling controls: the per-request `RowParams` expanded to sample rows.

Every stage reads a row's controls from `SamplingRows`, never from the
per-request arrays: row r belongs to request `row_to_req[r]` and produces the
token at position `sample_positions[request] + local_step[r]`
(docs/contract.md §1.2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from graphs.step_fields import RowParams


@dataclass
class SamplingRows:
    """Per-row controls, all [rows] (or [rows, S]) tensors on the logits' device."""

    greedy: torch.Tensor  # [rows] bool: temperature 0
    temperature: torch.Tensor  # [rows] f32, 1 for greedy rows
    top_k: torch.Tensor  # [rows] int64, V when off
    k_on: torch.Tensor  # [rows] bool
    top_p: torch.Tensor  # [rows] f64
    p_on: torch.Tensor  # [rows] bool
    min_p: torch.Tensor  # [rows] f64
    m_on: torch.Tensor  # [rows] bool
    plain: torch.Tensor  # [rows] bool: sampled, no filter -> inverse-CDF draw
    seed: torch.Tensor  # [rows] int64 holding uint64 bits
    position: torch.Tensor  # [rows] int64: absolute position of the produced token
    stop_ids: torch.Tensor  # [rows, S] int64, clamped to >= 0
    stop_active: torch.Tensor  # [rows, S] bool: this id is suppressed on this row
    forced: torch.Tensor  # [rows] int64, -1 = none
    uniform: torch.Tensor | None = None  # [rows] f64: the draw's uniform, hashed on the host (None: not staged)


def expand_rows(params: RowParams, vocab: int) -> SamplingRows:
    """Each row's controls from its request's; `vocab` turns top_k off at >= V.

    Parameters: `params` per-request tensors plus `row_to_req` / `local_step`
    [rows] int64, all on one device; `vocab` the logits' width V.
    Returns: `SamplingRows` on the same device. Capture-safe.
    """
    req = params.row_to_req
    temperature = params.temperatures[req]
    greedy = temperature == 0
    top_k = params.top_ks[req].to(torch.int64)
    k_on = (top_k > 0) & (top_k < vocab)
    top_p = params.top_ps[req].to(torch.float64)
    min_p = params.min_ps[req].to(torch.float64)
    p_on, m_on = top_p < 1, min_p > 0
    stop = params.stop_ids[req]
    return SamplingRows(
        greedy=greedy,
        temperature=torch.where(greedy, torch.ones_like(temperature), temperature),
        top_k=torch.where(k_on, top_k, torch.full_like(top_k, vocab)),
        k_on=k_on,
        top_p=top_p,
        p_on=p_on,
        min_p=min_p,
        m_on=m_on,
        plain=~greedy & ~k_on & ~p_on & ~m_on,
        seed=params.seeds[req],
        position=params.sample_positions[req] + params.local_step,
        stop_ids=stop.clamp(min=0),
        stop_active=params.eos_suppression_rows[:, None] & (stop >= 0),
        forced=params.forced_tokens,
        uniform=params.draw_uniforms,
    )
