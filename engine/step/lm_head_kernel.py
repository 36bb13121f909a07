"""The LM head on CUDA as one Triton kernel: gather the sample rows, multiply by the weight.

`lm_head_logits(hidden, row_index, weight, out)` computes `out[r] = hidden[row_index[r]] @
weight.T` in fp32 for every row r of a bucket, drafts included, in one launch of one
kernel (`engine::lm_head_logits`, a `torch.library.triton_op`: the fake-CUDA dry run, the
capture-safety check and the cost model see one op). What makes it the batch-invariant LM
head (docs/contract.md §3):

- **One tile config for every bucket.** `BLOCK_M` x `BLOCK_N` output tiles, a `BLOCK_K`
  step, `NUM_WARPS` and `NUM_STAGES` are module constants, never chosen by shape. A row's
  logits come from one `tl.dot` chain over its own tile: the same instruction shape, the
  same K order (0, BLOCK_K, 2 BLOCK_K, ... ascending), whatever the row count, the row's
  place in its tile, the tile's place in the schedule or what the other rows hold. No
  split-K: one program owns a tile's whole K range, so nothing is summed across programs.
- **The weight read once per step.** The programs are persistent (a few per SM, each
  walking the tiles from its id in steps of the program count); the row tiles of one
  vocabulary tile are consecutive tile ids, so the programs that read the same weight tile
  run side by side and share it through L2. A bucket of up to 256 rows (64 requests with 3
  drafts each) is one call; the four 64-row GEMM calls of the block path read the weight
  four times from HBM.
- **The gather fused into the A load.** Row r reads `hidden[row_index[r]]`; an index
  outside `[0, hidden rows)` (the padding rows of a graph batch point there on purpose, as
  for `engine.ops.gather`) reads a zero row, whose logits are a zero row's product with
  the weight (zeros, for a finite weight). No gathered copy of the hidden rows is made.

On CUDA tensors the compiled kernel runs; on CPU tensors the op runs the same kernel in
Triton's interpreter (what `TRITON_INTERPRET=1` selects, whatever the environment), so
the CPU test suite checks the kernel's semantics and its invariance. The interpreter has no
bf16: CPU checks run fp32 weights. `profiling/lm_head_build.py` compiles the kernel for
sm_90 ahead of time and reads its registers, spills and shared memory.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from engine.sampling.kernels import interpreting

# The one tile config (H200, bf16): a 64-row tile is one warpgroup's wgmma M (4 warps);
# 128 vocabulary columns x 64 K per step keep a stage's A and weight tiles at 24 KiB, so 4
# stages fit 96 KiB of shared memory and two programs fit one SM. The accumulator is
# 64 x 128 fp32: 64 registers per thread.
BLOCK_M = 64
BLOCK_N = 128
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 4
# Persistent programs per SM on CUDA (two 96 KiB programs share an SM's 227 KiB).
PROGRAMS_PER_SM = 2
# Programs of an interpreted (CPU) launch: few, so each walks several tiles as on a GPU.
INTERPRETER_PROGRAMS = 3

_INDEX_DTYPES = (torch.int32, torch.int64)


def _lm_head_logits_kernel(
    hidden_ptr,  # [hidden_rows, H], any float dtype, cast to the weight's in the load
    row_index_ptr,  # [rows] int32/int64: the hidden row of each output row
    weight_ptr,  # [V, H]
    out_ptr,  # [rows, V] fp32
    row_max_ptr,  # [rows] int64 (HAS_ROW_MAX): each row's largest logit as a `row_max_keys` key, atomically
    rows,
    hidden_rows,
    vocab,
    hidden_size,
    stride_hidden,
    stride_weight,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    HAS_ROW_MAX: tl.constexpr,
):
    # Builtins only (arithmetic for tl.cdiv, tl.full for tl.zeros): triton.language's own
    # jit helpers run in the interpreter only when TRITON_INTERPRET=1 was set before
    # triton's import, and the CPU path runs this kernel interpreted whatever the environment.
    row_tiles = (rows + BLOCK_M - 1) // BLOCK_M
    tiles = row_tiles * ((vocab + BLOCK_N - 1) // BLOCK_N)
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        # Row tiles vary fastest: the programs holding one vocabulary tile's row tiles
        # run at once and read its weight tile from HBM once between them.
        tile_m = tile % row_tiles
        tile_n = tile // row_tiles
        out_rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        vocab_rows = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        in_bucket = out_rows < rows
        in_vocab = vocab_rows < vocab
        source = tl.load(row_index_ptr + out_rows, mask=in_bucket, other=-1).to(tl.int64)  # [BLOCK_M]
        # Padding rows point outside the hidden rows: their loads are masked off (no
        # traffic, zeros), never clamped into another row's data.
        present = (source >= 0) & (source < hidden_rows)
        source = tl.where(present, source, 0)
        hidden_rows_ptr = hidden_ptr + source[:, None] * stride_hidden  # [BLOCK_M, 1]
        weight_rows_ptr = weight_ptr + vocab_rows.to(tl.int64)[:, None] * stride_weight  # [BLOCK_N, 1]
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        # The K order: ascending, the same for every row, bucket and tile (batch invariance).
        for k_start in range(0, hidden_size, BLOCK_K):
            k = k_start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            in_k = k < hidden_size
            w = tl.load(weight_rows_ptr + k[None, :], mask=in_vocab[:, None] & in_k[None, :], other=0.0)
            a = tl.load(hidden_rows_ptr + k[None, :], mask=present[:, None] & in_k[None, :], other=0.0)
            acc = tl.dot(a.to(w.dtype), tl.trans(w), acc, input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N]
        out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * stride_out + vocab_rows[None, :]
        tl.store(out_ptrs, acc, mask=in_bucket[:, None] & in_vocab[None, :])
        if HAS_ROW_MAX:  # the tile's part of each row's maximum (NaN left out), one atomic per row
            top = tl.max(tl.where(in_vocab[None, :] & (acc == acc), acc, float("-inf")), 1)  # [BLOCK_M]
            bits = (top + 0.0).to(tl.int32, bitcast=True)
            key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2**31
            tl.atomic_max(row_max_ptr + out_rows, key, mask=in_bucket)


# Built from the function, not by decorators, so neither depends on TRITON_INTERPRET: the
# compiled kernel for CUDA (and `profiling/lm_head_build.py`), the interpreted one for CPU.
# The row counts are never specialized: Triton would otherwise compile other variants for a
# count of 1 or a multiple of 16, and every bucket must run one binary.
LM_HEAD_KERNEL = JITFunction(_lm_head_logits_kernel, do_not_specialize=["rows", "hidden_rows"])
_INTERPRETED = InterpretedFunction(_lm_head_logits_kernel)


def input_precision(dtype: torch.dtype) -> str:
    """How `tl.dot` multiplies: fp32 weights exactly ("ieee", as torch's default fp32
    matmul, not TF32); bf16 and fp16 always run their own tensor-core products."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs(device: torch.device, tiles: int) -> int:
    """The persistent grid: `PROGRAMS_PER_SM` per SM on a CUDA device (the fake CUDA device of
    the dry run reports the SMs it stands for), `INTERPRETER_PROGRAMS` elsewhere (the
    interpreter); never more than the tiles. A row's bits do not depend on it."""
    if device.type == "cuda":
        count = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) * PROGRAMS_PER_SM
    else:
        count = INTERPRETER_PROGRAMS
    return max(1, min(tiles, count))


