"""Triton building blocks of the kept set: a row's processed logits, order keys, masses, and
the exact cuts (min-p, top-k, top-p), as `@triton.jit` functions the sampling kernel inlines
(`engine.sampling.kernels.sample`). Each one is the definition of the torch stage it names:

- `chunk_values`: one chunk of a row's masked scores (suppressed stop ids at -inf,
  `engine.sampling.thresholds.suppress_in_place`), z = (score - M) / T with IEEE division,
  the weight exp(z), the order key (`thresholds.order_keys`) and the mass
  (`normaliser.token_masses`);
- `chunk_survivors`: the tokens min-p and top-k leave (vLLM's order: min-p first; both cuts
  are prefixes of the key order, so top-k counts every token and the two masks intersect);
- `radix_cut`: `thresholds.radix_threshold`, the smallest key whose running count or mass
  reaches a level, in three histogram passes over the row (digits of 11, 10 and 10 bits).
  Counts and masses are integers, so the histograms are exact in any order of addition.

A histogram lives in the caller's scratch row (global memory, one program per row): each
pass zeroes it, adds into it with atomics, and reads it back after a barrier, past L1.

`ACCURATE` selects CUDA's libdevice `exp` and `log` (the functions torch's CUDA kernels
call, so the kernel and the torch path agree bit for bit on a GPU); the interpreter has no
libdevice and takes Triton's `exp`, which it evaluates with numpy.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

KEY_BITS: tl.constexpr = tl.constexpr(31)  # order keys are nonnegative int32 values (thresholds.KEY_BITS)
KEY_MAX: tl.constexpr = tl.constexpr((1 << 31) - 1)  # "keep every token" (thresholds.KEY_MAX)
HIST_BINS: tl.constexpr = tl.constexpr(2048)  # bins of the widest digit (11 bits)


@triton.jit
def exp_f32(x, ACCURATE: tl.constexpr):
    """exp of a float32 tensor: libdevice's on CUDA (torch's CUDA exp), Triton's in the interpreter."""
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log_f64(x, ACCURATE: tl.constexpr):
    """log of a float64 tensor: libdevice's on CUDA, Triton's (numpy's) in the interpreter."""
    if ACCURATE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def masked_scores(score_row_ptr, offs, in_row, stop_ptr, active, NUM_STOP: tl.constexpr):
    """One chunk of a row's scores [CHUNK] f32 (-inf past the row) and the same with the
    row's suppressed stop ids at -inf. `stop_ptr` points at the request's NUM_STOP stop ids
    (int64, -1 = none: a padding slot suppresses nothing); `active` (scalar bool) is the
    row's EOS suppression flag."""
    score = tl.load(score_row_ptr + offs, mask=in_row, other=-float("inf"))
    hit = offs < 0
    for j in tl.static_range(NUM_STOP):
        stop = tl.load(stop_ptr + j)
        hit = hit | ((offs == stop) & (stop >= 0))
    return score, tl.where(hit & active, -float("inf"), score)


@triton.jit
def chunk_values(score_row_ptr, offs, in_row, stop_ptr, active, shift, temperature,
                 NUM_STOP: tl.constexpr, MASS_SCALE: tl.constexpr, ACCURATE: tl.constexpr):
    """One chunk of a row: (masked score, z, weight exp(z), order key, mass), all [CHUNK].

    Tokens past the row (`in_row` False) and suppressed stop ids read as -inf, so their
    weight and mass are 0 and their key is +inf's, above every finite z's (as -inf is in
    `thresholds.order_keys`). `shift` (M) and `temperature` (T, 1 on greedy rows) are f32
    scalars. z = (score - M) / T rounds twice, as the torch ops do: IEEE subtraction, then
    IEEE division (`div_rn`; Triton's `/` is an approximate division on CUDA)."""
    _, masked = masked_scores(score_row_ptr, offs, in_row, stop_ptr, active, NUM_STOP)
    z = tl.math.div_rn(masked - shift, temperature)
    if ACCURATE:
        weight = libdevice.exp(z)
    else:
        weight = tl.exp(z)
    # The bits of 0 - z, clamped at 0: a NaN z (a failed row) gets some key in range.
    key = tl.maximum((0.0 - z).to(tl.int32, bitcast=True), 0)
    # exp(z) * 2**S is exact in float32 (a power of two), and the cast truncates: the floor.
    mass = (weight * MASS_SCALE).to(tl.int64)
    return masked, z, weight, key, mass


@triton.jit
def chunk_survivors(masked, weight, key, min_p, top_k_cut):
    """[CHUNK] bool: the tokens that are valid (masked score > -inf), pass min-p
    (weight >= `min_p`, f32; -1 when off) and top-k (key <= `top_k_cut`; KEY_MAX when off)."""
    return (masked > -float("inf")) & (weight >= min_p) & (key <= top_k_cut)


