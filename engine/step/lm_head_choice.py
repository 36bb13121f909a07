"""Which computation gives a step its sample rows' logits, chosen by the invariance probe.

The batch-invariant LM head must give a row the same bits in every bucket, at every place
in it, whatever the other rows hold (docs/contract.md §3). On CPU the engine picks a block
GEMM by `engine.invariance.choose_block_gemm`; `choose_row_logits` keeps that choice there.
On CUDA it first tries calls that read the weight once per step, whatever the bucket,
in the order of `DEVICE_KERNELS`, and keeps the first whose calls the probe finds
invariant:
- `triton`: `engine.step.lm_head_kernel.lm_head_logits`, the gather fused into a persistent
  matmul with one tile config;
- `cublas`: the gathered rows in one `torch.mm` call over the whole bucket. cuBLAS picks its
  kernel by the row count, and split-K kernels sum a row's K range in pieces whose number
  follows the shape, so this holds only where the process turned split-K off before its
  first GEMM (`CUBLASLT_WORKSPACE_SIZE=1`, `CUBLAS_WORKSPACE_CONFIG=:16:8`, as vLLM's
  batch-invariant mode sets them) and the kernels cuBLAS then picks happen to agree;
then today's block GEMMs (`block_gemm`: fixed blocks of rows, each call reading the weight).

The probe (`row_logits_invariant`) is `engine.invariance.rows_invariant` over calls of
several sizes: a call of exactly the probe's rows is the reference; then the probe rows
sit in calls of each of `call_rows` rows, past a tile's edge, among random rows and among
padding rows, gathered from scattered hidden rows. Every cyclic shift of the probe rows
and every probe row alone must keep the reference bits.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.invariance import choose_block_gemm, lm_head_candidates, rows_invariant
from engine.ops import BlockGemm, gather, get_logits
from engine.step.lm_head_kernel import lm_head_logits, row_max_keys

# The calls tried on CUDA before the block GEMMs, in this order.
DEVICE_KERNELS = ("triton", "cublas")
# Probe rows, and the call sizes they are placed in (a bucket of 64 requests; with 3
# drafts each, 256 rows): 2 x PROBE_ROWS + 1 calls per size.
PROBE_ROWS = 8
PROBE_CALL_ROWS = (64, 256)

_verdicts: dict[tuple, bool] = {}


@dataclass(frozen=True, eq=False)
class RowLogits:
    """A way to compute `out[r] = hidden[row_index[r]] @ weight.T` (fp32) for a bucket's
    sample rows; `kernel` names an entry of `ROW_LOGITS_KERNELS`. `block_gemm`: for
    `block_gemm`, the verified block GEMM of `engine.invariance`."""

    kernel: str
    weight: torch.Tensor  # [V, H]
    block_gemm: BlockGemm | None = None

    def __call__(self, hidden: torch.Tensor, row_index: torch.Tensor, out: torch.Tensor,
                 row_max: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [hidden_rows, H], row_index [rows] int (out of range: a zero row), out
        [rows, V] fp32, all on the weight's device; `row_max` [rows] int64 zeros or None:
        also each row's largest logit (`lm_head_kernel.row_max_keys`). Returns `out`."""
        if row_max is None:
            return ROW_LOGITS_KERNELS[self.kernel](self, hidden, row_index, out)
        if self.kernel == "triton":  # the fused kernel keys each row's maximum in its epilogue
            return lm_head_logits(hidden, row_index, self.weight, out, row_max=row_max)
        ROW_LOGITS_KERNELS[self.kernel](self, hidden, row_index, out)
        row_max_keys(out, row_max)
        return out


