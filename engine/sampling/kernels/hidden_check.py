"""Rows whose hidden state is not finite fail, as one Triton kernel: `engine::fail_non_finite_hidden`,
the CUDA twin of `engine.step.lm_head.fail_non_finite_hidden` (`errors.fail_rows` with
`RowError.HIDDEN_NOT_FINITE`).

One program per sample row reads the row's hidden state [H] once, gathered from the source
by the row's index (an index out of range, a padding row, reads nothing: finite); where it holds a
NaN or an infinity, the row's outputs become the placeholder (token `PLACEHOLDER_TOKEN`,
logprob 0, rank 0, top ids -1, top logprobs 0, not flagged) and its error code
HIDDEN_NOT_FINITE, overriding the sampler's own. Other rows are not written. It runs after
the sampler and before verification, which reads the codes. No host syncs, fixed grid:
capture-safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from engine.sampling.sampler import PLACEHOLDER_TOKEN, RowError
from engine.sampling.kernels import FP_FUSION
from engine.sampling.sample_output import SampleOutput

BLOCK = 1024  # hidden values per step of the row
NUM_WARPS = 4
_HIDDEN_NOT_FINITE: tl.constexpr = tl.constexpr(int(RowError.HIDDEN_NOT_FINITE))
_PLACEHOLDER: tl.constexpr = tl.constexpr(PLACEHOLDER_TOKEN)


@triton.jit
def _fail_non_finite_kernel(hidden_ptr, row_index_ptr, source_rows, stride_hidden, hidden_size, tokens_ptr, error_ptr, logprob_ptr, rank_ptr,
                            top_ids_ptr, top_logprobs_ptr, stride_top, num_top,
                            BLOCK: tl.constexpr, TOP_P2: tl.constexpr):
    row = tl.program_id(0)
    source_row = tl.load(row_index_ptr + row).to(tl.int64)
    inside = (source_row >= 0) & (source_row < source_rows)
    source_row = tl.where(inside, source_row, 0)  # a padding row reads row 0 and is never failed
    bad = tl.zeros((), dtype=tl.int32)
    for start in range(0, hidden_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(hidden_ptr + source_row * stride_hidden + offs, mask=offs < hidden_size, other=0.0)
        x = x.to(tl.float32)
        bad = tl.maximum(bad, tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), 0))
    if inside & (bad != 0):
        lane = tl.arange(0, TOP_P2)
        on_top = lane < num_top
        tl.store(tokens_ptr + row, tl.full((), _PLACEHOLDER, tl.int64))
        tl.store(error_ptr + row, tl.full((), _HIDDEN_NOT_FINITE, tl.int64))
        tl.store(logprob_ptr + row, tl.zeros((), tl.float32))
        tl.store(rank_ptr + row, tl.zeros((), tl.int64))
        tl.store(top_ids_ptr + row * stride_top + lane, tl.full((TOP_P2,), -1, tl.int64), mask=on_top)
        tl.store(top_logprobs_ptr + row * stride_top + lane, tl.zeros((TOP_P2,), tl.float32), mask=on_top)


@triton_op("engine::fail_non_finite_hidden",
           mutates_args={"tokens", "error", "logprob", "rank", "top_ids", "top_logprobs"})
def _fail_non_finite_op(hidden: torch.Tensor, row_index: torch.Tensor, tokens: torch.Tensor, error: torch.Tensor, logprob: torch.Tensor,
                        rank: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> None:
    rows, (source_rows, hidden_size) = row_index.shape[0], hidden.shape
    if rows == 0:
        return
    num_top = top_ids.shape[1]
    wrap_triton(_fail_non_finite_kernel)[(rows,)](
        hidden, row_index, source_rows, hidden.stride(0), hidden_size, tokens, error, logprob, rank, top_ids, top_logprobs,
        top_ids.stride(0), num_top, BLOCK=min(BLOCK, triton.next_power_of_2(hidden_size)),
        TOP_P2=triton.next_power_of_2(max(num_top, 1)), num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION)


def fail_non_finite_hidden(hidden: torch.Tensor, row_index: torch.Tensor, out: SampleOutput) -> None:
    """Fail the rows of `out` whose hidden state `hidden[row_index[r]]` holds a NaN or an
    infinity; capture-safe.

    Parameters: `hidden` [source rows, H] float (any float dtype, unit column stride),
    `row_index` [rows] int64 (out of range: a padding row, never failed) and `out` the
    rows' `SampleOutput` (tokens, error, ... [rows]), on one device (CUDA or, under
    `TRITON_INTERPRET=1`, CPU). Returns: None; those rows hold the placeholder and
    `RowError.HIDDEN_NOT_FINITE`, the others are untouched. Raises: ValueError when the
    row counts differ or `hidden` is not a float matrix with unit column stride.
    """
    if hidden.dim() != 2 or not hidden.is_floating_point() or hidden.stride(1) != 1:
        raise ValueError(f"hidden: {tuple(hidden.shape)} {hidden.dtype} stride {hidden.stride()}, "
                         "expected [rows, H] float with unit column stride")
    if row_index.dim() != 1 or row_index.shape[0] != out.tokens.shape[0]:
        raise ValueError(f"rows: row_index {tuple(row_index.shape)}, out {out.tokens.shape[0]}")
    torch.ops.engine.fail_non_finite_hidden(hidden, row_index, out.tokens, out.error, out.logprob, out.rank, out.top_ids,
                                            out.top_logprobs)


def _aot_builds() -> list[dict[str, object]]:
    """The kernel head's launch at H = 7168 (bf16 hidden states), top-20, for `profiling.kernel_build`."""
    signature = dict(hidden_ptr="*bf16", row_index_ptr="*i64", source_rows="i64", stride_hidden="i64", hidden_size="i32", tokens_ptr="*i64",
                     error_ptr="*i64", logprob_ptr="*fp32", rank_ptr="*i64", top_ids_ptr="*i64",
                     top_logprobs_ptr="*fp32", stride_top="i64", num_top="i32",
                     BLOCK="constexpr", TOP_P2="constexpr")
    return [dict(name="fail_non_finite_hidden H=7168 bf16", fn=_fail_non_finite_kernel, signature=signature,
                 constexprs=dict(BLOCK=BLOCK, TOP_P2=32), num_warps=NUM_WARPS)]


AOT_BUILDS = _aot_builds()
