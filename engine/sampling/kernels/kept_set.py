"""Triton building blocks of the kept set: a row's processed logits, order keys, masses, and
the exact cuts (min-p, top-k, top-p), as `@triton.jit` functions the sampling kernel inlines
(`engine.sampling.kernels.sample`). Each one is the definition of the torch stage it names:

- `chunk_values`: one chunk of a row's masked scores (suppressed stop ids at -inf,
  `engine.sampling.thresholds.suppress_in_place`), z = (score - M) / T with IEEE division,
  the weight exp(z), the order key (`thresholds.order_keys`) and the mass
  (`thresholds.token_masses`);
- `chunk_survivors`: the tokens min-p and top-k leave (vLLM's order: min-p first; both cuts
  are prefixes of the key order, so top-k counts every token and the two masks intersect);
- `digit_histogram` and `digit_select`: one digit of `thresholds.radix_threshold`, the
  smallest key whose running count or mass reaches a level, found in three histogram
  passes over the row (digits of 11, 10 and 10 bits, most significant first). Each program adds its
  part of the row into the row's histogram; once every part has (the sampling kernel's
  merge), one program selects the digit and clears the histogram. Counts and masses are
  integers, so the histograms are exact in any order of addition and any split.

A histogram lives in the caller's scratch row (global memory), zero between digits; it is
read back past L1.

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
LIST_CAP: tl.constexpr = tl.constexpr(1024)  # ids a row's kept list holds (`kept_list`): top-k to ~1000


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
def fold_max(y, tokens, take, best, best_id, vocab):
    """A row's running maximum M of its masked scores and M's first index, with `y` [N] at
    `tokens` [N] (any order) folded in where `take`: a NaN plays no part, the smallest id of
    a tie wins, and a row of nothing but -inf keeps id 0. The sampler's pass 1 and the
    controls kernel's handoff of it (`PassOne`) both fold with it."""
    clean = tl.where(take & (y == y), y, float("-inf"))
    top = tl.max(clean, axis=0)
    first = tl.min(tl.where(clean == top, tokens, vocab), axis=0).to(tl.int64)
    best_id = tl.where(top > best, first, tl.where((top == best) & (best > float("-inf")),
                                                   tl.minimum(best_id, first), best_id))
    return tl.maximum(best, top), best_id


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
    return processed_values(masked, shift, temperature, MASS_SCALE, ACCURATE)


@triton.jit
def processed_values(masked, shift, temperature, MASS_SCALE: tl.constexpr, ACCURATE: tl.constexpr):
    """`chunk_values` of masked scores already loaded."""
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
def gather_chunk(list_row, count_ptr, offs, take, LIST: tl.constexpr):
    """Appends the ids `offs` [CHUNK] where `take` to the row's list (LIST slots): one
    atomic add of the chunk's count reserves its places; past LIST only the count grows."""
    n = tl.sum(take.to(tl.int32), 0)
    if n > 0:
        base = tl.atomic_add(count_ptr, n.to(tl.int64), sem="relaxed")
        place = base + tl.cumsum(take.to(tl.int64), 0) - 1
        tl.store(list_row + place, offs.to(tl.int32), mask=take & (place < LIST))


@triton.jit
def raw_masses(x, raw_max, MASS_SCALE: tl.constexpr, ACCURATE: tl.constexpr):
    """The sum of the raw masses floor(exp(x - raw_max) * 2**S) of unprocessed logits `x`."""
    return tl.sum((exp_f32(x - raw_max, ACCURATE) * MASS_SCALE).to(tl.int64), 0)


@triton.jit
def raw_partials(plain_row_ptr, start, stop, raw_max, token_raw, CHUNK: tl.constexpr, MASS_SCALE: tl.constexpr,
                 ACCURATE: tl.constexpr):
    """Raw logprobs over the tokens [start, stop) of a row of unprocessed logits: (the sum of
    the masses floor(exp(x - raw_max) * 2**S), the count of logits above `token_raw`)."""
    raw_mass = tl.zeros((), dtype=tl.int64)
    above = tl.zeros((), dtype=tl.int64)
    for base in range(start, stop, CHUNK):
        offs = base + tl.arange(0, CHUNK)
        plain = tl.load(plain_row_ptr + offs, mask=offs < stop, other=-float("inf"))
        raw_mass += raw_masses(plain, raw_max, MASS_SCALE, ACCURATE)
        above += tl.sum((plain > token_raw).to(tl.int64), 0)
    return raw_mass, above


