"""Per-row sampling controls: the per-request `RowParams` expanded to sample rows.

Every stage reads a row's controls from `SamplingRows`, never from the
per-request arrays: row r belongs to request `row_to_req[r]` and produces the
token at position `sample_positions[request] + local_step[r]`
(docs/contract.md §1.2).

EOS / stop-id suppression (docs/contract.md §2) lives here, as it reads only the
rows' stop ids. While a request has generated fewer than `min_tokens` tokens, its rows flagged
in `eos_suppression_rows` give the EOS / stop ids -inf (EOS even under
`ignore_eos`, as vLLM). One definition, `suppressed_at`, decides whether a
(row, token id) pair is suppressed; the sampler applies it to whole rows in
place (`suppress_stop_ids_`, undone by `StopSlots.restore`; verification to a
copy, `suppressed_scores`).

Duplicate slots. A row's stop-id slots may name the same id twice, and a
padding slot (-1, clamped to 0) lands on token 0 even when 0 is a real,
suppressed stop id. Scatter order is unspecified on CUDA, so every scatter
of a verdict writes a value that depends only on the target token, never on
which slot wrote it: duplicates always agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
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

    def __init__(self, params: RowParams, vocab: int, *, expand: bool = False, greedy: bool = True,
                 stops: bool = True, forced: bool = True, scaled: bool = True) -> None:
        self._params = params
        self._vocab = vocab
        self._req = params.row_to_req
        # What the rows may hold (`SamplerConfig.greedy_rows`, `stop_rows`, `forced_rows`,
        # `scaled_rows`): where the host knows no row does, the control is None and the stages
        # skip it.
        self._may = (greedy, stops, forced, scaled)
        if expand:
            self._common()

    def _common(self) -> dict[str, torch.Tensor | None]:
        """The controls every sampled row reads, into the instance (where the cached
        properties below find them first)."""
        params = self._params
        may_greedy, may_stop, may_force, may_scale = self._may
        raw = params.temperatures[self._req] if may_greedy or may_scale else None
        greedy = raw == 0 if may_greedy else None
        stop = params.stop_ids[self._req] if may_stop else None
        common = {
            "greedy": greedy,
            "temperature": None if not may_scale else raw if greedy is None else torch.where(greedy, 1.0, raw),
            "stop_ids": None if stop is None else stop.clamp(min=0),
            "stop_active": None if stop is None else params.eos_suppression_rows[:, None] & (stop >= 0),
            "forced": params.forced_tokens if may_force else None,
            "uniform": params.draw_uniforms,
        }
        for name, value in common.items():
            self.__dict__.setdefault(name, value)  # a control `replace` put in stays
        return common

    greedy = _common_control("greedy", "[rows] bool: temperature 0 (None: no row is greedy)")
    temperature = _common_control("temperature", "[rows] f32, 1 for greedy rows (None: every row's is 1)")
    stop_ids = _common_control("stop_ids", "[rows, S] int64, clamped to >= 0 (None: no row suppresses one)")
    stop_active = _common_control("stop_active", "[rows, S] bool: this id is suppressed on this row (None: none is)")
    forced = _common_control("forced", "[rows] int64, -1 = none (None: no row has one)")
    uniform = _common_control("uniform", "[rows] f64: the draw's uniform, hashed on the host (None: not staged)")

    def replace(self, **controls: torch.Tensor) -> SamplingRows:
        """The same rows with the given controls in place of their own (tests plant bugs this way)."""
        known = {name for name in dir(type(self)) if not name.startswith("_")} - {"replace", "params"}
        unknown = sorted(set(controls) - known)
        if unknown:
            raise ValueError(f"controls {unknown}: SamplingRows has no such control")
        greedy, stops, forced, scaled = self._may
        rows = SamplingRows(self._params, self._vocab, greedy=greedy, stops=stops, forced=forced, scaled=scaled)
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
        return _not_greedy((self._top_k > 0) & (self._top_k < self._vocab), self.greedy)

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
        return _not_greedy(self.top_p < 1, self.greedy)

    @cached_property
    def min_p(self) -> torch.Tensor:
        """[rows] f32, as `RowParams.min_ps` holds it (compared with float32 weights as it is)."""
        return self._params.min_ps[self._req]

    @cached_property
    def m_on(self) -> torch.Tensor:
        """[rows] bool: min-p on (> 0, and not greedy)."""
        return _not_greedy(self.min_p > 0, self.greedy)

    @cached_property
    def seed(self) -> torch.Tensor:
        """[rows] int64 holding uint64 bits."""
        return self._params.seeds[self._req]

    @cached_property
    def position(self) -> torch.Tensor:
        """[rows] int64: absolute position of the produced token."""
        return self._params.sample_positions[self._req] + self._params.local_step


def _not_greedy(on: torch.Tensor, greedy: torch.Tensor | None) -> torch.Tensor:
    """`on` [rows] bool but on greedy rows (`greedy` None: there are none)."""
    return on if greedy is None else on & ~greedy


def expand_rows(params: RowParams, vocab: int, *, expand: bool = False, greedy: bool = True, stops: bool = True,
                forced: bool = True, scaled: bool = True) -> SamplingRows:
    """Each row's controls from its request's; `vocab` turns top_k off at >= V.

    Parameters: `params` per-request tensors plus `row_to_req` / `local_step`
    [rows] int64, all on one device; `vocab` the logits' width V.
    Returns: `SamplingRows` on the same device, each control expanded when
    first read (`expand`: the common ones at once); `greedy`, `stops`, `forced`, `scaled`
    False where no row is greedy, suppresses its stop ids, has a forced token, or has a
    temperature other than 1 (those controls are then None). Capture-safe.
    """
    return SamplingRows(params, vocab, expand=expand, greedy=greedy, stops=stops, forced=forced, scaled=scaled)


def suppressed_at(ids: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Whether each token id is suppressed on its row.

    Parameters: `ids` [rows, M] int64 token ids (a row's own stop-id slots); `rows` the rows' controls. Returns: [rows, M] bool.
    Capture-safe.
    """
    return ((ids[:, :, None] == rows.stop_ids[:, None, :]) & rows.stop_active[:, None, :]).any(-1)


