"""Device ops at the head of the sampling tail (docs/contract.md §3): pick rows, compute logits;
and `upload`, how a per-step host array reaches the device.

Both are capture-safe: no host syncs, no boolean-mask indexing, no shapes that
depend on tensor values. The same code runs on CPU and CUDA.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


def default_block_rows(device: torch.device | str) -> int:
    """Rows per LM-head GEMM call in batch-invariant mode where none is configured: the one
    default of `get_logits` and of the engine (`EngineConfig.block_rows`). 16 on CPU, 64 on
    CUDA. Every block streams the whole weight once, so wider blocks mean fewer weight
    reads for big buckets and more wasted rows for small ones; on CUDA one block covers
    bucket 64, so the weight is read once. That one call shape gives every row one
    reduction order is what `engine.invariance` probes for the kernels it picks."""
    return 64 if torch.device(device).type == "cuda" else 16


def gather(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of `x` ([rows, H], any dtype, rows may be strided) picked by `index`
    ([n] int32/int64); an index < 0 or >= rows gives a zero row. Returns `out`
    ([n, H], x's dtype) when given, else a new tensor."""
    if x.dim() != 2:
        raise ValueError(f"x: shape {tuple(x.shape)} is not [rows, hidden]")
    if index.dim() != 1 or index.dtype not in _INDEX_DTYPES:
        raise ValueError(f"index: shape {tuple(index.shape)} dtype {index.dtype} is not a [n] int32/int64 tensor")
    rows, hidden = x.shape
    n = index.shape[0]
    if out is None:
        out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (n, hidden) or out.dtype != x.dtype:
        raise ValueError(f"out: shape {tuple(out.shape)} dtype {out.dtype}, expected {(n, hidden)} {x.dtype}")
    if rows == 0:
        return out.zero_()
    # Padding rows of a graph batch point outside x on purpose. Clamping keeps
    # the read inside x (an out-of-range index_select is a device-side assert
    # on CUDA); the mask then zeroes those rows. masked_fill, not boolean
    # indexing, so nothing depends on how many indices are out of range.
    in_range = (index >= 0) & (index < rows)  # [n] bool
    torch.index_select(x, 0, index.clamp(0, rows - 1), out=out)
    return out.masked_fill_(~in_range.unsqueeze(1), 0)


def upload(host: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """A per-step host tensor (or numpy array, made contiguous) on `device`. To CUDA from
    pinned memory, non_blocking: a copy from pageable memory makes the host wait for the
    stream to drain. The caching host allocator keeps the pinned block until the copy has
    run, so nothing overwrites it."""
    if isinstance(host, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(host))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True, eq=False)
