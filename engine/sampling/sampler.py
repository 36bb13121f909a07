"""The sampler (docs/contract.md §2): its stages in vLLM V1's order, in one function
(`run_stages`), and its entry point (`sample`).

`sample` takes whole rows of logits and decides every row inside the call, whatever their
values; nothing is left to a later eager pass. It adds the argmax-only variant and the
slicing of a large batch into row chunks; which stages a variant runs (`SamplerConfig`,
one per kind of CPU step) is declared in `engine.sampling.sampler_config` and re-exported
here.

Each stage group is a method of a stage strategy, and each has two implementations, side by
side in this table: `TorchStages` (torch ops: the CPU path, and the reference any other
implementation must agree with) and `engine.step.kernel_step.TritonStages` (the kernel
head's CUDA step: one Triton custom op per group, over the head's static buffers).

    stage                          torch ops (TorchStages)               Triton (TritonStages)
    1     fp32 logits              the LM head's rows; with controls a   the head's buffer, left
                                   copy kept (ControlRows.unprocessed)   unprocessed
    2     forced token             `rows.forced`, read by the draw (13)  read by the kernel of 8-14
    3-7   logits_processors        one call per stage:                   engine::apply_controls:
      3     allowed tokens           allowed_tokens.py                     one pass per row; a row
      4     token bitmask            token_bitmask.py (structured          without controls, stop
                                     output, bad words)                    ids or bitmask skips
      5     EOS / stop suppression   rows.py (under min_tokens,            (kernels/controls_kernel.py)
                                     even with ignore_eos)
      6     logit bias               logit_bias.py
      7     penalties                penalties.py (repetition,
                                     frequency, presence)
    8-14  sample_rows              in order:                             engine::sample_rows: one
      8     greedy                   thresholds.py first_max (the argmax,  program per row; a greedy
                                     temperature 0)                        row makes one pass
      9-12  kept_set: temperature,   thresholds.py (radix select);         (kernels/sample.py,
            min-p, top-k, top-p      filters.py (the reference's walk)     kept_set.py, top_n.py)
      13    draw                     draw.py (inverse CDF over the kept
                                     weights), then each row's error
      14    logprobs                 logprobs.py (raw or processed)

Stages 3 to 7 are vLLM's logits processors and run as one group; 9 to 12 are
the kept set. vLLM applies the structured-output bitmask before the allowed
tokens and the bad words after them: our bitmask carries both, and since
every mask only sets -inf, which no later stage of the group changes (a bias
or a penalty leaves -inf as it is), one place serves both. It comes after
the allowed tokens, so that a row whose bitmask leaves none of its allowed
tokens fails as the bitmask's (`RowError.NO_TOKEN_ALLOWED`).

Another implementation subclasses `TorchStages` and overrides the groups it fuses,
with the same signatures: the reference path's sorted walk
(`engine.sampling.exact.ReferenceStages`) overrides the kept set; the kernel head's
`TritonStages` overrides `logits_processors` and `sample_rows`, one kernel each (the
temperature is not a pass of its own there: the sampler's kernel computes (s - M) / T
in the passes it makes anyway). The CPU steps' sampler variants
(`SamplerConfig.stages`, `top_k`, `top_p`, `logprobs`, and what the step's rows may hold:
`greedy_rows`, `stop_rows`, `forced_rows`, `scaled_rows`) choose which torch stages run;
the kernels branch per row on the device instead.

Failed rows (docs/contract.md §2), `RowError`: a row whose logits hold NaN or +-inf,
whose controls turn a finite logit into +inf or NaN, or whose controls leave no token
(every token a suppressed stop id), gets an error code in `SampleOutput.error`, decided
inside the captured step from the row itself. Its outputs are the placeholder: token
`PLACEHOLDER_TOKEN` (in the vocabulary, so nothing downstream indexes out of range),
logprob 0, rank 0, top ids -1, top logprobs 0. The caller must not emit it.
Every sampling computation is per row, so a failed row changes no other
row's bits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch

from engine.sampling.allowed_tokens import apply_allowed_tokens_
from engine.sampling.draw import drawn_token, inverse_cdf_draw, plain_uniform
from engine.sampling.logit_bias import apply_logit_bias_
from engine.sampling.logprobs import RowLogprobs, processed_row_logprobs, raw_logprobs
from engine.sampling.penalties import apply_penalties_
from engine.sampling.row_params import RowParams
from engine.sampling.rows import SamplingRows, StopSlots, expand_rows, suppress_stop_ids_
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler_config import LOGPROBS_MODES, STAGES, TOP_K_MODES, SamplerConfig
from engine.sampling.thresholds import RowDistribution, first_max, row_distribution
from engine.sampling.token_bitmask import apply_token_bitmask

__all__ = ["LOGPROBS_MODES", "PLACEHOLDER_TOKEN", "STAGES", "TOP_K_MODES", "RowError", "SamplerConfig", "controlled_scores",
           "fail_rows", "sample"]


class RowError(IntEnum):
    """`SampleOutput.error` codes (int64 on the device)."""

    OK = 0
    LOGITS_NOT_FINITE = 1  # a NaN or +-inf logit in the row
    NOTHING_LEFT = 2  # the controls leave no token (EOS / stop suppression covers the vocabulary)
    HIDDEN_NOT_FINITE = 3  # set by the caller that owns the hidden states (`fail_rows`)
    NO_TOKEN_ALLOWED = 4  # the token bitmask (structured output, bad words) allows no token
    SCORES_NOT_FINITE = 5  # the controls turned a finite logit into +inf or NaN (a penalty near 0, a huge bias)


PLACEHOLDER_TOKEN = 0  # the token of a failed row: in the vocabulary, never emitted


def row_errors(raw: torch.Tensor, nothing_left: torch.Tensor | None, nothing_allowed: torch.Tensor | None = None,
               row_max: torch.Tensor | None = None, scores_max: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's `RowError`: logits not finite first, then processed scores not
    finite, then nothing allowed by the token bitmask, then nothing left.

    Parameters: `raw` [rows, V] f32 logits; `nothing_left` [rows] bool, rows
    whose controls leave no token, or None where no row can run out;
    `nothing_allowed` [rows] bool or None, rows whose token bitmask allows
    none; `row_max` [rows] f32, `raw`'s row maximum (NaN where a NaN is in
    the row) when the caller has it; `scores_max` [rows] f32, the processed
    scores' row maximum (+inf or NaN: a control overflowed), or None. Returns:
    [rows] int64 codes. Capture-safe.
    """
    finite = finite_rows(raw, raw.amax(-1) if row_max is None else row_max)
    left = int(RowError.OK) if nothing_left is None else torch.where(nothing_left, int(RowError.NOTHING_LEFT), int(RowError.OK))
    if nothing_allowed is not None:
        left = torch.where(nothing_allowed, int(RowError.NO_TOKEN_ALLOWED), left)
    if scores_max is not None:
        left = torch.where(scores_max < math.inf, left, int(RowError.SCORES_NOT_FINITE))  # NaN compares False
    return torch.where(finite, left, int(RowError.LOGITS_NOT_FINITE))


