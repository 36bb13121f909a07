"""The fused LM head kernel (engine/step/lm_head_kernel.py), its choice by the probe
(engine/step/lm_head_choice.py) and its sm_90 build (profiling/lm_head_build.py).

The kernel runs in Triton's interpreter on CPU tensors (fp32: the interpreter has no
bf16), with its one tile config, so the shapes here are small and cross the tile edges
(H not a multiple of BLOCK_K, V not of BLOCK_N, rows past one BLOCK_M tile).
- Against a plain reference that shares no code with it: `torch.index_select`, zero rows for
  out-of-range indices, and a float64 matmul; within the fp32 accumulation bound.
- Batch invariance, exactly: a row's bits in a bucket of 1 row equal its bits at any place
  in buckets of up to 70 rows, among random rows and padding rows; padding rows are +0.0.
- The probe picks the kernel where it holds and refuses a planted one that does not.
- On the fake CUDA device the cost model sees one op: the weight read once, the gathered
  rows of `hidden` read, the logits written.
- The sm_90 build: no spills, shared memory within 227 KiB, tensor-core MMAs.

The interpreter's `tl.dot` is numpy's matmul, and on the 2-core AMD EPYC here OpenBLAS gives
a row of a 64 x 64 x 128 product other low bits at rows 6 to 15 of the tile than at row 0:
the CPU's BLAS is not what a GPU's MMA is. A Hopper MMA computes each output element by
one instruction whose order does not depend on the element's row; that is the premise of
every batch-invariant Triton matmul, and what the on-device probe checks
(engine/step/lm_head_choice.py). So these tests model the MMA as such (`row_invariant_mma`):
each element's products in float64 summed in K order, rounded to fp32 once, then added to
the accumulator. What they check is the kernel's own part: which rows it gathers, which
elements it masks, the order of its K steps and of its tiles.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.invariance import choose_block_gemm, lm_head_candidates
from graphs.capture_safety import capture_safety_check
from engine.step import lm_head_choice
from engine.step.lm_head_choice import (ROW_LOGITS_KERNELS, RowLogits, choose_device_row_logits, choose_row_logits,
                                        row_logits_invariant)
from engine.step.lm_head_kernel import BLOCK_K, BLOCK_M, BLOCK_N, lm_head_logits
from profiling.cost_model import KernelCounter
from profiling.fake_cuda import FakeCuda
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

ROOT = Path(__file__).resolve().parents[1]

# The shapes cross every tile edge: H = 150 is two whole BLOCK_K steps and a part (three
# steps: fewer, and fp32 addition commutes, so a reversed K order would not show), V = 200 one
# whole BLOCK_N tile and a part; buckets up to 70 rows are one or two BLOCK_M tiles.
assert (BLOCK_M, BLOCK_N, BLOCK_K) == (64, 128, 64)
HIDDEN, VOCAB, TABLE_ROWS = 150, 200, 40


def _mma(self: InterpreterBuilder, a: TensorHandle, b: TensorHandle, d: TensorHandle, input_precision: object,
         max_num_imprecise_acc: object) -> TensorHandle:
    """`tl.dot` as an MMA: element (i, j) is the same sequence of operations for every i."""
    products = a.data.astype(np.float64)[:, :, None] * b.data.astype(np.float64)[None, :, :]  # [M, K, N], exact
    return TensorHandle(products.sum(axis=1).astype(d.data.dtype) + d.data, d.dtype.scalar)


@pytest.fixture(scope="module", autouse=True)
def row_invariant_mma() -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InterpreterBuilder, "create_dot", _mma)
        yield


def reference_logits(hidden: torch.Tensor, row_index: torch.Tensor,
                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits in float64 and the fp32 error bound per entry: rows picked by index_select,
    zero rows where the index is outside [0, hidden rows)."""
    n = hidden.shape[0]
    valid = (row_index >= 0) & (row_index < n)
    safe = torch.where(valid, row_index, torch.zeros_like(row_index)).long()
    rows = torch.index_select(hidden.double(), 0, safe) * valid[:, None].double()
    exact = rows @ weight.double().t()
    # fp32 products summed over H terms: each rounding at most 2^-24 of the running magnitude.
    bound = (rows.abs() @ weight.double().abs().t()) * (2 * hidden.shape[1] + 4) * 2.0**-24 + 1e-30
    return exact, bound


