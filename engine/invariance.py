"""Batch invariance, checked on the machine where it runs (docs/contract.md §3).

The batch-invariant modes (the engine's LM head, the Llama model's projections and
attention tiles) compute every row in GEMM calls of one fixed shape, on the belief that
one call shape gives every row one summation order, whatever its position in the block
and whatever the other rows hold. That is a property of the GEMM library, the CPU and the
thread count, not a fact: at 2 threads on a 2-core AMD EPYC, MKL gives row 4 of a 5-row
block other bits than the same row at position 0, while 16-row blocks hold. So when an
engine or an invariant model is built, the calls it will make are probed here, with the
real shapes, dtype and device, at the current `torch.get_num_threads()`, and a kernel
that holds is picked (`choose_block_gemm`). Results are cached in-process per (kernel,
shape, dtype, device, thread count): the hundreds of engines a test run builds pay once.

The probe (`rows_invariant`) runs a call shape of R rows on R random rows x_0..x_{R-1}:
the reference is one call on them in order; then the R cyclic shifts (every x_i at every
position, among random rows; shift 0 repeats the reference call, so a kernel that is not
deterministic fails too) and R calls with x_p alone at position p (the other rows zero,
as in the zero-padded last block) must each give x_i its reference bits. 2R + 1 calls: at
SmolLM2's LM head (V = 49152, H = 576, fp32, 16-row blocks) 33 block GEMMs, about 0.3 s
where one takes 9 ms. The shifts keep each row's cyclic neighbours; a kernel whose rows
depend on the other rows' values (not only on whether they are zero) could pass, but GEMM
kernels branch on shapes, not values.

A verdict holds for the thread count it was probed at: the engine and the model probe at
construction, so build them at the thread count they will run at.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch

from engine.ops import BLOCK_KERNELS, BlockGemm, block_gemm

# Block sizes the LM head falls back to, after the configured one, in this order: powers of
# two near the default (a wider block reads the weight fewer times per row, a narrower one
# wastes fewer padding rows), then single rows: a one-row call has no position and no
# neighbours, so only a kernel that is not deterministic can fail it.
FALLBACK_BLOCK_ROWS = (16, 8, 32, 4, 64, 2, 1)
# The most whole blocks one call may group (`long_calls_upto`): calls of 2, 4 and 8 blocks are
# probed. Past 128 rows a CPU GEMM call gains little more (SmolLM2's LM head on 2 AVX2 AMD EPYC
# cores, oneDNN: 16 rows 17 ms a block, 128 rows 9.7 ms a block, 256 rows 9.3 ms a block).
LONG_CALL_BLOCKS = 8

_verdicts: dict[tuple, bool] = {}
_warned: set[str] = set()

Gemm = Callable[[torch.Tensor], torch.Tensor]  # [rows, K] -> [rows, N]


def _values_unavailable() -> bool:
    """Under a FakeTensorMode (the CUDA dry run, profiling/cuda_dry_run.py) tensors carry
    shapes and no values, so no probe can run: every verdict is then False, uncached, the
    configured kernel is taken and nothing warns. The dry run checks shapes and capture
    rules, not numerics."""
    return torch._guards.detect_fake_mode() is not None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bits, not values: -0.0 and 0.0 differ here, and NaN equals its own pattern.
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def rows_invariant(gemms: Sequence[Gemm], rows: int, in_features: int, dtype: torch.dtype,
                   device: torch.device, seed: int = 0) -> bool:
    """True when every call in `gemms` (`[rows, in_features]` -> `[rows, N]`, one call each)
    gives each probe row the bits the first call gives it, at every position of the block,
    among random rows and alone (other rows zero). The calls should be one computation in
    different surroundings (for a bmm: the block as one item among more or fewer others)."""
    gen = torch.Generator().manual_seed(seed)
    probe = torch.randn(rows, in_features, generator=gen).to(device=device, dtype=dtype)  # [rows, K]
    reference = gemms[0](probe)  # row i: x_i's bits
    for gemm in gemms:
        for shift in range(rows):  # x_i at position (i + shift) % rows
            if not _same_bits(gemm(probe.roll(shift, 0)), reference.roll(shift, 0)):
                return False
        for position in range(rows):
            if not _same_bits(gemm(_alone(probe, position))[position], reference[position]):
                return False
    return True


def _context(dtype: torch.dtype, device: torch.device) -> tuple:
    return (str(dtype), str(device), torch.get_num_threads())


def gemm_invariant(gemm: BlockGemm) -> bool:
    """Whether `gemm`'s block calls are batch-invariant here (probed once per kernel, shape,
    dtype, device and thread count)."""
    if _values_unavailable():
        return False
    weight = gemm.weight
    key = ("gemm", gemm.kernel, gemm.block_rows, tuple(weight.shape), *_context(weight.dtype, weight.device))
    if key not in _verdicts:
        with torch.no_grad():
            _verdicts[key] = rows_invariant([gemm], gemm.block_rows, weight.shape[1], weight.dtype, weight.device)
    return _verdicts[key]


def bmm_tiles_invariant(rows: int, inner: int, outer: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a `[rows, inner] x [inner, outer]` item of `torch.bmm` gets the same bits at
    every row position, alone and among random rows, whatever the item count of the call
    and the item's index in it. Items are cheap, so the probe's variants of one block (its
    R cyclic shifts and R rows alone) ride in a few calls of several item counts, at
    several offsets among random items, against the block as the only item of a call."""
    if _values_unavailable():
        return False
    key = ("bmm", rows, inner, outer, *_context(dtype, device))
    if key not in _verdicts:
        gen = torch.Generator().manual_seed(1)
        draw = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
        block, right = draw(rows, inner), draw(inner, outer)
        variants = torch.stack([block.roll(s, 0) for s in range(rows)] + [_alone(block, p) for p in range(rows)])
        with torch.no_grad():
            reference = torch.bmm(block[None], right[None])[0]  # [rows, outer]
            expected = torch.stack([reference.roll(s, 0) for s in range(rows)] + [_alone(reference, p) for p in range(rows)])
            holds = True
            for count, offset in ((2, 1), (2 * rows, 0), (2 * rows + 1, 1), (64 + 2 * rows, 64), (257, 200)):
                placed = min(len(variants), count - offset)
                lefts, rights = draw(count, rows, inner), draw(count, inner, outer)
                lefts[offset : offset + placed], rights[offset : offset + placed] = variants[:placed], right
                got = torch.bmm(lefts, rights)[offset : offset + placed]
                for v in range(placed):
                    p = v - rows
                    want, have = (expected[v], got[v]) if p < 0 else (expected[v][p], got[v][p])
                    holds = holds and _same_bits(have, want)
            _verdicts[key] = holds
    return _verdicts[key]


