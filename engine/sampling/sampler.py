"""The sampler (docs/contract.md §2): its configuration and its entry point.

`sample` takes whole rows of logits and decides every row inside the call,
whatever its values; nothing is left to a later eager pass. Its stages, in
vLLM V1's order, read in one function: `engine.sampling.pipeline.run_stages`
(the order and where each stage lives are listed there). Here: the
argmax-only variant and the slicing of a large batch into row chunks; which
stages a variant runs (`SamplerConfig`, one per kind of CPU step) is declared in
`engine.sampling.sampler_config` and re-exported here.
"""
from __future__ import annotations

import torch

from engine.sampling.errors import PLACEHOLDER_TOKEN, RowError, row_errors
from engine.sampling.pipeline import TORCH_STAGES, ControlRows, TorchStages, run_stages
from engine.sampling.row_max import first_max
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler_config import LOGPROBS_MODES, STAGES, TOP_K_MODES, SamplerConfig
from engine.sampling.token_bitmask import apply_token_bitmask

__all__ = ["LOGPROBS_MODES", "STAGES", "TOP_K_MODES", "SamplerConfig", "controlled_scores", "sample"]

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


def _greedy(raw: torch.Tensor, params: RowParams, out: SampleOutput) -> SampleOutput:
    """The "greedy" stage: every row greedy, none suppressed, no controls, no logprobs:
    the argmax (ties to the smallest id), the forced token, the finite check, and
    nothing else (the logprob fields stay untouched). `raw` [rows, V] f32. Capture-safe."""
    best, token = first_max(raw)  # the first of the largest; NaN and +inf show in `best`
    # Without suppression or controls a row always has a token: only the finite check can fail it.
    error = row_errors(raw, None, row_max=best)
    forced = params.forced_tokens
    out.tokens.copy_(torch.where(error == RowError.OK, torch.where(forced >= 0, forced, token), PLACEHOLDER_TOKEN))
    out.error.copy_(error)
    out.needs_exact.fill_(False)
    return out


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
    top-N of the rows untouched. `controls`: the rows' sampling controls
    (penalties, logit bias, allowed tokens; `pipeline.ControlRows`), applied
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
    int64, top_ids / top_logprobs [rows, N], needs_exact [rows] bool (always
    False: every row is decided here), error [rows] int64 (`RowError`;
    nonzero rows hold the placeholder).
    Raises: ValueError when top-N exceeds V, or both `controls` and `unprocessed` are given.

    No host syncs, no data-dependent shapes, no generator state, and the same
    work whatever the values: a flat row costs what a peaked one does.
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
            return _greedy(logits.to(torch.float32), params, out)  # no [rows, V] temporaries: no slices
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