def guarded_logits(hidden: torch.Tensor, row_index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`lm_head_logits` into a [rows, V] view of a buffer with a NaN guard of a tile's width and a
    row before and after it; the guards must come back untouched (the interpreter checks no
    bounds: a stray store would land there, or crash the process where nothing is mapped)."""
    rows, vocab = len(row_index), weight.shape[0]
    guard = BLOCK_N + vocab
    buffer = torch.full((rows * vocab + 2 * guard,), float("nan"))
    out = buffer[guard : guard + rows * vocab].view(rows, vocab)
    assert lm_head_logits(hidden, row_index, weight, out) is out
    assert bool(buffer[:guard].isnan().all() and buffer[guard + rows * vocab :].isnan().all()), "a store outside out"
    return out


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden_size = draw(st.integers(1, 130))
    vocab = draw(st.integers(1, 300))
    table_rows = draw(st.integers(1, 12))  # an empty table: test_empty_table, last
    rows = draw(st.integers(0, 70))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    # Hidden rows with a row stride wider than H half the time (a column slice of a wider buffer),
    # and random rows past the table's end: a read of index table_rows finds values, not padding.
    width = hidden_size + draw(st.sampled_from([0, 3]))
    hidden = torch.randn(table_rows + 2, width, generator=gen)[:table_rows, :hidden_size]
    weight = torch.randn(vocab, hidden_size, generator=gen)
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    row_index = torch.randint(-3, table_rows + 3, (rows,), generator=gen, dtype=torch.int64).to(index_dtype)
    return hidden, row_index, weight


@settings(max_examples=8, deadline=None)
@given(cases())
def test_matches_the_reference(case: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    hidden, row_index, weight = case
    got = guarded_logits(hidden, row_index, weight)
    exact, bound = reference_logits(hidden, row_index, weight)
    assert bool(((got.double() - exact).abs() <= bound).all()), (got.double() - exact).abs().max()
    padding = (row_index < 0) | (row_index >= hidden.shape[0])
    assert bool((got[padding].view(torch.int32) == 0).all()), "a padding row is not +0.0 everywhere"


@pytest.fixture(scope="module")
def table() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A hidden table, a weight, and each probe row's bits computed in a bucket of one."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(TABLE_ROWS + 1, HIDDEN, generator=gen)[:TABLE_ROWS]
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    alone = torch.stack([guarded_logits(hidden, torch.tensor([i]), weight)[0] for i in PROBE])  # [probes, V]
    return hidden, weight, alone


PROBE = (0, 17, 39)  # table rows whose bits are followed


@settings(max_examples=6, deadline=None)
@given(rows=st.integers(len(PROBE), 70), padding=st.floats(0, 1), seed=st.integers(0, 2**31 - 1))
def test_rows_keep_their_bits_in_any_bucket(table: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: int,
                                            padding: float, seed: int) -> None:
    """Each probe row's bits in a bucket of `rows` rows, at random places, among random rows
    and padding rows (a share `padding` of the others), equal its bits alone."""
    hidden, weight, alone = table
    gen = torch.Generator().manual_seed(seed)
    row_index = torch.randint(0, TABLE_ROWS, (rows,), generator=gen)
    row_index[torch.rand(rows, generator=gen) < padding] = -1
    places = torch.randperm(rows, generator=gen)[: len(PROBE)]
    row_index[places] = torch.tensor(PROBE)
    got = guarded_logits(hidden, row_index, weight)
    for place, bits in zip(places.tolist(), alone):
        assert torch.equal(got[place].view(torch.int32), bits.view(torch.int32)), f"row at {place} of {rows}"
    assert bool((got[row_index == -1].view(torch.int32) == 0).all())


def test_rows_keep_their_bits_across_the_tile_edge(table: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """The probe rows at the last place of the first BLOCK_M tile, the first of the second and
    the last of the bucket; every other row padding or a random row."""
    hidden, weight, alone = table
    row_index = torch.full((70,), -1)
    row_index[::5] = torch.arange(14) % TABLE_ROWS
    row_index[[63, 64, 69]] = torch.tensor(PROBE)
    got = guarded_logits(hidden, row_index, weight)
    for place, bits in zip((63, 64, 69), alone):
        assert torch.equal(got[place].view(torch.int32), bits.view(torch.int32)), f"row at {place}"


def test_bad_inputs_name_the_argument() -> None:
    hidden, weight, index = torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="hidden"):
        lm_head_logits(torch.zeros(4, 7), index, weight)
    with pytest.raises(ValueError, match="row_index"):
        lm_head_logits(hidden, index.float(), weight)
    with pytest.raises(ValueError, match="row_index"):
        lm_head_logits(hidden, index[None], weight)
    with pytest.raises(ValueError, match="row_index"):
        lm_head_logits(hidden, torch.zeros(4, dtype=torch.int64)[::2], weight)
    with pytest.raises(ValueError, match="weight"):
        lm_head_logits(hidden, index, torch.zeros(8, 16).t())
    with pytest.raises(ValueError, match="weight"):
        lm_head_logits(hidden, index, torch.zeros(16, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        lm_head_logits(hidden, index, weight, torch.zeros(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="out"):
        lm_head_logits(hidden, index, weight, torch.zeros(3, 16))


def test_new_out_when_none_given() -> None:
    assert lm_head_logits(torch.zeros(4, 8), torch.zeros(0, dtype=torch.int64), torch.zeros(16, 8)).shape == (0, 16)
    out = lm_head_logits(torch.ones(4, 8), torch.tensor([3, 4]), torch.ones(16, 8))
    assert out.dtype == torch.float32 and torch.equal(out, torch.tensor([[8.0] * 16, [0.0] * 16]))


# The choice: a weight small enough for the interpreter (one BLOCK_N tile, three BLOCK_K steps)
# and probe calls of 3 rows (the reference) and 70 rows (two BLOCK_M tiles).
PROBE_SHAPES = {"probe_rows": 3, "call_rows": (70,)}


def _split_k_rows(choice: RowLogits, hidden: torch.Tensor, row_index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A planted call that breaks invariance as split-K does: past 8 rows, each row's K range
    is summed in two halves."""
    rows = torch.index_select(hidden, 0, row_index.clamp(0, hidden.shape[0] - 1))
    rows = rows * ((row_index >= 0) & (row_index < hidden.shape[0]))[:, None]
    half = hidden.shape[1] // 2
    weight = choice.weight
    if len(row_index) <= 8:
        return out.copy_(rows @ weight.t())
    return out.copy_(rows[:, :half] @ weight[:, :half].t() + rows[:, half:] @ weight[:, half:].t())


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ROW_LOGITS_KERNELS, "split_k", _split_k_rows)
    lm_head_choice.clear_cache()
    yield
    lm_head_choice.clear_cache()