def _alone(block: torch.Tensor, position: int) -> torch.Tensor:
    """`block` with every row but `position` zeroed."""
    alone = torch.zeros_like(block)
    alone[position] = block[position]
    return alone


def short_calls_from(gemm: BlockGemm) -> int:
    """The fewest rows n such that calls of n .. block_rows - 1 rows give each row the bits a
    full block call gives it (probed once per kernel, shape, dtype, device and thread count);
    `block_rows` when even a call of block_rows - 1 rows does not. A last, partial block of at
    least that many rows may run unpadded. (On 2 AMD EPYC cores, oneDNN's one-row call of
    SmolLM2's down projection, K = 1536, missed the block's bits; 2 to 15 rows kept them.)"""
    if _values_unavailable():
        return gemm.block_rows
    weight, rows = gemm.weight, gemm.block_rows
    key = ("short", gemm.kernel, rows, tuple(weight.shape), *_context(weight.dtype, weight.device))
    if key not in _verdicts:
        gen = torch.Generator().manual_seed(2)
        probe = torch.randn(rows, weight.shape[1], generator=gen).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            reference = gemm(probe)
            fewest = rows
            for n in range(rows - 1, 0, -1):  # from the longest short call down to one row
                if not all(_same_bits(gemm(probe[start : start + n]), reference[start : start + n])
                           for start in dict.fromkeys((0, rows - n))):
                    break
                fewest = n
            _verdicts[key] = fewest
    return _verdicts[key]