def row_max_keys(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row's largest logit (NaN left out; -inf where there is none) into `keys` [rows]
    int64 as an order key: its float32 bits made monotone (-0 as +0), plus 2**31, so that
    every value's key is positive and 0 stands below all (the buffer's "none yet"). What
    the fused kernel's epilogue computes with atomics; by torch ops for any other GEMM, and
    for the kernel interpreted where Triton's reductions do not run (module doc)."""
    top = torch.where(logits.isnan(), float("-inf"), logits).amax(-1) + 0.0
    bits = top.view(torch.int32)
    return keys.copy_(torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64) + 2**31)


@triton_op("engine::lm_head_logits", mutates_args={"out", "row_max"})
def _lm_head_logits_op(hidden: torch.Tensor, row_index: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                       row_max: torch.Tensor | None = None) -> None:
    rows = row_index.shape[0]
    vocab, hidden_size = weight.shape
    tiles = triton.cdiv(rows, BLOCK_M) * triton.cdiv(vocab, BLOCK_N)
    if tiles == 0:
        return
    cpu = out.device.type == "cpu"
    # The epilogue's reduction runs compiled, or interpreted where TRITON_INTERPRET=1 was set
    # before triton's import (the tests); elsewhere on the CPU torch ops follow the kernel.
    epilogue = row_max is not None and (not cpu or interpreting())
    kernel = _INTERPRETED if cpu else LM_HEAD_KERNEL
    wrap_triton(kernel)[(programs(out.device, tiles),)](
        hidden, row_index, weight, out, row_max if epilogue else out,
        rows, hidden.shape[0], vocab, hidden_size,
        hidden.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, INPUT_PRECISION=input_precision(weight.dtype),
        HAS_ROW_MAX=epilogue, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if row_max is not None and not epilogue:
        row_max_keys(out, row_max)


def lm_head_logits(hidden: torch.Tensor, row_index: torch.Tensor, weight: torch.Tensor,
                   out: torch.Tensor | None = None, row_max: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of a bucket's sample rows, gathered and multiplied in one kernel.

    Parameters
    ----------
    hidden: [hidden_rows, H] floating point, on the weight's device, rows contiguous
        (stride 1 along H; rows may be strided). Cast to the weight's dtype as it is read.
    row_index: [rows] int32/int64, contiguous, on the weight's device: output row r is computed from
        `hidden[row_index[r]]`; an index < 0 or >= hidden_rows (a padding row) reads a
        zero row.
    weight: [V, H] floating point (bf16 on CUDA; fp32 on CPU, where the op runs in
        Triton's interpreter), stride 1 along H.
    out: [rows, V] fp32 on the weight's device, stride 1 along V, or None for a new one.
    row_max: [rows] int64 on the weight's device, all 0, or None: also each row's largest
        logit as a `row_max_keys` key (the epilogue maxes it in atomically).

    Returns
    -------
    `out` (or a new [rows, V] fp32 tensor): each row's logits, accumulated in fp32 from
    products in the weight's dtype, bit-identical whatever `rows`, the row's position and
    the other rows (one tile config, one K order: module doc).

    Raises
    ------
    ValueError: a shape, dtype, device or stride the kernel does not take, naming it.
    """
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden: shape {tuple(hidden.shape)} dtype {hidden.dtype}, "
                         "expected a floating-point [rows, H]")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: shape {tuple(weight.shape)} dtype {weight.dtype}, "
                         "expected a floating-point [V, H]")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: H differs")
    if (row_index.dim() != 1 or row_index.dtype not in _INDEX_DTYPES
            or (len(row_index) > 1 and row_index.stride(0) != 1)):
        raise ValueError(f"row_index: shape {tuple(row_index.shape)} dtype {row_index.dtype} "
                         f"stride {row_index.stride()}, expected a contiguous [rows] int32/int64")
    for name, tensor in (("hidden", hidden), ("row_index", row_index)):
        if tensor.device != weight.device:
            raise ValueError(f"{name} is on {tensor.device}, the weight on {weight.device}")
    # The kernel steps along H (and writes along V) with unit stride.
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if tensor.shape[1] > 1 and tensor.stride(1) != 1:
            raise ValueError(f"{name}: stride {tensor.stride()}, expected stride 1 along H")
    shape = (row_index.shape[0], weight.shape[0])
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=weight.device)
    elif (tuple(out.shape) != shape or out.dtype != torch.float32 or out.device != weight.device
          or (shape[1] > 1 and out.stride(1) != 1)):
        raise ValueError(f"out: shape {tuple(out.shape)} dtype {out.dtype} on {out.device} stride {out.stride()}, "
                         f"expected {shape} torch.float32 on {weight.device} with stride 1 along V")
    if row_max is not None and (row_max.shape != shape[:1] or row_max.dtype != torch.int64
                                or row_max.device != weight.device):
        raise ValueError(f"row_max: shape {tuple(row_max.shape)} dtype {row_max.dtype} on {row_max.device}, "
                         f"expected ({shape[0]},) torch.int64 on {weight.device}")
    torch.ops.engine.lm_head_logits(hidden, row_index, weight, out, row_max)
    return out