def suppressed_scores(scores: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """`scores` [rows, V] f32 with suppressed stop ids at -inf: a new tensor
    (a copy and a scatter of the few stop-id slots). Capture-safe."""
    vocab = scores.shape[1]
    slots = rows.stop_ids.clamp(max=vocab - 1)  # [rows, S]
    # Every slot naming the same token writes the same value (see above).
    value = torch.where(suppressed_at(slots, rows), -math.inf, scores.gather(1, slots))
    return scores.clone().scatter_(1, slots, value)


@dataclass
class StopSlots:
    """The stop-id slots `suppress_stop_ids_` wrote, and what they held before."""

    scores: torch.Tensor  # [rows, V] f32: the suppressed scores (the caller's, or a copy)
    slots: torch.Tensor  # [rows, S] int64: each row's stop ids, clamped into the vocabulary
    before: torch.Tensor  # [rows, S] f32: the scores at the slots before (NaN and inf as they were)

    def restore(self) -> None:
        """Write the slots' values back into `scores` (a duplicate slot writes the one value
        it read); capture-safe. After it, `scores` are what `suppress_stop_ids_` was given."""
        self.scores.scatter_(1, self.slots, self.before)


def suppress_stop_ids_(scores: torch.Tensor, rows: SamplingRows) -> StopSlots:
    """`suppressed_scores` without the copy: the suppressed stop ids of `scores` [rows, V]
    f32 set to -inf in place (a gather and a scatter of the few stop-id slots). A whole-row
    copy costs about as much as `exp` over the rows on a CPU (1 ms per [64, 49152]). A
    `scores` whose rows are not dense in memory gets `suppressed_scores`' copy instead.
    Returns: `StopSlots`: the suppressed scores (`scores` itself, or the copy), and what
    its `restore` needs to give `scores` its values back. Capture-safe."""
    vocab = scores.shape[1]
    slots = rows.stop_ids.clamp(max=vocab - 1)  # [rows, S]
    before = scores.gather(1, slots)
    if not scores.is_contiguous():
        return StopSlots(suppressed_scores(scores, rows), slots, before)
    # Duplicate slots name one token, so they gather, suppress and restore one value.
    scores.scatter_(1, slots, torch.where(suppressed_at(slots, rows), -math.inf, before))
    return StopSlots(scores, slots, before)