@pytest.fixture(scope="module")
def small_weight() -> torch.Tensor:
    return torch.randn(100, 140, generator=torch.Generator().manual_seed(3))  # [V, H]


def test_probe_picks_the_fused_kernel_and_refuses_a_planted_one(planted: None, small_weight: torch.Tensor) -> None:
    assert not row_logits_invariant(RowLogits("split_k", small_weight), **PROBE_SHAPES)
    chosen = choose_device_row_logits(small_weight, ("split_k", "triton"), **PROBE_SHAPES)
    assert chosen is not None and chosen[0].kernel == "triton" and chosen[1]
    assert choose_device_row_logits(small_weight, ("split_k",), **PROBE_SHAPES) is None


def test_chosen_fused_kernel_computes_the_rows(small_weight: torch.Tensor) -> None:
    hidden = torch.randn(5, 140, generator=torch.Generator().manual_seed(4))
    row_index = torch.tensor([4, -1, 0, 5])
    out = torch.empty(4, 100)
    RowLogits("triton", small_weight)(hidden, row_index, out)
    exact, bound = reference_logits(hidden, row_index, small_weight)
    assert bool(((out.double() - exact).abs() <= bound).all())


def test_cpu_keeps_todays_choice(small_weight: torch.Tensor) -> None:
    """Off CUDA the device kernels are not even probed: the block GEMM of today's choice."""
    chosen, verified = choose_row_logits(small_weight, 16, kernels=("triton",))
    gemm, today = choose_block_gemm(lm_head_candidates(small_weight, 16))
    assert chosen.kernel == "block_gemm" and verified == today
    assert (chosen.block_gemm.kernel, chosen.block_gemm.block_rows, chosen.block_gemm.short_from,
            chosen.block_gemm.long_blocks) == (gemm.kernel, gemm.block_rows, gemm.short_from, gemm.long_blocks)
    hidden = torch.randn(6, 140, generator=torch.Generator().manual_seed(5))
    row_index = torch.tensor([5, 0, 9, 2])
    out = torch.empty(4, 100)
    chosen(hidden, row_index, out)
    exact, bound = reference_logits(hidden, row_index, small_weight)
    assert bool(((out.double() - exact).abs() <= bound).all())