class BlockGemm:
    """`x @ weight.T` as one GEMM call per block of exactly `block_rows` rows: the unit of
    work the batch-invariant modes rely on. Whether one call shape really gives every row of
    the block one summation order, whatever its position and its neighbours, depends on the
    GEMM library, the CPU and the thread count; `engine.invariance` checks it where the code
    runs and picks a `BlockGemm` that holds.

    `kernel` names an entry of `BLOCK_KERNELS`; `packed` is its prepared form of `weight`
    (oneDNN's blocked layout for `onednn`, MKL's packed layout for `mkl_packed`, None for
    `mm`). Lives on the weight's device. `short_from`: the fewest rows a call may hold and
    still give every row the bits of the full block (`engine.invariance.short_calls_from`;
    `block_rows` when no shorter call does): a last block of fewer rows runs as a short call
    (`tail_rows`), so a one-row step need not cost a `block_rows`-row GEMM. `long_blocks`:
    consecutive whole blocks may run as one call of 2, 4, ... up to that many blocks (powers
    of two), because the probe found such calls give every row its block's bits
    (`engine.invariance.long_calls_upto`): each call reads the weight once, not once
    per block (oneDNN on 2 AVX2 AMD EPYC cores, SmolLM2's LM head, 128 rows: 77 ms in one
    call against 135 ms in 8).
    """

    kernel: str
    weight: torch.Tensor  # [N, K]
    block_rows: int
    packed: torch.Tensor | None = None
    short_from: int | None = None  # None: block_rows (no short call verified)
    long_blocks: int = 1

    @property
    def name(self) -> str:
        return f"{self.kernel}[{self.block_rows}]"

    def tail_rows(self, rows: int) -> int:
        """The rows of the call that runs a last, partial block of `rows` rows (the rest
        zero padding): the block where no short call is verified, else at least
        `SHORT_CALL_ROWS` and `short_from`."""
        fewest = self.block_rows if self.short_from is None else self.short_from
        if fewest >= self.block_rows:
            return self.block_rows
        return max(rows, fewest, min(SHORT_CALL_ROWS, self.block_rows))

    def calls(self, rows: int) -> list[tuple[int, int]]:
        """The (start, stop) row ranges `rows` rows run in: whole blocks grouped into calls of
        the largest verified power-of-two block count that fits, then the partial rest."""
        ranges, start, full = [], 0, rows - rows % self.block_rows
        while start < full:
            blocks = min(self.long_blocks, (full - start) // self.block_rows)
            blocks = 1 << (blocks.bit_length() - 1)  # a power of two: the call sizes the probe checked
            ranges.append((start, start + blocks * self.block_rows))
            start = ranges[-1][1]
        if full < rows:
            ranges.append((full, rows))
        return ranges

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[n * block_rows, K]` in the weight's dtype -> `[n * block_rows, N]`, one kernel call per
        block, or per group of blocks where `long_blocks` allows (`calls`). A last, partial
        block runs as one call of just its rows: for callers whose probe verified such calls
        (`short_from`, `engine.invariance.short_calls_from`)."""
        run = BLOCK_KERNELS[self.kernel]
        ranges = self.calls(x.shape[0])
        if len(ranges) == 1:  # one call, no concatenation (a [rows, V] copy for the LM head)
            return run(self, x)
        return torch.cat([run(self, x[start:stop]) for start, stop in ranges])


def _mm_block(gemm: BlockGemm, block: torch.Tensor) -> torch.Tensor:
    return torch.mm(block, gemm.weight.t())


def _mkl_packed_block(gemm: BlockGemm, block: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(block, gemm.packed, gemm.weight, None, gemm.block_rows)


def _onednn_block(gemm: BlockGemm, block: torch.Tensor) -> torch.Tensor:
    return onednn_linear(block, gemm.packed)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T` (plus `residual`, added by the GEMM's epilogue) on a weight that
    `onednn_pack` prepared. x `[rows, K]` (any row count), CPU, the weight's dtype; residual
    `[rows, N]` or None. Returns a new `[rows, N]` tensor. oneDNN picks its kernel from the
    ISA the CPU reports (AVX2, AVX-512, AMX), not from its vendor."""
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")


# The fewest rows a short call (a last, partial block) runs, padded with zero rows where it
# has fewer and a call of this many is verified (`BlockGemm.tail_rows`). oneDNN's prepacked
# GEMM ran 1- and 2-row calls slower than 4-row ones on 2 Zen 4 cores, 1 thread, 7
# alternating runs: at H = 2048, V = 128256, 68.9 and 82.6 ms against 51.3 (16 rows: 96.1);
# at H = 576, V = 49152, 8.5 and 10.5 ms against 7.5 (16 rows: 13.2).
SHORT_CALL_ROWS = 4

GEMV_CHUNKS = (8, 4, 2)  # slices of the weight's rows tried for `one_row_linear`, most first


def one_row_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T` (plus `residual`) for one row: x `[1, K]` (cast to the weight's dtype),
    weight `[N, K]` -> `[1, N]` in the weight's dtype.

    On a CPU float32 weight, one `bmm` over equal slices of the weight's rows (the first
    of `GEMV_CHUNKS` that divides N): each slice is a matrix-vector product of its own,
    and the slices run side by side on the intra-op threads. A one-row GEMM reads the
    weight once whatever the library, but how fast depends on the kernel: on 2 AMD EPYC
    cores (SmolLM2's 30 layers, fp32) this took 17 ms against 24 ms for oneDNN's
    prepacked GEMM and 41 ms for `F.linear`, and the 49152 x 576 LM head 3.4 ms against
    5.1 ms, about the speed of a plain read of the weight. Elsewhere (another device or
    dtype, no slice count dividing N): `F.linear`. Not for the batch-invariant modes: a
    row's bits here differ from a multi-row GEMM's."""
    rows, k = x.shape
    n = weight.shape[0]
    x = x.to(weight.dtype)
    chunks = next((c for c in GEMV_CHUNKS if n % c == 0), 0)
    if rows != 1 or not chunks or weight.device.type != "cpu" or weight.dtype != torch.float32 or not weight.is_contiguous():
        y = torch.nn.functional.linear(x, weight)
    else:  # [chunks, N / chunks, K] x [chunks, K, 1]: slice c holds outputs c * N / chunks onwards
        y = torch.bmm(weight.view(chunks, n // chunks, k), x.t().expand(chunks, k, 1)).view(1, n)
    return y if residual is None else residual + y


@functools.lru_cache(maxsize=None)
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies `dtype` weights on this CPU. Its kernels follow
    the ISA: bf16 needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT, and on a CPU without them
    (an AVX2-only AMD EPYC, say) packing raises. Tried once per dtype on an 8 x 8 weight."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    weight = torch.ones((8, 8), dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        torch.ops.mkldnn._linear_pointwise(torch.ones((1, 8), dtype=dtype), packed, None, "none", [None], "")
    except RuntimeError:
        return False
    return True


def onednn_pack(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """`weight` `[N, K]` in oneDNN's blocked layout for GEMMs of about `rows` rows (any row
    count runs on it), or None where oneDNN does not apply: a dense CPU weight in a dtype
    oneDNN runs on this CPU (`onednn_runs`: fp32, and bf16 where the ISA has it), and a
    torch built with oneDNN."""
    if (weight.device.type != "cpu" or not weight.is_contiguous()
            or torch._guards.detect_fake_mode() is not None or not onednn_runs(weight.dtype)):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


# The block kernels by name: `[block_rows, K]` block -> `[block_rows, N]`. A registry (not a
# branch) so the invariance tests can plant a kernel that breaks the promise and watch the
# probe refuse it. In the order the batch-invariant modes try them: oneDNN first (its
# kernels follow the CPU's ISA on any vendor; the speed of MKL's packed GEMM, chosen on one
# Intel machine, did not carry to an AMD EPYC), then MKL's packed GEMM, then `mm`.
BLOCK_KERNELS: dict[str, Callable[[BlockGemm, torch.Tensor], torch.Tensor]] = {
    "onednn": _onednn_block,
    "mkl_packed": _mkl_packed_block,
    "mm": _mm_block,
}


def block_gemm(weight: torch.Tensor, kernel: str, block_rows: int) -> BlockGemm | None:
    """`weight` [N, K] prepared for `kernel` at `block_rows`-row blocks, or None where the
    kernel does not apply. `onednn` needs a dense CPU weight in a dtype oneDNN runs on this
    CPU and a torch with oneDNN (`onednn_pack`); `mkl_packed` a dense fp32 CPU weight and a torch with MKL
    (measured at H = 576, V = 49152, 16-row blocks, 2 AVX-512 cores: 8.8 ms per block
    against 12.6 ms for `mm`)."""
    if block_rows < 1:
        raise ValueError(f"block_rows={block_rows}: must be >= 1")
    if kernel == "onednn":
        packed = onednn_pack(weight, block_rows)
        return None if packed is None else BlockGemm(kernel, weight, block_rows, packed)
    if kernel == "mkl_packed":
        if (weight.device.type != "cpu" or weight.dtype != torch.float32 or not weight.is_contiguous()
                or not torch.backends.mkl.is_available()):
            return None
        return BlockGemm(kernel, weight, block_rows, torch.ops.mkl._mkl_reorder_linear_weight(weight, block_rows))
    if kernel not in BLOCK_KERNELS:
        raise ValueError(f"kernel={kernel!r}: must be one of {tuple(BLOCK_KERNELS)}")
    return BlockGemm(kernel, weight, block_rows)


def get_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    batch_invariant: bool = False,
    block_rows: int | None = None,
    kernel: BlockGemm | None = None,
) -> torch.Tensor:
    """LM-head logits: `hidden` [rows, H] x `weight` [V, H]^T, computed in the
    weight's dtype (hidden is cast to it), returned as [rows, V] fp32 (in `out`
    when given).

    `batch_invariant=True` runs fixed blocks of rows, the last one zero-padded,
    so every GEMM call has the same shape and a row's logits are bit-identical
    whatever the row count and the row's place in the batch, provided the block
    kernel keeps that promise on this machine: `kernel` is a `BlockGemm` of
    `weight` that `engine.invariance` has verified (its block size then replaces
    `block_rows`); without one, `mm` blocks of `block_rows` rows (None:
    `default_block_rows` of the weight's device), unchecked.
    Plain mode lets the GEMM pick its kernel by row count, which changes the
    reduction order and so the low bits.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: expected [rows, H] and [vocab, H]"
        )
    if block_rows is None:
        block_rows = default_block_rows(weight.device)
    if block_rows < 1:
        raise ValueError(f"block_rows={block_rows}: must be >= 1")
    if kernel is not None and (kernel.weight.data_ptr(), kernel.weight.shape, kernel.weight.dtype) != (
            weight.data_ptr(), weight.shape, weight.dtype):
        raise ValueError(f"kernel: a {kernel.name} BlockGemm of another weight than the one given")
    rows, vocab = hidden.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty((rows, vocab), dtype=torch.float32, device=weight.device)
    elif tuple(out.shape) != (rows, vocab) or out.dtype != torch.float32:
        raise ValueError(f"out: shape {tuple(out.shape)} dtype {out.dtype}, expected {(rows, vocab)} torch.float32")
    if not batch_invariant:
        out.copy_(one_row_linear(hidden, weight) if rows == 1 else torch.mm(hidden.to(weight.dtype), weight.t()))
        return out
    gemm = kernel or BlockGemm("mm", weight, block_rows)
    block_rows = gemm.block_rows
    run = BLOCK_KERNELS[gemm.kernel]
    for start, stop in gemm.calls(rows):  # whole blocks, grouped where verified; then the partial rest
        n = stop - start
        call = n if n % block_rows == 0 else gemm.tail_rows(n)  # short calls only where they give the block's bits
        if call == n:
            out[start:stop].copy_(run(gemm, hidden[start:stop].to(weight.dtype)))
            continue
        block = torch.zeros((call, weight.shape[1]), dtype=weight.dtype, device=weight.device)  # [call, H]
        block[:n].copy_(hidden[start:stop])  # the last block's padding: zeros
        out[start:stop].copy_(run(gemm, block)[:n])  # [call, V] in the weight's dtype
    return out
