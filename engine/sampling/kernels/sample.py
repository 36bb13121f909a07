"""The sampler on CUDA: `sample_rows` (torch op `engine::sample_rows`) launches the kernel
(`engine.sampling.kernels.sample_kernel`, whose docstring has the design) over a bucket's rows,
split over the GPU's programs where the rows are few, with its preallocated scratch
(`SampleScratch`), and lists the kernel's ahead-of-time builds for sm_90 (`AOT_BUILDS`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch.library import triton_op, wrap_triton

from engine.sampling.sampler import RowError
from engine.sampling.kernels import FP_FUSION, interpreting
from engine.sampling.kernels.controls import PassOne
from engine.sampling.kernels.kept_set import HIST_BINS, LIST_CAP
from engine.sampling.thresholds import BLOCK, mass_bits
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from engine.sampling.kernels.sample_kernel import (GPU_CHUNK, LOGPROBS_MODES, MAX_PROGRAMS, NUM_WARPS, PHASES, STATE_COLS,
                                                  sample_kernel)


@dataclass
class SampleScratch:
    """The kernel's working memory, allocated once for the largest bucket (fixed shapes:
    capture-safe). Every buffer but the row state is zero between launches."""

    hist: torch.Tensor  # [rows, HIST_BINS] int64: one histogram of one radix digit per row
    block_mass: torch.Tensor  # [rows, ceil(V / BLOCK)] int64: the kept masses per block of the draw
    state_i: torch.Tensor  # [rows, STATE_COLS] int64: the row's state between phases (best id, error, cuts...)
    state_f: torch.Tensor  # [rows, 2] f32: the row's masked maximum M and its logits' maximum
    level: torch.Tensor  # [rows] f64: the radix select's level
    part_i: torch.Tensor  # [slots, 4] int64: each program's partials (best id, not finite, mass, rank count)
    part_f: torch.Tensor  # [slots, 2] f32: each program's partial maxima
    part_top: torch.Tensor  # [slots, top] int64: each program's top-N rank keys
    row_top: torch.Tensor  # [rows, top] int64: the row's merged top-N rank keys
    arrivals: torch.Tensor  # [rows] int32: the programs of the row done with the phase (0 between phases)
    kept_list: torch.Tensor  # [rows, LIST_CAP] int32: the ids a cut may keep (`kept_list`; its count in the state)

    @classmethod
    def allocate(cls, rows: int, vocab: int, device: torch.device | str, num_top: int = 0) -> SampleScratch:
        """For up to `rows` rows of V = `vocab` and top-N lists of up to `num_top`."""
        slots = max(rows, MAX_PROGRAMS)
        top = triton.next_power_of_2(max(num_top, 1))
        i64 = dict(dtype=torch.int64, device=device)
        return cls(hist=torch.zeros(rows, int(HIST_BINS), **i64), block_mass=torch.zeros(rows, -(-vocab // BLOCK), **i64),
                   state_i=torch.zeros(rows, STATE_COLS, **i64),
                   state_f=torch.zeros(rows, 2, dtype=torch.float32, device=device),
                   level=torch.zeros(rows, dtype=torch.float64, device=device), part_i=torch.zeros(slots, 4, **i64),
                   part_f=torch.zeros(slots, 2, dtype=torch.float32, device=device),
                   part_top=torch.zeros(slots, top, **i64), row_top=torch.zeros(rows, top, **i64),
                   arrivals=torch.zeros(rows, dtype=torch.int32, device=device),
                   kept_list=torch.zeros(rows, int(LIST_CAP), dtype=torch.int32, device=device))


@dataclass
class KeptWeights:
    """Each row's draw as rejection verification reads it (`engine::verify_step`), preallocated."""

    weights: torch.Tensor  # [rows, V] f32: exp(z) on the kept set, 0 elsewhere
    mass_total: torch.Tensor  # [rows] f64: the kept masses' total
    one_hot_tokens: torch.Tensor  # [rows] int64: the token of a greedy or forced row, -1 otherwise

    @classmethod
    def allocate(cls, rows: int, vocab: int, device: torch.device | str) -> KeptWeights:
        return cls(weights=torch.zeros(rows, vocab, dtype=torch.float32, device=device),
                   mass_total=torch.zeros(rows, dtype=torch.float64, device=device),
                   one_hot_tokens=torch.full((rows,), -1, dtype=torch.int64, device=device))