def test_fake_cuda_takes_the_fused_kernel_unprobed() -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeCuda():
            weight = torch.empty(129280, 7168, dtype=torch.bfloat16, device="cuda")
            chosen, verified = choose_row_logits(weight, 64)
    assert (chosen.kernel, verified) == ("triton", False)


def test_cost_model_sees_one_kernel_reading_the_gathered_rows() -> None:
    """By hand: hidden [100, 16] bf16 of which 4 rows are read (4 x 16 x 2 B), the index
    4 x 8 B, the weight [32, 16] bf16 whole (1024 B, all of it a weight read), the [4, 32]
    fp32 logits written (512 B, not read: the op's `out`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeCuda():
            weight = torch.empty(32, 16, dtype=torch.bfloat16, device="cuda")
            hidden = torch.empty(100, 16, dtype=torch.bfloat16, device="cuda")
            row_index = torch.empty(4, dtype=torch.int64, device="cuda")
            out = torch.empty(4, 32, device="cuda")
            with KernelCounter(weights=[weight]) as counter:
                lm_head_logits(hidden, row_index, weight, out)
    assert [(k.op, k.read, k.written, k.weight_read) for k in counter.kernels] == [
        ("engine.lm_head_logits.default", 4 * 16 * 2 + 4 * 8 + 1024, 4 * 32 * 4, 1024)]


def test_capture_safety_check_sees_one_op_writing_the_static_logits() -> None:
    """On the fake CUDA device, into static buffers, under the CUDA rules of the capture check."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeCuda() as cuda:
            static = {"hidden": torch.empty(300, 7168, dtype=torch.bfloat16, device="cuda"),
                      "sample_rows": torch.empty(256, dtype=torch.int32, device="cuda"),
                      "logits": torch.empty(256, 1000, device="cuda")}
            weight = torch.empty(1000, 7168, dtype=torch.bfloat16, device="cuda")
            rows, logits = static["sample_rows"][:64], static["logits"][:64]  # a bucket's leading slices
            with capture_safety_check(static, is_pinned=cuda.is_pinned) as stats:
                lm_head_logits(static["hidden"], rows, weight, logits)
    assert stats.op_counts == {"engine.lm_head_logits.default": 1}