def _fused_rows(choice: RowLogits, hidden: torch.Tensor, row_index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return lm_head_logits(hidden, row_index, choice.weight, out)


def _one_gemm_rows(choice: RowLogits, hidden: torch.Tensor, row_index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    rows = gather(hidden, row_index).to(choice.weight.dtype)  # [rows, H]
    return out.copy_(torch.mm(rows, choice.weight.t()))  # one call: the weight read once


def _block_gemm_rows(choice: RowLogits, hidden: torch.Tensor, row_index: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    return get_logits(gather(hidden, row_index), choice.weight, out=out, batch_invariant=True,
                      kernel=choice.block_gemm)


# By name, a registry (not a branch), so tests can plant a call that breaks invariance.
ROW_LOGITS_KERNELS: dict[str, Callable[[RowLogits, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "triton": _fused_rows,
    "cublas": _one_gemm_rows,
    "block_gemm": _block_gemm_rows,
}


def _placed(choice: RowLogits, size: int, padding: bool,
            gen: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    """A probe call: x [R, H] -> x's logits [R, V], computed in a call of `size` output rows,
    x's rows gathered from the end of a hidden block behind `size` random rows and placed
    from output row `(size - R) // 2 + 1` (past a tile's edge for the sizes probed); the
    other output rows read random hidden rows in shuffled order, or padding (-1)."""
    weight = choice.weight
    others = torch.randn(size, weight.shape[1], generator=gen).to(device=weight.device, dtype=weight.dtype)  # [size, H]
    order = torch.randperm(size, generator=gen)

    def call(x: torch.Tensor) -> torch.Tensor:
        probe = x.shape[0]
        start = min((size - probe) // 2 + 1, size - probe)
        index = torch.full((size,), -1, dtype=torch.int64) if padding else order.clone()
        index[start : start + probe] = torch.arange(size, size + probe)
        out = torch.empty((size, weight.shape[0]), dtype=torch.float32, device=weight.device)
        choice(torch.cat([others, x]), index.to(weight.device), out)
        return out[start : start + probe]

    return call


def row_logits_invariant(choice: RowLogits, probe_rows: int = PROBE_ROWS,
                         call_rows: Sequence[int] = PROBE_CALL_ROWS, seed: int = 0) -> bool:
    """Whether `choice` gives every probe row the bits of a call of just the probe rows, in
    calls of each of `call_rows` rows, among random rows and among padding rows, at every
    shift and alone (module doc). Cached per kernel, weight shape, dtype, device and sizes."""
    weight = choice.weight
    sizes = tuple(sorted({size for size in call_rows if size >= probe_rows}))
    key = (choice.kernel, tuple(weight.shape), str(weight.dtype), str(weight.device), probe_rows, sizes, seed)
    if key not in _verdicts:
        gen = torch.Generator().manual_seed(seed)
        exact = lambda x: choice(x, torch.arange(x.shape[0], device=weight.device),  # noqa: E731
                                 torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=weight.device))
        calls = [exact] + [_placed(choice, size, False, gen) for size in sizes]
        if sizes:
            calls.append(_placed(choice, sizes[-1], True, gen))
        with torch.no_grad():
            _verdicts[key] = rows_invariant(calls, probe_rows, weight.shape[1], weight.dtype, weight.device, seed)
    return _verdicts[key]


def choose_device_row_logits(weight: torch.Tensor, kernels: Sequence[str] = DEVICE_KERNELS,
                             probe_rows: int = PROBE_ROWS, call_rows: Sequence[int] = PROBE_CALL_ROWS
                             ) -> tuple[RowLogits, bool] | None:
    """The first of `kernels` whose calls `row_logits_invariant` verifies, with True; None
    when none holds. Under a FakeTensorMode (the CUDA dry run: no values to probe) the
    first, unverified. Runs on any device (on CPU the fused kernel runs interpreted): the
    selection is tested there; `choose_row_logits` calls it on CUDA only."""
    if not kernels:
        return None
    if torch._guards.detect_fake_mode() is not None:
        return RowLogits(kernels[0], weight), False
    for kernel in kernels:
        choice = RowLogits(kernel, weight)
        if row_logits_invariant(choice, probe_rows, call_rows):
            return choice, True
    return None


def choose_row_logits(weight: torch.Tensor, block_rows: int, kernels: Sequence[str] = DEVICE_KERNELS,
                      call_rows: Sequence[int] = PROBE_CALL_ROWS) -> tuple[RowLogits, bool]:
    """The LM head's row logits in the batch-invariant mode, and whether the probe verified
    them. On CUDA: the first of `kernels` that holds (`choose_device_row_logits`, the probe
    calls sized by `call_rows`: the buckets' row counts); else, and on every other device,
    today's choice: the block GEMM `choose_block_gemm` picks among `lm_head_candidates(weight,
    block_rows)`."""
    if weight.device.type == "cuda":
        chosen = choose_device_row_logits(weight, kernels, call_rows=call_rows)
        if chosen is not None:
            return chosen
    gemm, verified = choose_block_gemm(lm_head_candidates(weight, block_rows))
    return RowLogits("block_gemm", weight, gemm), verified


def clear_cache() -> None:
    """Forget every verdict (tests that plant kernels)."""
    _verdicts.clear()