def _chunk(vocab: int, device: torch.device) -> int:
    """Tokens per step of a pass, whole blocks of the draw: GPU_CHUNK on a CUDA device (the
    dry run's fake one included: its launches are the GPU's); on the host, in the
    interpreter, whose cost is per operation, the whole row up to 16384."""
    if device.type == "cpu":
        return min(16384, max(BLOCK, triton.next_power_of_2(vocab)))
    return GPU_CHUNK if vocab >= GPU_CHUNK else BLOCK


def _launch_constants(vocab: int, num_stop: int, num_top: int, mode: int, separate_logits: bool,
                      has_nothing_allowed: bool, has_row_controlled: bool = False,
                      write_kept: bool = False, device: torch.device = torch.device("cuda")) -> dict[str, object]:
    num_blocks = -(-vocab // BLOCK)
    id_bits = max(1, (vocab - 1).bit_length())
    return dict(V=vocab, NUM_STOP=num_stop, NUM_TOP=num_top, TOP_PAD=triton.next_power_of_2(max(num_top, 1)),
                LOGPROBS=mode, SEPARATE_LOGITS=separate_logits, HAS_NOTHING_ALLOWED=has_nothing_allowed,
                CHUNK=_chunk(vocab, device), BLOCK_TOKENS=BLOCK, NUM_BLOCKS=num_blocks,
                BLOCKS_PAD=triton.next_power_of_2(num_blocks), MASS_BITS=mass_bits(vocab),
                ID_BITS=id_bits, ID_MASK=(1 << id_bits) - 1, ACCURATE=not interpreting(),
                HAS_ROW_CONTROLLED=has_row_controlled, WRITE_KEPT=write_kept)


def split(rows: int, vocab: int, chunk: int, programs: int) -> tuple[int, int]:
    """(parts per row, tokens per part): each row over as many programs as `programs`
    spreads over the rows, in whole chunks of `chunk` tokens, every part non-empty."""
    chunks = -(-vocab // chunk)
    parts = max(1, min(chunks, programs // rows))
    span = -(-chunks // parts) * chunk
    return -(-vocab // span), span


def _parts_pad(vocab: int, chunk: int, parts: int) -> int:
    """The merges' width: 1 for one part, else the most parts a row of V can have, whatever
    the bucket: one build per vocabulary (a narrower one spilled a register on sm_90)."""
    return 1 if parts == 1 else triton.next_power_of_2(-(-vocab // chunk))


def device_programs(device: torch.device) -> int:
    """Programs a launch spreads the rows over: the SMs of a CUDA device (the dry run's fake
    device reports the ones it stands for), at most MAX_PROGRAMS; 1 elsewhere (the
    interpreter: one program per row, unless a caller asks for a split)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return min(MAX_PROGRAMS, torch.cuda.get_device_properties(index).multi_processor_count)


@triton_op("engine::sample_rows", mutates_args={"hist", "block_mass", "tokens", "logprob", "rank", "top_ids",
                                                "top_logprobs", "error", "out_kept_weights",
                                                "mass_total", "one_hot_tokens", "state_i", "state_f", "level",
                                                "part_i", "part_f", "part_top", "row_top", "arrivals", "kept_list"})
def _sample_rows_op(scores: torch.Tensor, logits: torch.Tensor | None, temperatures: torch.Tensor,
                    top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor, row_to_req: torch.Tensor,
                    stop_ids: torch.Tensor, eos_suppression_rows: torch.Tensor, forced_tokens: torch.Tensor,
                    draw_uniforms: torch.Tensor, nothing_allowed: torch.Tensor | None, hist: torch.Tensor,
                    block_mass: torch.Tensor, tokens: torch.Tensor, logprob: torch.Tensor, rank: torch.Tensor,
                    top_ids: torch.Tensor, top_logprobs: torch.Tensor, error: torch.Tensor,
                    logprobs_mode: int, state_i: torch.Tensor, state_f: torch.Tensor,
                    level: torch.Tensor, part_i: torch.Tensor, part_f: torch.Tensor, part_top: torch.Tensor,
                    row_top: torch.Tensor, arrivals: torch.Tensor, kept_list: torch.Tensor, programs: int,
                    row_controlled: torch.Tensor | None = None, out_kept_weights: torch.Tensor | None = None,
                    mass_total: torch.Tensor | None = None, one_hot_tokens: torch.Tensor | None = None,
                    handed_f: torch.Tensor | None = None, handed_i: torch.Tensor | None = None,
                    handed_top: torch.Tensor | None = None, handed_raw: bool = False) -> None:
    rows, vocab = scores.shape
    if rows == 0:
        return
    # `out_kept_weights` (its name tells the cost model): written where a row is drawn, never read.
    kept_weights = out_kept_weights
    plain = scores if logits is None else logits
    write_kept = kept_weights is not None
    constants = _launch_constants(vocab, stop_ids.shape[1], top_ids.shape[1], logprobs_mode, logits is not None,
                                  nothing_allowed is not None, row_controlled is not None, write_kept, scores.device)
    parts, span = split(rows, vocab, constants["CHUNK"], programs)
    handed = handed_f is not None
    # One program per row makes every phase in one launch; a split row needs every part of a
    # phase done before the next phase starts: one launch per phase (the merge of each is the
    # last program of the row to finish it).
    phases = [(0, PHASES - 1)] if parts == 1 else [(phase, phase) for phase in range(PHASES)]
    for first, last in phases:
        wrap_triton(sample_kernel)[(rows, parts)](
            scores, plain, scores.stride(0), plain.stride(0),
            temperatures, top_ks, top_ps, min_ps, row_to_req, stop_ids, stop_ids.stride(0),
            eos_suppression_rows, forced_tokens, draw_uniforms,
            eos_suppression_rows if nothing_allowed is None else nothing_allowed,
            hist, block_mass, hist.stride(0), block_mass.stride(0),
            tokens, logprob, rank, top_ids, top_logprobs, error, top_ids.stride(0),
            eos_suppression_rows if row_controlled is None else row_controlled,  # never read without the flags
            kept_weights if write_kept else scores, mass_total if write_kept else logprob,
            one_hot_tokens if write_kept else tokens, kept_weights.stride(0) if write_kept else 0,
            state_i, state_f, level, part_i, part_f, part_top, row_top, arrivals, kept_list,
            *((handed_f, handed_i, handed_top) if handed else (state_f, state_i, row_top)),  # never read without
            part_top.stride(0), row_top.stride(0), (handed_top if handed else row_top).stride(0), span, parts,
            **constants, FIRST_PHASE=first, LAST_PHASE=last, PARTS_PAD=_parts_pad(vocab, constants["CHUNK"], parts),
            HANDED=handed, HANDED_RAW=handed and handed_raw and logprobs_mode == LOGPROBS_MODES["raw"],
            num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION,
        )


def sample_rows(scores: torch.Tensor, params: RowParams, out: SampleOutput, scratch: SampleScratch, *,
                logits: torch.Tensor | None = None, nothing_allowed: torch.Tensor | None = None,
                logprobs: str | None = None, row_controlled: torch.Tensor | None = None,
                kept: KeptWeights | None = None, programs: int | None = None,
                handed: PassOne | None = None, handed_raw: bool = False) -> SampleOutput:
    """Sample one token per row on the device: `engine.sampling.sampler.sample` in vLLM's
    stage order (temperature, min-p, top-k, top-p), as one kernel launch. Capture-safe.

    Parameters (all on one device, CUDA or, under `TRITON_INTERPRET=1`, CPU):
    - `scores` [rows, V] f32, unit column stride: the controlled scores (penalties, logit
      bias, allowed tokens and the token bitmask applied; EOS/stop suppression is applied
      here, from `params`);
    - `params` `RowParams` with `draw_uniforms` staged ([rows] f64); per-request controls
      (temperatures f32, top_ks int32, top_ps f32, min_ps f32, stop_ids [reqs, S] int64) and
      per-row ones (row_to_req int64, eos_suppression_rows bool, forced_tokens int64);
    - `out` the preallocated `SampleOutput` (rows, top-N = out.top_ids.shape[1]);
    - `scratch` a `SampleScratch` of at least `rows` rows for this V;
    - `logits` [rows, V] f32 or None: the unprocessed logits (the finite check and raw
      logprobs read them; None: `scores` are unprocessed);
    - `nothing_allowed` [rows] bool or None: rows whose token bitmask allows no token;
    - `logprobs` None (logprob, rank and top-N left untouched but on failed rows), "raw" or
      "processed";
    - `row_controlled` [rows] bool or None: per row, whether `scores` holds its controlled
      scores (`engine::apply_controls` wrote it); False: the row reads `logits` (then given)
      as its scores. None: every row reads `scores`;
    - `kept` a `KeptWeights` or None: also write what rejection verification reads of each
      row's draw (its kept weights, kept mass total and one-hot token).
    - `handed` a `PassOne` the controls kernel wrote in this step, or None: each row with
      `row_controlled` takes pass 1's results from it instead of making the pass (its scores
      and logits are read once less); `handed_raw`: the controls kernel summed its raw
      masses and listed its raw top-N too (`apply_controls(raw_top=True, raw_max=...)`): in
      raw mode the row makes no logprob pass where its token is on that list;
    - `programs` the programs to spread the rows over (`split`): None, the device's
      (`device_programs`: its SMs on CUDA); 1 keeps one program per row and one launch.
      Fewer rows than programs split each row, at 9 launches (one per phase). The
      results do not depend on it.
    Returns: `out`, written in place: tokens, error (`RowError`), and
    with logprobs the token's logprob, rank and the top-N; failed rows hold the placeholder.
    Raises: ValueError on a shape, dtype, device or mode that does not fit, a missing
    `draw_uniforms`, or top-N > V.
    """
    if logprobs not in LOGPROBS_MODES:
        raise ValueError(f"logprobs={logprobs!r}: must be one of {sorted(LOGPROBS_MODES, key=str)}")
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores: {tuple(scores.shape)} {scores.dtype} stride {scores.stride()}, "
                         "expected [rows, V] float32 with unit column stride")
    rows, vocab = scores.shape
    if logits is not None and (logits.shape != scores.shape or logits.dtype != torch.float32 or logits.stride(1) != 1):
        raise ValueError(f"logits: {tuple(logits.shape)} {logits.dtype}, expected {tuple(scores.shape)} float32")
    if params.draw_uniforms is None:
        raise ValueError("params.draw_uniforms is None: the kernel reads the staged uniforms ([rows] float64)")
    if params.num_rows != rows or out.tokens.shape[0] != rows:
        raise ValueError(f"rows: scores {rows}, params {params.num_rows}, out {out.tokens.shape[0]}")
    if out.top_ids.shape[1] > vocab:
        raise ValueError(f"top-N={out.top_ids.shape[1]}: exceeds the vocabulary V={vocab}")
    if programs is None:
        programs = device_programs(scores.device)
    if not 1 <= programs <= MAX_PROGRAMS:
        raise ValueError(f"programs={programs}: must be in [1, {MAX_PROGRAMS}]")
    if scratch.row_top.shape[1] < triton.next_power_of_2(max(out.top_ids.shape[1], 1)):
        raise ValueError(f"scratch: top-N lists of {scratch.row_top.shape[1]}, expected at least "
                         f"{out.top_ids.shape[1]} (SampleScratch.allocate(num_top=...))")
    if scratch.hist.shape[0] < rows or scratch.block_mass.shape[1] != -(-vocab // BLOCK):
        raise ValueError(f"scratch: {tuple(scratch.block_mass.shape)} block masses, expected at least "
                         f"[{rows}, {-(-vocab // BLOCK)}]")
    if row_controlled is not None and logits is None:
        raise ValueError("row_controlled without logits: a skipped row reads its scores from the logits")
    if handed is not None and (row_controlled is None or handed.row_f.shape[0] < rows
                               or handed.row_top.shape[1] < scratch.row_top.shape[1]):
        raise ValueError("handed: a PassOne of at least the rows and the scratch's top-N, with row_controlled")
    if kept is not None and kept.weights.shape[0] < rows:
        raise ValueError(f"kept: {tuple(kept.weights.shape)} weights, expected at least [{rows}, {vocab}]")
    tensors = [scores, logits, nothing_allowed, row_controlled, params.draw_uniforms, out.tokens, scratch.hist,
               *vars(params).values(), *(vars(kept).values() if kept is not None else ())]
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) != 1:
        raise ValueError(f"tensors on {sorted(map(str, devices))}: expected one device")
    torch.ops.engine.sample_rows(
        scores, logits, params.temperatures, params.top_ks, params.top_ps, params.min_ps, params.row_to_req,
        params.stop_ids, params.eos_suppression_rows, params.forced_tokens, params.draw_uniforms, nothing_allowed,
        scratch.hist, scratch.block_mass, out.tokens, out.logprob, out.rank, out.top_ids, out.top_logprobs,
        out.error, LOGPROBS_MODES[logprobs], scratch.state_i, scratch.state_f, scratch.level,
        scratch.part_i, scratch.part_f, scratch.part_top, scratch.row_top, scratch.arrivals, scratch.kept_list, programs,
        row_controlled,
        None if kept is None else kept.weights[:rows], None if kept is None else kept.mass_total[:rows],
        None if kept is None else kept.one_hot_tokens[:rows],
        *((None,) * 3 if handed is None else (handed.row_f, handed.row_i, handed.row_top)), handed_raw)
    return out


def _aot_signature() -> dict[str, str]:
    """Triton types of `sample_kernel`'s arguments (the ahead-of-time build)."""
    pointers = dict(scores_ptr="*fp32", logits_ptr="*fp32", temperatures_ptr="*fp32", top_ks_ptr="*i32",
                    top_ps_ptr="*fp32", min_ps_ptr="*fp32", row_to_req_ptr="*i64", stop_ids_ptr="*i64",
                    eos_rows_ptr="*i1", forced_ptr="*i64", uniforms_ptr="*fp64", nothing_allowed_ptr="*i1",
                    hist_ptr="*i64", block_mass_ptr="*i64", tokens_ptr="*i64", logprob_ptr="*fp32",
                    rank_ptr="*i64", top_ids_ptr="*i64", top_logprobs_ptr="*fp32",
                    error_ptr="*i64", row_controlled_ptr="*i1", kept_weights_ptr="*fp32", mass_total_ptr="*fp64",
                    one_hot_ptr="*i64", state_i_ptr="*i64", state_f_ptr="*fp32", level_ptr="*fp64",
                    part_i_ptr="*i64", part_f_ptr="*fp32", part_top_ptr="*i64", row_top_ptr="*i64",
                    arrivals_ptr="*i32", list_ptr="*i32", handed_f_ptr="*fp32", handed_i_ptr="*i64",
                    handed_top_ptr="*i64")
    strides = ("stride_scores", "stride_logits", "stride_stop", "stride_hist", "stride_blocks", "stride_top",
               "stride_weights", "stride_part_top", "stride_row_top", "stride_handed_top")
    signature = {name: pointers.get(name, "i64" if name in strides else "i32" if name in ("span", "parts")
                                    else "constexpr")
                 for name in sample_kernel.arg_names}
    return signature


def _aot_builds() -> list[dict[str, object]]:
    """The configurations the CUDA step launches, for `profiling.kernel_build` (name, fn,
    signature, constexprs): the largest vocabulary (129280: the most draw blocks, the widest
    block cumsum; a smaller one compiles the same code with smaller constants) with 4 stop
    ids and top-20, raw and processed logprobs (no logprobs compiles a subset of raw): every
    phase in one launch (one program per row), and the split's launches of one phase each."""
    builds = []
    for mode in ("raw", "processed"):
        # The kernel head's launch: per-row controlled flags; in raw mode also rejection
        # verification's kept weights (whose graphs keep one program per row).
        for kept in (False, True) if mode == "raw" else (False,):
            phases = [(0, PHASES - 1)] + ([] if kept else [(phase, phase) for phase in range(PHASES)])
            for first, last in phases:
                constants = _launch_constants(129280, 4, 20, LOGPROBS_MODES[mode], True, True, True, kept)
                constants.update(CHUNK=GPU_CHUNK, ACCURATE=True, FIRST_PHASE=first, LAST_PHASE=last,
                                 PARTS_PAD=_parts_pad(129280, GPU_CHUNK, 1 if first != last else 2), HANDED=True,
                                 HANDED_RAW=mode == "raw")
                which = "all phases" if first != last else f"phase {first}"
                builds.append(dict(name=f"sample_rows V=129280 {mode}{' kept' if kept else ''} {which}",
                                   fn=sample_kernel, signature=_aot_signature(), constexprs=constants,
                                   num_warps=NUM_WARPS))
    return builds


AOT_BUILDS = _aot_builds()
