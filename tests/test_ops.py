"""gather and get_logits (docs/contract.md §3) against plain references: a Python loop
over rows for gather, a row-alone computation for batch-invariant logits (on the block
kernels the invariance probe verified: see also tests/test_invariance.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from engine.invariance import choose_block_gemm, lm_head_candidates
from engine.ops import block_gemm, gather, get_logits, one_row_linear, onednn_linear, onednn_runs
from graphs.capture_safety import capture_safety_check

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def random_rows(rows: int, hidden: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (rows, hidden), generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(rows, hidden, generator=gen).to(dtype)
    lo, hi = (0, 255) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, (rows, hidden), generator=gen).to(dtype)


def reference_gather(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    out = torch.zeros((len(index), x.shape[1]), dtype=x.dtype)
    for i, r in enumerate(index):
        if 0 <= r < x.shape[0]:
            out[i] = x[r]
    return out


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(0, 12),
    hidden=st.integers(1, 9),
    dtype=st.sampled_from(DTYPES),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    index=st.lists(st.integers(-20, 30), max_size=24),
    layout=st.sampled_from(["contiguous", "column_slice", "row_step"]),
    use_out=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gather_matches_loop(rows, hidden, dtype, index_dtype, index, layout, use_out, seed):
    gen = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        x = random_rows(rows, hidden, dtype, gen)
    elif layout == "column_slice":  # buf[:, 2:2+H] of a wider buffer: row stride > H
        x = random_rows(rows, hidden + 5, dtype, gen)[:, 2 : 2 + hidden]
    else:  # every other row of a taller buffer
        x = random_rows(2 * rows, hidden, dtype, gen)[::2]
    idx = torch.tensor(index, dtype=index_dtype)
    want = reference_gather(x, index)
    if use_out:
        out = random_rows(len(index), hidden, dtype, gen)  # stale contents must be overwritten
        got = gather(x, idx, out=out)
        assert got is out
    else:
        got = gather(x, idx)
    assert got.dtype == dtype and got.shape == (len(index), hidden)
    assert torch.equal(got, want)


def test_gather_out_of_range_rows_are_zero_even_over_nan():
    x = torch.full((3, 4), float("nan"))
    x[1] = 7.0
    got = gather(x, torch.tensor([1, -1, 3, 2**31 - 1, -(2**31)], dtype=torch.int32))
    assert torch.equal(got[0], torch.full((4,), 7.0))
    assert torch.equal(got[1:], torch.zeros(4, 4))


def test_gather_into_leading_slice_of_static_buffer():
    x = torch.arange(20, dtype=torch.float32).view(5, 4)
    static = torch.full((8, 4), -1.0)
    gather(x, torch.tensor([4, 9, 0]), out=static[:3])
    assert torch.equal(static[:3], torch.tensor([[16.0, 17, 18, 19], [0, 0, 0, 0], [0, 1, 2, 3]]))
    assert torch.equal(static[3:], torch.full((5, 4), -1.0))


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_gather_reads_strided_view_without_copying_it():
    wide = torch.randn(6, 16)
    x = wide[:, :5]
    with _RecordOps() as rec:
        got = gather(x, torch.tensor([5, 0, 6]))
    copies = [op for op in rec.ops if op in ("aten.clone", "aten.contiguous", "aten._to_copy", "aten.copy_")]
    assert copies == [], rec.ops
    assert torch.equal(got, reference_gather(x, [5, 0, 6]))


def test_gather_rejects_bad_shapes_and_index_dtypes():
    x = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="index"):
        gather(x, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="index"):
        gather(x, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="x: shape"):
        gather(torch.zeros(3), torch.tensor([0]))
    with pytest.raises(ValueError, match="out: shape"):
        gather(x, torch.tensor([0]), out=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="out: shape"):
        gather(x, torch.tensor([0]), out=torch.zeros(1, 4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_get_logits_plain_matches_float64_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 24, generator=gen)
    weight = torch.randn(50, 24, generator=gen).to(dtype)
    want = hidden.to(dtype).double() @ weight.double().t()
    for batch_invariant in (False, True):
        got = get_logits(hidden, weight, batch_invariant=batch_invariant, block_rows=4)
        assert got.dtype == torch.float32 and got.shape == (9, 50)
        tol = 1e-4 if dtype == torch.float32 else 0.1  # bf16 rounds the GEMM output to 8 bits
        assert torch.allclose(got.double(), want, atol=tol, rtol=tol)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 40), residual=st.booleans(), strided=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_one_row_linear_matches_a_float64_loop(n, k, residual, strided, dtype, seed):
    """Every output is row . weight[j] (+ residual[j]), whatever slice count divides N (8, 4,
    2 or none: F.linear), for a strided row and for a dtype the slices do not serve."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(1, 2 * k, generator=gen).to(dtype)[:, ::2] if strided else torch.randn(1, k, generator=gen).to(dtype)
    res = torch.randn(1, n, generator=gen).to(dtype) if residual else None
    got = one_row_linear(x, weight, res)
    want = [sum(float(x[0, i]) * float(weight[j, i]) for i in range(k)) + (float(res[0, j]) if residual else 0.0)
            for j in range(n)]
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.15
    assert torch.allclose(got.double(), torch.tensor([want], dtype=torch.float64), atol=tol * k ** 0.5, rtol=tol)