def test_builds_for_sm90_without_spills() -> None:
    """Built in a fresh process: the interpreted kernels of this one must not reach the compiler."""
    from profiling.lm_head_build import SHARED_LIMIT

    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "profiling.lm_head_build", "--json", "--rows", "64"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    builds = json.loads(done.stdout)["builds"]
    assert [b["signature"] for b in builds] == ["bf16 hidden, bf16 weight, i32 index", "bf16 hidden, bf16 weight, i64 index"]
    for build in builds:
        assert build["spill_stores"] == build["spill_loads"] == build["stack"] == 0, build
        assert 0 < build["shared"] <= SHARED_LIMIT and build["registers"] <= 255, build
        assert build["tensor_core"], "no wgmma in the PTX: the dot is not on Hopper's tensor-core path"
        assert build["target"].startswith("sm_90"), build


def test_empty_table() -> None:
    """No hidden rows: every row is padding. Apart from the hypothesis cases, and last in the
    file: an empty tensor's data pointer is null, so a kernel that reads a padding row
    crashes the process here."""
    gen = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(2, 24, generator=gen)[:0], torch.randn(30, 24, generator=gen)
    got = guarded_logits(hidden, torch.tensor([0, -1, 1]), weight)
    assert bool((got.view(torch.int32) == 0).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_matches_torch_and_the_probe_verifies_it() -> None:
    """On a GPU, at DeepSeek-V3's head width (H = 7168; V = 32768 of its 129280 rows), bf16:
    the compiled kernel against a float64 matmul of the same bf16 values, within the fp32
    accumulation bound, padding rows +0.0; then the probe (calls of 8, 64 and 256 rows, random
    and padding neighbours) verifies it. The cuBLAS one-call verdict is printed, not asserted."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(32768, 7168, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    hidden = torch.randn(300, 7168, generator=gen).to("cuda", torch.bfloat16)
    row_index = torch.randint(-1, 300, (256,), generator=gen).cuda()
    got = lm_head_logits(hidden, row_index, weight)
    exact, bound = reference_logits(hidden, row_index, weight)
    assert bool(((got.double() - exact).abs() <= bound).all()), (got.double() - exact).abs().max()
    assert bool((got[row_index == -1].view(torch.int32) == 0).all())
    lm_head_choice.clear_cache()
    assert row_logits_invariant(RowLogits("triton", weight))
    print("cuBLAS one call over the bucket invariant:", row_logits_invariant(RowLogits("cublas", weight)))


def _decoded(keys: torch.Tensor) -> torch.Tensor:
    """The float32 values of `row_max_keys` keys, decoded here on their own."""
    ordered = (keys - 2**31).to(torch.int32)
    return torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).view(torch.float32)


@pytest.mark.parametrize("epilogue", [True, False], ids=["kernel epilogue", "torch after the kernel"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_each_rows_maximum_comes_with_its_logits(case: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                                                 epilogue: bool, monkeypatch) -> None:
    """`row_max`: each row's largest logit, NaN left out (a NaN weight row makes a NaN column),
    -inf where a row has no other, through the kernel's atomics or the torch ops after it."""
    from engine.step import lm_head_kernel

    hidden, row_index, weight = case
    weight = weight.clone()
    weight[0] = float("nan") if weight.shape[0] > 1 else weight[0]
    monkeypatch.setattr(lm_head_kernel, "interpreting", lambda: epilogue)
    row_max = torch.zeros(row_index.shape[0], dtype=torch.int64)
    out = lm_head_logits(hidden, row_index, weight, row_max=row_max)
    want = torch.where(out.isnan(), float("-inf"), out).amax(-1) if out.shape[1] else torch.full((len(out),), float("-inf"))
    assert torch.equal(_decoded(row_max), want + 0.0), (_decoded(row_max), want)


def test_a_rows_maximum_leaves_out_the_tiles_columns_past_the_vocabulary() -> None:
    """Every logit negative (hidden >= 0, weight <= 0), V = 200: the second vocabulary tile's
    56 columns past V read as zeros and must not be a row's maximum."""
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.rand(4, 16, generator=gen) + 0.1, -torch.rand(200, 16, generator=gen) - 0.1
    row_max = torch.zeros(4, dtype=torch.int64)
    out = lm_head_logits(hidden, torch.arange(4), weight, row_max=row_max)
    assert bool((out < 0).all()) and torch.equal(_decoded(row_max), out.amax(-1))