def finite_rows(raw: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """[rows] bool: every logit of `raw` [rows, V] f32 is finite, given its row maximum
    `row_max` [rows] (NaN where a NaN is in the row). amax and amin propagate NaN, and an
    infinity is an extreme: two fast reductions and two comparisons settle it (a NaN
    compares False), where `isfinite` is five ops each."""
    return (row_max < math.inf) & (raw.amin(-1) > -math.inf)


def write_placeholders(out: SampleOutput, failed: torch.Tensor) -> None:
    """The placeholder outputs on `failed` rows [rows] bool of `out`; capture-safe."""
    out.tokens.masked_fill_(failed, PLACEHOLDER_TOKEN)
    out.logprob.masked_fill_(failed, 0.0)
    out.rank.masked_fill_(failed, 0)
    out.top_ids.masked_fill_(failed[:, None], -1)
    out.top_logprobs.masked_fill_(failed[:, None], 0.0)


def fail_rows(out: SampleOutput, failed: torch.Tensor, code: RowError) -> None:
    """Mark `failed` rows [rows] bool with `code` (overriding the sampler's
    own code) and write the placeholder outputs; capture-safe. For failures
    the sampler cannot see, such as a non-finite hidden state."""
    out.error.masked_fill_(failed, int(code))
    write_placeholders(out, failed)


@dataclass(frozen=True)
class ControlRows:
    """The sampling controls of each sample row (stages 3, 6, 7), on the logits' device:
    the step's control state gathered by row (`engine.step.control_state.SamplingControls.rows`)."""

    counts: torch.Tensor  # [rows, V] int32: times each token was generated before the row (drafts included)
    prompt_words: torch.Tensor  # [rows, ceil(V/32)] int32: the prompt's tokens, packed
    penalties: torch.Tensor  # [rows, 3] f32: repetition, frequency, presence (1, 0, 0 = off)
    bias_ids: torch.Tensor  # [rows, L] int64, padding token 0
    bias_values: torch.Tensor  # [rows, L] f32, padding 0.0
    allowed_words: torch.Tensor  # [rows, ceil(V/32)] int32: the allowed set, packed
    restricted: torch.Tensor  # [rows] bool: the allowed set applies
    unprocessed: torch.Tensor  # [rows, V] f32: where the logits before the processors are kept

    def row_slice(self, start: int, stop: int) -> ControlRows:
        """Rows [start, stop) of every field (views)."""
        return ControlRows(*(getattr(self, name)[start:stop] for name in self.__dataclass_fields__))


@dataclass
class ProcessedScores:
    """What the logits processors (stages 3-7) hand the later stages."""

    scores: torch.Tensor  # [rows, V] f32: the processed scores, masked tokens at -inf
    nothing_allowed: torch.Tensor | None  # [rows] bool: the bitmask leaves nothing (None: no bitmask)
    stops: StopSlots | None  # the suppressed stop-id slots and what `scores` held there (None: not lent)
    # Whether `scores` are the caller's raw logits, which must get their stop-id
    # slots back once the later stages have read the scores (`finish`).
    borrowed: bool
    # [rows] bool: the rows `scores` holds; the others' scores are their logits as they are
    # (the controls kernel skips a row without controls). None: `scores` holds every row.
    row_controlled: torch.Tensor | None = None

    def finish(self) -> None:
        """After the last read of `scores`: the caller's logits are its own again."""
        if self.borrowed:
            self.stops.restore()


class TorchStages:
    """Every stage group by torch ops: the CPU path, and the reference any other
    implementation must agree with. The groups `run_stages` calls are
    `logits_processors` (3-7) and `sample_rows` (8-14), which calls `kept_set` (9-12)
    and `logprobs` (14). Another implementation subclasses it and overrides the groups
    it fuses, with the same signatures: one that overrides `kept_set` or `logprobs`
    alone keeps this order of 8-14 around them."""

    expands_rows = True  # the rows' common controls at once: every torch-sampled row reads them

    def logits_processors(self, raw: torch.Tensor, rows: SamplingRows, controls: ControlRows | None,
                          token_bitmask: torch.Tensor | None) -> ProcessedScores:
        """Stages 3-7, one call each. `raw` [rows, V] f32 is processed in place when
        the controls kept a copy of it (`controls.unprocessed`), so the caller's logits
        end up holding the processed scores, which verification reads afterwards; else
        the bitmask masks a copy, and the stop ids `raw` lends are given back by
        `ProcessedScores.finish`. `token_bitmask` [rows, ceil(V/32)] int32 or None.
        Capture-safe."""
        owned = controls is not None  # `raw` may be written for good
        scores, nothing_allowed = raw, None
        if owned:
            apply_allowed_tokens_(scores, controls.allowed_words, controls.restricted)  # 3
        if token_bitmask is not None:
            scores, nothing_allowed = apply_token_bitmask(scores, token_bitmask, in_place=owned)  # 4
        stops = None if rows.stop_ids is None else suppress_stop_ids_(scores, rows)  # 5
        scores = scores if stops is None else stops.scores
        if owned:
            apply_logit_bias_(scores, controls.bias_ids, controls.bias_values)  # 6
            pen = controls.penalties
            apply_penalties_(scores, controls.counts, controls.prompt_words, pen[:, 0], pen[:, 1], pen[:, 2])  # 7
        return ProcessedScores(scores, nothing_allowed, stops, borrowed=stops is not None and scores is raw and not owned)

    def sample_rows(self, processed: ProcessedScores, plain: torch.Tensor, rows: SamplingRows, cfg: SamplerConfig,
                    out: SampleOutput, mode: str | None) -> None:
        """Stages 8-14 in order, into `out`: the argmax (8), the kept set (9-12, `kept_set`;
        a variant of `cfg` without filters skips what its rows do not need), the draw (13),
        the rows' errors, the logprobs (14, `logprobs` in `mode`: "raw", "processed", or None
        for none). `plain` [rows, V] f32: the logits before the processors (the finite check
        and raw logprobs read them). The caller's logits are given back
        (`ProcessedScores.finish`) once the scores are read, raising or not. Capture-safe."""
        d = None
        try:
            if rows.greedy is None:  # no row reads the argmax: the maximum alone
                best, greedy = processed.scores.amax(-1), None
            else:
                best, greedy = first_max(processed.scores)  # 8: the first of the largest, ties to the smallest id
            if cfg.stages != "greedy" or mode == "processed":  # processed logprobs need the kept set
                # A variant without filters serves rows that have none (greedy rows never do).
                d = self.kept_set(processed.scores, best, rows, filters=cfg.stages == "filters",  # 9-12
                                  top_k=cfg.top_k, top_k_width=cfg.candidate_cap, top_p=cfg.top_p,
                                  kept_set=mode == "processed")
        finally:
            processed.finish()
        drawn = greedy if cfg.stages == "greedy" else inverse_cdf_draw(d.weights, d.block_mass, plain_uniform(rows))
        token = drawn_token(rows, greedy, drawn)  # 13, the forced token overriding both
        # No valid token: an all -inf row's maximum is -inf. A NaN row's picks may be
        # anything in the vocabulary: the placeholder replaces them.
        row_max = None  # the finite check's row maximum of `plain`: one more pass over the rows
        untouched = processed.scores is plain and processed.stops is None  # no stage removed a token
        if untouched:
            row_max = best
        elif processed.scores is plain:
            # The scores are `plain` but at the stop-id slots: their values and `best` give
            # plain's maximum (NaN and +inf included: both reductions and `maximum` propagate NaN).
            row_max = torch.maximum(best, processed.stops.before.amax(-1))
        # A control may overflow a finite logit to +inf (or make a NaN): `best` shows both. Where
        # no stage removed a token, a row with nothing left is a row of -inf: not finite.
        error = row_errors(plain, None if untouched else best == -math.inf, processed.nothing_allowed,
                           row_max=row_max, scores_max=None if processed.scores is plain else best)
        failed = error != RowError.OK
        if mode is not None:
            token = torch.where(failed, PLACEHOLDER_TOKEN, token)
            self.logprobs(mode, d, plain, token, out.top_ids.shape[1]).write(out)  # 14
        out.tokens.copy_(token)
        out.error.copy_(error)
        write_placeholders(out, failed)

    def kept_set(self, masked: torch.Tensor, best: torch.Tensor, rows: SamplingRows, *, filters: bool, top_k: str,
                 top_k_width: int, top_p: bool, kept_set: bool) -> RowDistribution:
        """Stages 9-12, temperature -> min-p -> top-k -> top-p, by radix select over
        whole rows (`thresholds.row_distribution`, its parameters)."""
        return row_distribution(masked, best, rows, filters=filters, top_k=top_k, top_k_width=top_k_width,
                                top_p=top_p, kept_set=kept_set)

    def logprobs(self, mode: str, d: RowDistribution | None, plain: torch.Tensor, tokens: torch.Tensor,
                 num_top: int) -> RowLogprobs:
        """Stage 14: "processed", of the distribution each row drew from (`d`, with its
        kept set); "raw", of the unprocessed logits `plain` [rows, V] f32."""
        if mode == "processed":
            return processed_row_logprobs(d, tokens, num_top)
        return raw_logprobs(plain, tokens, num_top)


TORCH_STAGES = TorchStages()


def run_stages(
    logits: torch.Tensor,
    params: RowParams,
    cfg: SamplerConfig,
    out: SampleOutput,
    *,
    compute_logprobs: bool,
    controls: ControlRows | None = None,
    unprocessed: torch.Tensor | None = None,
    token_bitmask: torch.Tensor | None = None,
    stages: TorchStages = TORCH_STAGES,
) -> SampleOutput:
    """Every stage over whole rows, in order, each group by `stages` (the table above):
    `engine.sampling.sampler.sample`'s body (same parameters) for one slice of rows, and
    the kernel head's for one bucket (`TritonStages`, no `controls`: its kernel reads the
    control slots itself). Capture-safe."""
    raw = logits if logits.dtype == torch.float32 else logits.to(torch.float32)  # 1: [rows, V]
    if controls is not None:
        unprocessed = controls.unprocessed.copy_(raw)
    # The finite check and raw logprobs read the logits before any processor.
    plain = raw if unprocessed is None else unprocessed.to(torch.float32)  # [rows, V]
    rows = expand_rows(params, logits.shape[1], expand=stages.expands_rows, greedy=cfg.greedy_rows,  # 2: the forced
                       stops=cfg.stop_rows, forced=cfg.forced_rows, scaled=cfg.scaled_rows)  # token is among them
    processed = stages.logits_processors(raw, rows, controls, token_bitmask)  # 3-7
    mode = cfg.logprobs_mode if compute_logprobs and cfg.logprobs else None
    stages.sample_rows(processed, plain, rows, cfg, out, mode)  # 8-14
    return out


# The most elements ([rows, V]) one row slice holds where the config slices rows
# (`chunk_rows` > 0: on a CPU). Every stage makes [rows, V] temporaries, and past a few
# MiB each comes as fresh pages from the OS, faulted in on every call: on 2 Zen 4 cores
# (thread CPU time, 64 rows, load about 10) the plain draw at V = 128256 took 57 ms in
# slices of 64 rows, 30 ms in 32 or 16; top-p, whose radix passes add float64 masses and
# int32 keys, 354 ms in 64, 176 ms in 8 (at V = 49152: 121 ms in 64, 67 ms in 16). Rows are
# independent, so the slicing changes no bit.
SLICE_ELEMENTS = 1 << 22  # the draw alone (greedy, plain, min-p)
SLICE_ELEMENTS_CUTS = 1 << 20  # with a top-k or top-p cut


def controlled_scores(raw: torch.Tensor, token_bitmask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`raw` after the token bitmask, as verification reads the logits a step
    sampled from (the bitmask and the suppression are applied again there:
    both change nothing the second time).

    Parameters: `raw` [rows, V] f32 logits; `token_bitmask` [rows, ceil(V /
    32)] int32 or None (no row restricted). Returns: the scores [rows, V] f32
    (`raw` itself without a bitmask) and [rows] bool, the rows the bitmask
    leaves nothing to sample (None without a bitmask). Capture-safe.
    """
    if token_bitmask is None:
        return raw, None
    return apply_token_bitmask(raw, token_bitmask)


def _greedy(raw: torch.Tensor, params: RowParams, cfg: SamplerConfig, out: SampleOutput) -> SampleOutput:
    """The "greedy" stage: every row greedy, none suppressed, no controls, no logprobs:
    the argmax (ties to the smallest id), the forced token, the finite check, and
    nothing else (the logprob fields stay untouched). `raw` [rows, V] f32. Capture-safe."""
    best, token = first_max(raw)  # the first of the largest; NaN and +inf show in `best`
    # Without suppression or controls a row always has a token: only the finite check can fail
    # it, and a failed row's code is 1 and its token 0. One op writes each, where a `where`
    # and a copy are two.
    finite = finite_rows(raw, best)
    if cfg.forced_rows:
        token = torch.where(params.forced_tokens >= 0, params.forced_tokens, token)
    torch.mul(token, finite, out=out.tokens)  # PLACEHOLDER_TOKEN (0) on a failed row
    torch.logical_not(finite, out=out.error)  # RowError.LOGITS_NOT_FINITE (1) on a failed row
    return out


assert PLACEHOLDER_TOKEN == 0 and RowError.LOGITS_NOT_FINITE == 1  # `_greedy` writes them as 0 and 1


def sample(
    logits: torch.Tensor,
    params: RowParams,
    cfg: SamplerConfig,
    out: SampleOutput | None = None,
    *,
    compute_logprobs: bool = True,
    controls: ControlRows | None = None,
    unprocessed: torch.Tensor | None = None,
    token_bitmask: torch.Tensor | None = None,
    stages: TorchStages = TORCH_STAGES,
) -> SampleOutput:
    """Sample one token per row; capture-safe.

    Parameters: `logits` [rows, V] (any float dtype, read as f32) on the
    sampling device; `params` their controls (same device); `cfg` the
    sampler's; `out` preallocated outputs (None: allocated, top-N =
    cfg.max_logprobs). `compute_logprobs=False` leaves logprob, rank and
    top-N of the rows untouched (a failed row's get the placeholder's). `controls`: the rows' sampling controls
    (penalties, logit bias, allowed tokens; `ControlRows`), applied
    here: an f32 `logits` is then processed in place, and holds the
    processed scores when the call returns (everything before the greedy
    stage: what verification reads), its values before them kept in
    `controls.unprocessed`. Without `controls`, an f32 `logits` is written
    during the call at the suppressed stop ids and holds its own values again
    when it returns, raising or not. `unprocessed` [rows, V] f32: the logits
    before the controls, when `logits` already hold the processed ones (the
    reference path redoing rows of such a step); the finiteness check and raw
    logprobs read it. `token_bitmask` [rows, ceil(V / 32)] int32 or None: the
    rows' allowed tokens (`token_bitmask.py`). `stages`: the implementation
    of each stage group (the reference path passes its sorting walk).
    Returns: `out`: tokens [rows] int64, logprob [rows] f32, rank [rows]
    int64, top_ids / top_logprobs [rows, N], error [rows] int64 (`RowError`;
    nonzero rows hold the placeholder). Every row is decided here.
    Raises: ValueError when top-N exceeds V, or both `controls` and `unprocessed` are given.

    No host syncs, no data-dependent shapes, no generator state, and the same
    work whatever the values: a flat row costs what a peaked one does. One
    exception, on a CPU only, where nothing is captured: a draw whose only cut
    is min-p weighs the blocks min-p may keep (`thresholds._min_p_candidates`),
    so a row keeping more blocks costs more; the bits are the same.
    """
    rows_n, vocab = logits.shape
    if out is None:
        out = SampleOutput.allocate(rows_n, cfg.max_logprobs, logits.device)
    num_top = out.top_ids.shape[1]
    if num_top > vocab:
        raise ValueError(f"top-N={num_top}: exceeds the vocabulary V={vocab}")
    if controls is not None and unprocessed is not None:
        raise ValueError("controls and unprocessed: give the controls to apply, or the logits before them, not both")
    # Inference mode: no stage needs autograd's bookkeeping, which a one-row call pays on each
    # of its ~100 small ops (7 to 10% of the plain and min-p draws at [1, 49152]). `out` is
    # made outside it: the caller may write into it afterwards.
    with torch.inference_mode():
        if (cfg.stages == "greedy" and controls is None and unprocessed is None and token_bitmask is None
                and not (compute_logprobs and cfg.logprobs)):
            return _greedy(logits.to(torch.float32), params, cfg, out)  # no [rows, V] temporaries: no slices
        chunk = rows_n
        if cfg.chunk_rows:
            cuts = cfg.stages == "filters" and (cfg.top_p or cfg.top_k != "none")
            chunk = min(rows_n, cfg.chunk_rows, max(1, (SLICE_ELEMENTS_CUTS if cuts else SLICE_ELEMENTS) // vocab))
        for start in range(0, rows_n, chunk):  # rows are independent: the same bits in slices
            stop = min(start + chunk, rows_n)
            whole = start == 0 and stop == rows_n
            run_stages(logits if whole else logits[start:stop], params if whole else params.row_slice(start, stop),
                       cfg, out if whole else out.row_slice(start, stop), compute_logprobs=compute_logprobs,
                       controls=None if controls is None else controls.row_slice(start, stop),
                       unprocessed=None if unprocessed is None else unprocessed[start:stop],
                       token_bitmask=None if token_bitmask is None else token_bitmask[start:stop], stages=stages)
    return out