@triton.jit
def _digit_pass(lo, total, level, top_p, score_row_ptr, stop_ptr, active, shift, temperature, min_p, top_k_cut,
                hist_ptr, COUNT: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr,
                V: tl.constexpr, CHUNK: tl.constexpr, NUM_STOP: tl.constexpr, MASS_SCALE: tl.constexpr,
                ACCURATE: tl.constexpr):
    """One pass of `radix_cut`: the histogram of the digit of BITS bits above SHIFT, over
    the keys clamped into the window [lo, lo + 2**(SHIFT + BITS)) (no clamp on the FIRST,
    most significant, digit), and the first bin whose running weight reaches the level.
    Returns (lo with that digit settled, the total weight, the level)."""
    bins_idx = tl.arange(0, HIST_BINS)
    one = tl.full((), 1, tl.int32)  # shifts of a tensor: the interpreter's constexpr has no `1 << c`
    tl.store(hist_ptr + bins_idx, tl.zeros((HIST_BINS,), dtype=tl.int64))
    tl.debug_barrier()
    for start in range(0, V, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        in_row = offs < V
        masked, z, weight, key, mass = chunk_values(score_row_ptr, offs, in_row, stop_ptr, active, shift,
                                                    temperature, NUM_STOP, MASS_SCALE, ACCURATE)
        if COUNT:
            add = in_row.to(tl.int64)
        else:
            add = tl.where(chunk_survivors(masked, weight, key, min_p, top_k_cut), mass, 0)
        if FIRST:
            bin_of = key >> SHIFT
        else:
            window = tl.minimum(tl.maximum(key, lo), lo + ((one << (SHIFT + BITS)) - 1))
            bin_of = (window - lo) >> SHIFT
        tl.atomic_add(hist_ptr + bin_of, add, mask=in_row & (add > 0), sem="relaxed")
    tl.debug_barrier()
    hist = tl.load(hist_ptr + bins_idx, cache_modifier=".cg")
    below = tl.cumsum(hist, 0)  # [HIST_BINS] the weight at or below each bin's top key
    if FIRST:
        total = tl.sum(hist, 0)
        if not COUNT:
            level = top_p * total.to(tl.float64)
    first = tl.sum((below.to(tl.float64) < level).to(tl.int32), 0)  # bins short of the level
    first = tl.minimum(first, (one << BITS) - 1)
    tl.debug_barrier()  # every thread has read the histogram before the next pass clears it
    return lo + (first << SHIFT), total, level


@triton.jit
def radix_cut(score_row_ptr, stop_ptr, active, shift, temperature, min_p, top_k_cut, level, top_p,
              hist_ptr, COUNT: tl.constexpr, V: tl.constexpr, CHUNK: tl.constexpr, NUM_STOP: tl.constexpr,
              MASS_SCALE: tl.constexpr, ACCURATE: tl.constexpr):
    """The smallest order key t whose running weight {key <= t} reaches the level: three
    passes over the row, one histogram of one digit each (11, 10 and 10 bits, most
    significant first), each pass clamping the keys into the window its predecessors settled
    (lower keys fall into the first bin, higher ones into the last), as
    `thresholds.radix_threshold` does.

    COUNT: the weight of every token of the row is 1 (top-k: `level` is k, f64). Else the
    weight is the mass of the tokens `chunk_survivors(min_p, top_k_cut)` keeps, and the level
    is `top_p` (f64) times their total, known once the first pass has counted it (top-p).
    `hist_ptr` is the row's scratch histogram (HIST_BINS int64). Returns (t int32, the
    total weight int64); t is KEY_MAX where the level is never reached."""
    lo = tl.zeros((), dtype=tl.int32)
    total = tl.zeros((), dtype=tl.int64)
    lo, total, level = _digit_pass(lo, total, level, top_p, score_row_ptr, stop_ptr, active, shift, temperature,
                                   min_p, top_k_cut, hist_ptr, COUNT, 20, 11, True, V, CHUNK, NUM_STOP,
                                   MASS_SCALE, ACCURATE)
    lo, total, level = _digit_pass(lo, total, level, top_p, score_row_ptr, stop_ptr, active, shift, temperature,
                                   min_p, top_k_cut, hist_ptr, COUNT, 10, 10, False, V, CHUNK, NUM_STOP,
                                   MASS_SCALE, ACCURATE)
    lo, total, level = _digit_pass(lo, total, level, top_p, score_row_ptr, stop_ptr, active, shift, temperature,
                                   min_p, top_k_cut, hist_ptr, COUNT, 0, 10, False, V, CHUNK, NUM_STOP,
                                   MASS_SCALE, ACCURATE)
    return lo, total
