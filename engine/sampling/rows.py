"""Per-row sampling controls: the per-request `RowParams` expanded to sample rows.

Every stage reads a row's controls from `SamplingRows`, never from the
per-request arrays: row r belongs to request `row_to_req[r]` and produces the
token at position `sample_positions[request] + local_step[r]`
(docs/contract.md §1.2).
"""
from __future__ import annotations

from functools import cached_property

import torch

from engine.sampling.row_params import RowParams


def _common_control(name: str, doc: str) -> cached_property:
    """A control of `SamplingRows._common`, as a cached property named `name`."""
    def get(rows: SamplingRows) -> torch.Tensor | None:
        return rows._common()[name]
    get.__doc__ = doc
    return cached_property(get)


class SamplingRows:
    """Per-row controls, all [rows] (or [rows, S]) tensors on the logits' device.

    Each control is expanded on first use and kept: a stage that never reads one (the
    plain draw reads no filter, the kernels read none) issues none of its ops. What every
    torch-sampled row reads (greedy, temperature, stop ids, forced token, uniform) comes
    in one go, when first read or at once with `expand=True` (the torch stages)."""

    def __init__(self, params: RowParams, vocab: int, *, expand: bool = False) -> None:
        self._params = params
        self._vocab = vocab
        self._req = params.row_to_req
        if expand:
            self._common()

    def _common(self) -> dict[str, torch.Tensor | None]:
        """The controls every sampled row reads, into the instance (where the cached
        properties below find them first)."""
        params = self._params
        raw = params.temperatures[self._req]
        greedy = raw == 0
        stop = params.stop_ids[self._req]
        common = {
            "greedy": greedy,
            "temperature": torch.where(greedy, 1.0, raw),
            "stop_ids": stop.clamp(min=0),
            "stop_active": params.eos_suppression_rows[:, None] & (stop >= 0),
            "forced": params.forced_tokens,
            "uniform": params.draw_uniforms,
        }
        for name, value in common.items():
            self.__dict__.setdefault(name, value)  # a control `replace` put in stays
        return common

    greedy = _common_control("greedy", "[rows] bool: temperature 0")
    temperature = _common_control("temperature", "[rows] f32, 1 for greedy rows")
    stop_ids = _common_control("stop_ids", "[rows, S] int64, clamped to >= 0")
    stop_active = _common_control("stop_active", "[rows, S] bool: this id is suppressed on this row")
    forced = _common_control("forced", "[rows] int64, -1 = none")
    uniform = _common_control("uniform", "[rows] f64: the draw's uniform, hashed on the host (None: not staged)")

    def replace(self, **controls: torch.Tensor) -> SamplingRows:
        """The same rows with the given controls in place of their own (tests plant bugs this way)."""
        known = {name for name in dir(type(self)) if not name.startswith("_")} - {"replace", "params"}
        unknown = sorted(set(controls) - known)
        if unknown:
            raise ValueError(f"controls {unknown}: SamplingRows has no such control")
        rows = SamplingRows(self._params, self._vocab)
        rows.__dict__.update(controls)  # a cached_property reads the instance's dict first
        return rows

    @property
    def params(self) -> RowParams:
        """The per-request parameters these rows expand (a fused kernel reads them as they are)."""
        return self._params

    @cached_property
    def _top_k(self) -> torch.Tensor:
        return self._params.top_ks[self._req].to(torch.int64)

    @cached_property
    def k_on(self) -> torch.Tensor:
        """[rows] bool: top-k on (0 < k < V, and not greedy: as vLLM, a greedy
        request has no filters, so its processed logprobs are over every token)."""
        return (self._top_k > 0) & (self._top_k < self._vocab) & ~self.greedy

    @cached_property
    def top_k(self) -> torch.Tensor:
        """[rows] int64, V when off."""
        return torch.where(self.k_on, self._top_k, torch.full_like(self._top_k, self._vocab))

    @cached_property
    def top_p(self) -> torch.Tensor:
        """[rows] f64."""
        return self._params.top_ps[self._req].to(torch.float64)

    @cached_property
    def p_on(self) -> torch.Tensor:
        """[rows] bool: top-p on (< 1, and not greedy)."""
        return (self.top_p < 1) & ~self.greedy

    @cached_property
    def min_p(self) -> torch.Tensor:
        """[rows] f64."""
        return self._params.min_ps[self._req].to(torch.float64)

    @cached_property
    def m_on(self) -> torch.Tensor:
        """[rows] bool: min-p on (> 0, and not greedy)."""
        return (self.min_p > 0) & ~self.greedy

    @cached_property
    def seed(self) -> torch.Tensor:
        """[rows] int64 holding uint64 bits."""
        return self._params.seeds[self._req]

    @cached_property
    def position(self) -> torch.Tensor:
        """[rows] int64: absolute position of the produced token."""
        return self._params.sample_positions[self._req] + self._params.local_step


def expand_rows(params: RowParams, vocab: int, *, expand: bool = False) -> SamplingRows:
    """Each row's controls from its request's; `vocab` turns top_k off at >= V.

    Parameters: `params` per-request tensors plus `row_to_req` / `local_step`
    [rows] int64, all on one device; `vocab` the logits' width V.
    Returns: `SamplingRows` on the same device, each control expanded when
    first read (`expand`: the common ones at once). Capture-safe.
    """
    return SamplingRows(params, vocab, expand=expand)