def test_get_logits_plain_one_row_runs_one_row_linear():
    """The plain LM head's one-row call is `one_row_linear`: the same bits."""
    gen = torch.Generator().manual_seed(3)
    weight, hidden = torch.randn(4096, 64, generator=gen), torch.randn(1, 64, generator=gen)
    assert torch.equal(get_logits(hidden, weight), one_row_linear(hidden, weight))
    torch.testing.assert_close(get_logits(hidden, weight), hidden @ weight.t(), atol=1e-4, rtol=1e-4)
    half = weight.bfloat16()  # fp32 hidden, bf16 weight: computed in bf16, returned as fp32
    torch.testing.assert_close(get_logits(hidden, half), (hidden.bfloat16() @ half.t()).float())


def test_get_logits_writes_into_out_and_casts_hidden_to_weight_dtype():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 16, generator=gen)
    weight = torch.randn(30, 16, generator=gen).bfloat16()
    out = torch.full((5, 30), float("nan"))
    for batch_invariant in (False, True):
        got = get_logits(hidden, weight, out=out, batch_invariant=batch_invariant, block_rows=2)
        assert got is out
        assert torch.equal(out, (hidden.bfloat16() @ weight.t()).float())
    with pytest.raises(ValueError, match="out: shape"):
        get_logits(hidden, weight, out=torch.zeros(5, 30, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected"):
        get_logits(hidden, weight[:, :8])
    with pytest.raises(ValueError, match="block_rows=0"):
        get_logits(hidden, weight, batch_invariant=True, block_rows=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_rows", [32, 16, 5])
def test_batch_invariant_row_is_bit_identical_alone_and_in_any_batch(threads, dtype, block_rows):
    """The same hidden row, alone and at several positions inside batches of several sizes
    (other rows random), gives the same bits on the block kernel the probe picks for the
    configured block. That a fixed block shape gives every row one summation order is not
    believed: 5-row blocks fail at 2 threads on AMD EPYC, and the probe then picks another."""
    gen = torch.Generator().manual_seed(2)
    hidden_size, vocab = 576, 2048
    weight = torch.randn(vocab, hidden_size, generator=gen).to(dtype)
    kernel, verified = choose_block_gemm(lm_head_candidates(weight, block_rows))
    assert verified, kernel.name
    rows = kernel.block_rows
    row = torch.randn(1, hidden_size, generator=gen)
    alone = get_logits(row, weight, batch_invariant=True, kernel=kernel)
    for batch in (2, 3, rows, rows + 1, 2 * rows + 3, 70):
        for position in sorted({0, 1, batch // 2, batch - 1}):
            others = torch.randn(batch, hidden_size, generator=gen)
            others[position] = row[0]
            got = get_logits(others, weight, batch_invariant=True, kernel=kernel)
            assert torch.equal(got[position], alone[0]), (kernel.name, batch, position)


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")
def test_mkl_packed_blocks_are_close_to_plain_blocks():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(2048, 576, generator=gen)
    packed = block_gemm(weight, "mkl_packed", 16)
    assert packed is not None and packed.name == "mkl_packed[16]"
    assert block_gemm(weight.bfloat16(), "mkl_packed", 16) is None
    assert block_gemm(weight.t().contiguous().t(), "mkl_packed", 16) is None  # strided: nothing to pack
    for batch in (3, 17, 40):
        others = torch.randn(batch, 576, generator=gen)
        got = get_logits(others, weight, batch_invariant=True, kernel=packed)
        torch.testing.assert_close(got, get_logits(others, weight, batch_invariant=True, block_rows=16), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_onednn_blocks_and_any_row_calls_are_close_to_plain_ones():
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(2048, 576, generator=gen)
    packed = block_gemm(weight, "onednn", 16)
    assert packed is not None and packed.name == "onednn[16]"
    assert block_gemm(weight.t().contiguous().t(), "onednn", 16) is None  # strided: nothing to pack
    assert block_gemm(weight.double(), "onednn", 16) is None
    for batch in (1, 3, 17, 40):
        others = torch.randn(batch, 576, generator=gen)
        plain = others @ weight.T
        got = get_logits(others, weight, batch_invariant=True, kernel=packed)
        torch.testing.assert_close(got, plain, atol=1e-4, rtol=1e-5)
        # Any row count in one call, with the residual added by the GEMM's epilogue.
        residual = torch.randn(batch, 2048, generator=gen)
        torch.testing.assert_close(onednn_linear(others, packed.packed), plain, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(onednn_linear(others, packed.packed, residual), plain + residual, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_runs_says_whether_this_cpu_packs_the_dtype(dtype):
    """oneDNN refuses bf16 on CPUs without AVX-512 or AVX-NE-CONVERT (an AVX2-only AMD EPYC):
    `onednn_runs` must agree with a direct try, and where it says no, nothing is packed."""
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    try:
        torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        direct = torch.backends.mkldnn.is_available()
    except RuntimeError:
        direct = False
    assert onednn_runs(dtype) == direct
    assert (block_gemm(weight, "onednn", 16) is not None) == direct
    assert not onednn_runs(torch.float64)


def test_get_logits_rejects_a_kernel_of_another_weight():
    weight = torch.randn(30, 16)
    with pytest.raises(ValueError, match="kernel: a mm\\[4\\] BlockGemm of another weight"):
        get_logits(torch.randn(2, 16), weight, batch_invariant=True, kernel=block_gemm(weight.clone(), "mm", 4))
    with pytest.raises(ValueError, match="kernel='fast'"):
        block_gemm(weight, "fast", 4)
    with pytest.raises(ValueError, match="block_rows=0"):
        block_gemm(weight, "mm", 0)


def test_get_logits_handles_zero_rows():
    weight = torch.randn(7, 4)
    for batch_invariant in (False, True):
        assert get_logits(torch.zeros(0, 4), weight, batch_invariant=batch_invariant).shape == (0, 7)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_gather_and_logits_pass_the_cpu_capture_safety_check(batch_invariant):
    static = {
        "hidden": torch.randn(6, 40)[:, :16],  # row-strided view of a wider model output
        "rows": torch.tensor([5, -1, 0, 6], dtype=torch.int32),
        "picked": torch.empty(4, 16, dtype=torch.float32),
        "logits": torch.empty(4, 30),
    }
    weight = torch.randn(30, 16).bfloat16()
    with capture_safety_check(static):
        gather(static["hidden"], static["rows"], out=static["picked"])
        get_logits(static["picked"], weight, out=static["logits"], batch_invariant=batch_invariant, block_rows=3)
    assert torch.equal(static["picked"], reference_gather(static["hidden"], [5, -1, 0, 6]))


@cuda
def test_gather_and_batch_invariant_logits_capture_on_cuda():
    device = torch.device("cuda")
    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    weight = torch.randn(1000, 64, device=device, dtype=torch.bfloat16)
    index = torch.tensor([3, -1, 15, 16, 0], device=device, dtype=torch.int32)
    rows = torch.empty(5, 64, device=device, dtype=torch.bfloat16)
    logits = torch.empty(5, 1000, device=device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            gather(x, index, out=rows)
            get_logits(rows, weight, out=logits, batch_invariant=True)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gather(x, index, out=rows)
            get_logits(rows, weight, out=logits, batch_invariant=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rows.cpu(), reference_gather(x.cpu(), [3, -1, 15, 16, 0]))
    assert torch.equal(logits, get_logits(rows, weight, batch_invariant=True))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_row_is_bit_identical_on_cuda(dtype):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(32000, 1024, generator=gen).to(dtype).cuda()
    row = torch.randn(1, 1024, generator=gen).cuda()
    alone = get_logits(row, weight, batch_invariant=True)
    for batch in (2, 31, 33, 64, 257):
        position = batch // 2
        others = torch.randn(batch, 1024, generator=gen).cuda()
        others[position] = row[0]
        got = get_logits(others, weight, batch_invariant=True)
        assert torch.equal(got[position], alone[0]), (batch, position)