@triton.jit
def digit_histogram(lo, score_row_ptr, start, stop, stop_ptr, active, shift, temperature, min_p, top_k_cut,
                    hist_ptr, gather, list_row, count_ptr, kept_row, raw, raw_max,
                    COUNT: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr,
                    CHUNK: tl.constexpr, NUM_STOP: tl.constexpr, MASS_SCALE: tl.constexpr, ACCURATE: tl.constexpr,
                    GATHER: tl.constexpr, WRITE_KEPT: tl.constexpr, LIST: tl.constexpr):
    """Adds the tokens [start, stop) of a row (one program's part; `start` a multiple of
    CHUNK) to the row's histogram of the digit of BITS bits above SHIFT, over the keys
    clamped into the window [lo, lo + 2**(SHIFT + BITS)) (no clamp on the FIRST, most
    significant, digit). COUNT: each token weighs 1 (top-k); else the mass of the tokens
    `chunk_survivors(min_p, top_k_cut)` keeps (top-p). Integer atomics: the histogram is
    the same whatever the parts and the order they add in. GATHER (the last digit) and
    `gather`: also list the tokens the cut may keep (`gather_chunk`: min-p's and top-k's
    survivors at or below the window's top) and, with WRITE_KEPT, zero the row's kept weights
    (the merge writes the kept ones, `kept_list.settle`). FIRST and `raw` (the scores are the
    row's logits): also the raw masses' sum (`raw_partials`), returned (else 0)."""
    one = tl.full((), 1, tl.int32)  # shifts of a tensor: the interpreter's constexpr has no `1 << c`
    raw_mass = tl.zeros((), dtype=tl.int64)
    for base in range(start, stop, CHUNK):
        offs = base + tl.arange(0, CHUNK)
        in_row = offs < stop
        score, masked = masked_scores(score_row_ptr, offs, in_row, stop_ptr, active, NUM_STOP)
        masked, z, weight, key, mass = processed_values(masked, shift, temperature, MASS_SCALE, ACCURATE)
        if FIRST:
            if raw:
                raw_mass += raw_masses(score, raw_max, MASS_SCALE, ACCURATE)
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
        if GATHER:
            if gather:
                top = lo + ((one << (SHIFT + BITS)) - 1)
                gather_chunk(list_row, count_ptr, offs,
                             in_row & chunk_survivors(masked, weight, key, min_p, tl.minimum(top_k_cut, top)), LIST)
                if WRITE_KEPT:
                    tl.store(kept_row + offs, tl.zeros((CHUNK,), dtype=tl.float32), mask=in_row)
    return raw_mass


@triton.jit
def digit_select(lo, total, level, top_p, hist_ptr, COUNT: tl.constexpr, SHIFT: tl.constexpr,
                 BITS: tl.constexpr, FIRST: tl.constexpr):
    """From a row's finished histogram of one digit (every part added): the first bin whose
    running weight reaches the level, as `thresholds.radix_threshold` picks it. On the
    FIRST digit the total weight is counted and, for top-p (not COUNT), the level is
    `top_p` (f64) times it. Zeroes the histogram for the next digit. Returns (lo with
    this digit settled, the total weight int64, the level f64)."""
    bins_idx = tl.arange(0, HIST_BINS)
    one = tl.full((), 1, tl.int32)
    hist = tl.load(hist_ptr + bins_idx, cache_modifier=".cg")
    below = tl.cumsum(hist, 0)  # [HIST_BINS] the weight at or below each bin's top key
    if FIRST:
        total = tl.sum(hist, 0)
        if not COUNT:
            level = top_p * total.to(tl.float64)
    first = tl.sum((below.to(tl.float64) < level).to(tl.int32), 0)  # bins short of the level
    first = tl.minimum(first, (one << BITS) - 1)
    tl.debug_barrier()  # every thread has read the histogram before it is cleared
    tl.store(hist_ptr + bins_idx, tl.zeros((HIST_BINS,), dtype=tl.int64))
    return lo + (first << SHIFT), total, level