def long_calls_upto(gemm: BlockGemm, most: int = LONG_CALL_BLOCKS) -> int:
    """The most whole blocks, a power of two up to `most`, that one call may hold: calls of
    2, 4, ... that many blocks each give every row the bits its own block call gives it
    (probed once per kernel, shape, dtype, device and thread count); 1 when a two-block
    call does not. The block call itself must be verified first (`gemm_invariant`): a row's
    block bits then do not depend on its place or its neighbours, so the reference for any
    arrangement of the probe rows is the block calls' rows in that arrangement. Each call
    size is tried at the start of the probe and at its end (another offset in memory), and
    on the rows shifted by part of a block (each row at another place in the call)."""
    if _values_unavailable():
        return 1
    weight, rows = gemm.weight, gemm.block_rows
    key = ("long", gemm.kernel, rows, most, tuple(weight.shape), *_context(weight.dtype, weight.device))
    if key not in _verdicts:
        run = BLOCK_KERNELS[gemm.kernel]
        gen = torch.Generator().manual_seed(3)
        probe = torch.randn(most * rows, weight.shape[1], generator=gen).to(device=weight.device, dtype=weight.dtype)
        shift = rows // 2 + 1
        with torch.no_grad():
            reference = torch.cat([run(gemm, block) for block in probe.split(rows)])
            shifted, shifted_reference = probe.roll(shift, 0), reference.roll(shift, 0)
            verdict, blocks = 1, 2
            while blocks <= most:
                n = blocks * rows
                starts = dict.fromkeys((0, len(probe) - n))
                holds = (all(_same_bits(run(gemm, probe[s : s + n]), reference[s : s + n]) for s in starts)
                         and _same_bits(run(gemm, shifted[:n]), shifted_reference[:n]))
                if not holds:
                    break
                verdict, blocks = blocks, 2 * blocks
            _verdicts[key] = verdict
    return _verdicts[key]


def choose_block_gemm(candidates: Iterable[BlockGemm | None]) -> tuple[BlockGemm, bool]:
    """The first candidate (None entries skipped) whose block calls are batch-invariant
    here, with True; when none is, the first candidate with False. Candidates are taken
    lazily, so those after the first that passes are never prepared. A verified one has
    `short_from` from `short_calls_from`, and `long_blocks` from
    `long_calls_upto`."""
    first = None
    for gemm in candidates:
        if gemm is None:
            continue
        first = first or gemm
        if _values_unavailable():
            break
        if gemm_invariant(gemm):
            return dataclasses.replace(gemm, short_from=short_calls_from(gemm), long_blocks=long_calls_upto(gemm)), True
    if first is None:
        raise ValueError("choose_block_gemm: no candidate applies")
    return first, False


def lm_head_candidates(weight: torch.Tensor, block_rows: int, kernels: Sequence[str] | None = None) -> Iterable[BlockGemm | None]:
    """The LM head's block GEMMs to try: every kernel at the configured `block_rows`, then at
    each of `FALLBACK_BLOCK_ROWS`. `kernels` defaults to every entry of `BLOCK_KERNELS`."""
    kernels = tuple(BLOCK_KERNELS) if kernels is None else kernels
    for rows in dict.fromkeys((block_rows, *FALLBACK_BLOCK_ROWS)):
        for kernel in kernels:
            yield block_gemm(weight, kernel, rows)


def warn_not_invariant(what: str) -> None:
    """One RuntimeWarning per distinct message and process: batch invariance does not hold."""
    if _values_unavailable():
        return
    message = (
        f"batch invariance does not hold on this machine at {torch.get_num_threads()} threads for {what}: "
        "a request's results may depend on the batch it shares"
    )
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def clear_cache() -> None:
    """Forget every verdict and warning (tests that plant kernels)."""
    _verdicts.clear()
    _warned.clear()
