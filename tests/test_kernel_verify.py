"""The verification kernels (engine/sampling/kernels/verify_kernel.py) against the torch path, under
Triton's interpreter on CPU tensors.

References: `engine.step.lm_head.verify_and_store_drafts` (strict mode, top-k space, the
draft pool), `engine.sampling.verify.verify_rejection` (rejection mode, from the same
kept weights and mass total the kernel reads) and `SamplingControls.count` (the counts
and `counted_index`). Random batches (tests/kernel_batches.py): 0..K drafts per request,
pool reads, padding rows, failed rows, NaN rows, greedy and forced rows, staged and
one-hot draft distributions, rows whose residual is empty. Accepted counts, emitted
tokens, pool entries and counts must be identical.
"""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling.sampler import SamplerConfig
from engine.sampling.verify import verify_rejection
from engine.step.lm_head import verify_and_store_drafts
from engine.step.engine_config import EngineConfig
from engine.step.control_state import SamplingControls
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from tests.kernel_batches import Batch, batches

triton = pytest.importorskip("triton")
from engine.sampling.kernels import verify_kernel as kernel  # noqa: E402  (needs triton)
from engine.sampling.kernels.hash_rng import uniform_at  # noqa: E402

LONG = os.environ.get("ENGINE_LONG_TESTS") == "1"
EXAMPLES = 300 if LONG else 12
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclasses.dataclass
class Step:
    """One step's verification inputs beside its batch."""

    batch: Batch
    drafts: torch.Tensor  # [rows] int64 resolved
    tokens: torch.Tensor  # [rows] int64 the sampler's draws
    errors: torch.Tensor  # [rows] int64 RowError
    seeds: torch.Tensor  # [reqs] int64
    positions: torch.Tensor  # [reqs] int64
    top_ks: torch.Tensor  # [reqs] int32
    control_slots: torch.Tensor  # [reqs] int64
    counts: torch.Tensor  # [slots, V] int32
    write_slots: torch.Tensor  # [reqs] int64
    next_tokens: torch.Tensor  # [reqs, K] int64
    next_logprobs: torch.Tensor  # [reqs, K] f32
    pool_logprobs: torch.Tensor  # like batch.pool_tokens, f32
    weights: torch.Tensor  # [rows, V] f32 kept weights
    one_hot: torch.Tensor  # [rows] int64, -1 none
    draft_probs: torch.Tensor  # [rows, V] f32
    has_q: torch.Tensor  # [rows] bool
    mass_total: torch.Tensor = dataclasses.field(init=False)  # [rows] f64: the kept masses floor(w * 2**S), summed

    def __post_init__(self) -> None:
        self.mass_total = torch.floor(self.weights * 2.0**mass_bits(self.batch.vocab)).to(torch.float64).sum(-1)


def random_step(batch: Batch, seed: int, *, near_top: bool = False) -> Step:
    """`near_top`: each draft is one of its row's five largest logits (top-k space decides at the cut)."""
    rng = np.random.default_rng(seed)
    rows, v, n, k = batch.rows, batch.vocab, batch.num_reqs, max(batch.max_drafts, 1)
    drafts = batch.resolved_drafts()
    if near_top:
        ranked = torch.sort(batch.logits, dim=1, descending=True, stable=True).indices  # NaN first, as topk
        drafts = torch.where(drafts >= 0, ranked[torch.arange(rows), torch.from_numpy(rng.integers(0, 5, rows))], drafts)
    guesses = torch.from_numpy(rng.integers(0, v, rows))
    tokens = torch.where((drafts >= 0) & torch.from_numpy(rng.random(rows) < 0.7), drafts, guesses)
    errors = torch.from_numpy(np.where(rng.random(rows) < 0.06, rng.integers(1, 5, rows), 0))
    weights = np.exp(rng.normal(-2.0, 2.0, (rows, v))).clip(max=1.0).astype(np.float32)
    weights[rng.random((rows, v)) < 0.3] = 0.0
    heavy = (drafts.numpy() >= 0) & (rng.random(rows) < 0.4)  # drafts the target likes: rejections move mass
    weights[heavy, drafts.numpy()[heavy]] = 1.0
    weights[rng.random(rows) < 0.08] = np.nan  # a failed row's weights
    weights[rng.random(rows) < 0.05] = 0.0  # a row with nothing kept
    one_hot = np.where(rng.random(rows) < 0.2, rng.integers(0, v, rows), -1)
    q = rng.dirichlet(np.full(v, 0.3), rows).astype(np.float32)
    has_q = rng.random(rows) < 0.5
    for r in range(rows):  # p == q one-hot, and a draft elsewhere: the residual is empty
        if rng.random() < 0.1 and drafts[r] >= 0:
            one_hot[r] = (int(drafts[r]) + 1) % v
            q[r] = 0.0
            q[r, one_hot[r]] = 1.0
            has_q[r] = True
    slots = n + 1
    pool_slots = len(batch.pool_tokens) // k - 1
    control_slots = np.where(rng.random(n) < 0.7, rng.permutation(np.arange(1, slots))[:n], 0)
    return Step(
        batch, drafts, tokens, errors,
        torch.from_numpy(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)),
        torch.from_numpy(rng.integers(0, 5000, n)),
        torch.from_numpy(rng.choice([0, 1, 2, 3, v + 5], n).astype(np.int32)),
        torch.from_numpy(control_slots.astype(np.int64)),
        torch.from_numpy(rng.integers(0, 3, (slots, v)).astype(np.int32)),
        torch.from_numpy(rng.integers(0, pool_slots, n)),
        torch.from_numpy(rng.integers(-1, v, (n, k))),
        torch.from_numpy(rng.normal(-1.0, 1.0, (n, k)).astype(np.float32)),
        torch.full(batch.pool_tokens.shape, -float("inf")),
        torch.from_numpy(weights), torch.from_numpy(one_hot), torch.from_numpy(q), torch.from_numpy(has_q))


def mass_bits(vocab: int) -> int:
    """S of the sampler's masses (engine/sampling/thresholds.py): V * 2**S <= 2**52."""
    return 52 - max(1, (vocab - 1).bit_length())


def target_p(step: Step) -> torch.Tensor:
    """[rows, V] f64: p as the sampler defines it, from the kept weights' masses; one-hot rows."""
    total = step.mass_total[:, None]
    p = torch.floor(step.weights * 2.0**mass_bits(step.batch.vocab)).to(torch.float64) / torch.where(total > 0, total, torch.ones_like(total))
    one_hot = (torch.arange(step.batch.vocab) == step.one_hot[:, None]).to(torch.float64)
    return torch.where((step.one_hot >= 0)[:, None], one_hot, p)


def _buffers(step: Step, mode: str) -> SimpleNamespace:
    """The static buffers the torch path's step functions read and write."""
    b = step.batch
    out = SimpleNamespace(tokens=step.tokens.clone(), error=step.errors.clone())
    inputs = SimpleNamespace(row_to_req=b.row_to_req, local_step=b.local_step, control_slots=step.control_slots,
                             mtp_info_write_slots=step.write_slots, next_draft_tokens=step.next_tokens,
                             next_draft_logprobs=step.next_logprobs)
    params = dataclasses.replace(RowParams.neutral(b.num_reqs, b.rows), top_ks=step.top_ks, seeds=step.seeds,
                                 sample_positions=step.positions, row_to_req=b.row_to_req, local_step=b.local_step)
    return SimpleNamespace(out=out, inputs=inputs, rows_per_req=b.max_drafts + 1, logits=b.logits,
                           resolved_drafts=step.drafts, num_accepted=torch.zeros(b.num_reqs, dtype=torch.int64),
                           emitted=torch.full((b.rows,), -1, dtype=torch.int64), pool_tokens=b.pool_tokens.clone(),
                           pool_logprobs=step.pool_logprobs.clone(), rows_for=lambda bucket: b.rows,
                           params=lambda bucket: params)


def _controls(step: Step, config: EngineConfig) -> SamplingControls:
    controls = SamplingControls(config, step.batch.vocab, step.batch.rows, torch.device("cpu"))
    controls.counts.copy_(step.counts)
    return controls


def torch_path(step: Step, mode: str, top_k_width: int | None) -> SimpleNamespace:
    """The torch path's verification, pool writes and counts over the step."""
    b = step.batch
    config = EngineConfig(max_num_reqs=b.num_reqs, max_draft_tokens=b.max_drafts, verify_mode=mode if mode != "none" else "strict",
                          draft_pool_slots=len(b.pool_tokens) // max(b.max_drafts, 1) - 1 if b.max_drafts else None,
                          top_k_space_verify=top_k_width is not None, max_control_slots=len(step.counts) - 1,
                          sampler=SamplerConfig(candidate_cap=top_k_width or 1024, max_logprobs=0), device="cpu")
    buffers = _buffers(step, mode)
    if mode == "strict":
        verify_and_store_drafts(buffers, config, b.num_reqs)
    elif mode == "rejection":
        q = torch.where(step.has_q[:, None], step.draft_probs,
                        torch.zeros_like(step.draft_probs).scatter_(1, step.drafts.clamp(min=0)[:, None], 1.0))
        position = step.positions[b.row_to_req] + b.local_step
        verify_rejection(target_p(step), step.drafts, q, step.seeds, position, b.row_to_req, b.local_step,
                         b.num_reqs, buffers.emitted, row_tokens=step.tokens, out=buffers.num_accepted)
        slots = torch.where(step.write_slots > 0, step.write_slots, config.pool_slots)  # the torch path's pool write
        pool_rows = (slots[:, None] * b.max_drafts + torch.arange(b.max_drafts)).flatten()
        buffers.pool_tokens.index_copy_(0, pool_rows, step.next_tokens[:, : b.max_drafts].flatten())
        buffers.pool_logprobs.index_copy_(0, pool_rows, step.next_logprobs[:, : b.max_drafts].flatten())
    controls = _controls(step, config)
    controls.count(buffers, config, b.num_reqs)
    return SimpleNamespace(num_accepted=buffers.num_accepted, emitted=buffers.emitted, pool_tokens=buffers.pool_tokens,
                           pool_logprobs=buffers.pool_logprobs, counts=controls.counts, counted_index=controls.counted_index)


def kernel_outputs(step: Step, mode: str, top_k_width: int | None, programs: int, block: int) -> SimpleNamespace:
    """The buffers the kernels write (the static buffers of a step), filled with values they must overwrite."""
    b = step.batch
    rows, reqs, v = b.rows, b.num_reqs, b.vocab
    got = SimpleNamespace(num_accepted=torch.full((reqs,), -7, dtype=torch.int64),
                          emitted=torch.full((rows,), -7, dtype=torch.int64), pool_tokens=b.pool_tokens.clone(),
                          pool_logprobs=step.pool_logprobs.clone(), counts=step.counts.clone(),
                          counted_index=torch.full((rows,), -7, dtype=torch.int64))
    if mode == "rejection":
        got.residual_sums = torch.full((reqs, kernel.split_for(reqs, v, block, programs), 2), -7, dtype=torch.int64)
    if top_k_width is not None:
        got.rank_counts = torch.full((rows, kernel.split_for(rows, v, block, programs)), -7, dtype=torch.int32)
    return got


def launch(step: Step, mode: str, top_k_width: int | None, got: SimpleNamespace, block: int) -> None:
    """The kernels over the step: the chunk kernel the mode needs, then `verify_step`."""
    b = step.batch
    pool = b.max_drafts > 0
    rejection = {}
    if mode == "rejection":
        rejection = dict(weights=step.weights, mass_total=step.mass_total, one_hot_tokens=step.one_hot,
                         draft_probs=step.draft_probs, has_draft_probs=step.has_q, seeds=step.seeds,
                         sample_positions=step.positions)
        torch.ops.engine.verify_residual_chunks(step.drafts, b.row_to_req, b.local_step, *rejection.values(),
                                                got.residual_sums, block)
        rejection["residual_sums"] = got.residual_sums
    if top_k_width is not None:
        torch.ops.engine.verify_rank_chunks(b.logits, step.tokens, step.drafts, b.row_to_req, step.top_ks,
                                            got.rank_counts, block)
    torch.ops.engine.verify_step(
        step.tokens, step.errors, step.drafts, b.row_to_req, b.local_step, got.num_accepted, got.emitted,
        **{name: rejection.get(name) for name in ("weights", "mass_total", "one_hot_tokens", "draft_probs",
                                                  "has_draft_probs", "seeds", "sample_positions", "residual_sums")},
        rank_counts=getattr(got, "rank_counts", None), top_ks=step.top_ks if top_k_width is not None else None,
        write_slots=step.write_slots if pool else None, next_tokens=step.next_tokens if pool else None,
        next_logprobs=step.next_logprobs if pool else None, pool_tokens=got.pool_tokens if pool else None,
        pool_logprobs=got.pool_logprobs if pool else None, control_slots=step.control_slots, counts=got.counts,
        counted_index=got.counted_index, mode=mode, max_drafts=b.max_drafts, rows_per_req=b.max_drafts + 1,
        top_k_width=min(top_k_width or b.vocab, b.vocab), block=block)


def kernels(step: Step, mode: str, top_k_width: int | None, *, programs: int, block: int) -> SimpleNamespace:
    got = kernel_outputs(step, mode, top_k_width, programs, block)
    launch(step, mode, top_k_width, got, block)
    return got


def check(step: Step, mode: str, top_k_width: int | None, programs: int, block: int) -> None:
    expected = torch_path(step, mode, top_k_width)
    got = kernels(step, mode, top_k_width, programs=programs, block=block)
    if mode != "none":
        assert torch.equal(got.num_accepted, expected.num_accepted)
    if mode == "rejection":
        assert torch.equal(got.emitted, expected.emitted)
    k = max(step.batch.max_drafts, 1)
    written = slice(0, len(step.batch.pool_tokens) - k)  # the last slot takes the torch path's writes to slot 0
    assert torch.equal(got.pool_tokens[written], expected.pool_tokens[written])
    assert torch.equal(got.pool_logprobs[written], expected.pool_logprobs[written])
    assert torch.equal(got.pool_tokens[written.stop:], step.batch.pool_tokens[written.stop:])  # never written
    assert torch.equal(got.counted_index, expected.counted_index)
    assert torch.equal(got.counts, expected.counts)


@SETTINGS
@given(batch=batches(max_drafts=(1, 3)), seed=st.integers(0, 2**32 - 1), programs=st.sampled_from([1, 8]),
       block=st.sampled_from([32, 256]))
def test_rejection_kernels_equal_the_torch_path(batch: Batch, seed: int, programs: int, block: int):
    check(random_step(batch, seed), "rejection", None, programs, block)


@settings(max_examples=3 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # cheap
@given(batch=batches(max_drafts=(1, 3)), seed=st.integers(0, 2**32 - 1), top_k=st.sampled_from([None, 2, 1024, 1024]),
       programs=st.sampled_from([1, 8]))
def test_strict_kernels_equal_the_torch_path(batch: Batch, seed: int, top_k: int | None, programs: int):
    """Logits on a grid of 0.5: a draft often ties with the k-th largest score."""
    batch = dataclasses.replace(batch, logits=torch.round(batch.logits * 2) / 2)
    check(random_step(batch, seed, near_top=top_k is not None), "strict", top_k, programs, 64)


def tiny_residual_step(batch: Batch, seed: int, chunk: int) -> Step:
    """Every row: token 0 holds almost all of p (q = 1 there); the last token of each chunk of
    `chunk` tokens about 2**-35, with q = p rounded down to f32; token V-1 outside the kept set
    with q = 0.5, the draft of every row that has one; the rest outside the kept set. The draft
    is always rejected, and the residual's masses are integers 0..3 at the chunks' ends: the
    level floor(u * total) often equals a running mass, of a token or of a chunk, where `>` and
    `>=` pick different tokens."""
    rng = np.random.default_rng(seed)
    step = random_step(batch, seed)
    rows, v = batch.rows, batch.vocab
    weights = np.zeros((rows, v), np.float32)
    weights[:, 0] = 1.0
    ends = np.arange(chunk - 1, v - 1, chunk)
    weights[:, ends] = np.exp2(rng.uniform(-36.0, -34.0, (rows, len(ends))))
    drafts = torch.where(step.drafts >= 0, v - 1, step.drafts)
    step = dataclasses.replace(step, drafts=drafts, weights=torch.from_numpy(weights), one_hot=torch.full((rows,), -1),
                               has_q=torch.ones(rows, dtype=torch.bool))
    p = target_p(step)
    q = p.float()
    q = torch.where(q.double() > p, torch.nextafter(q, torch.zeros_like(q)), q)  # toward zero: p - q in [0, ulp)
    q[:, 0], q[:, -1] = 1.0, 0.5
    return dataclasses.replace(step, draft_probs=q)


@settings(max_examples=max(EXAMPLES // 3, 4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(vocabs=(45, 200), max_drafts=(1, 3)), seed=st.integers(0, 2**32 - 1))
def test_rejection_kernels_draw_the_torch_paths_token_from_tiny_residuals(batch: Batch, seed: int):
    """Chunks of 16 tokens (64 programs): the kernel's search over the chunk sums and within a chunk."""
    check(tiny_residual_step(batch, seed, 16), "rejection", None, 64, 16)


@settings(max_examples=max(EXAMPLES // 2, 4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_drafts=(0,)), seed=st.integers(0, 2**32 - 1))
def test_counts_without_drafts_equal_the_torch_path(batch: Batch, seed: int):
    check(random_step(batch, seed), "none", None, 1, 64)


@settings(max_examples=1, deadline=None)
@given(batch=batches(vocabs=(200,), max_drafts=(3,)), seed=st.integers(0, 2**32 - 1))
def test_each_kernel_is_one_capture_safe_op_on_cpu_and_on_fake_cuda(batch: Batch, seed: int):
    """Each op once under the capture-safety check, interpreted on the CPU and as a fake-CUDA
    dry run (which launches nothing); the buffers they write keep their addresses."""
    from graphs.capture_safety import capture_safety_check
    from profiling.fake_cuda import FakeCuda

    step = random_step(batch, seed)
    for mode, top_k, chunk_op in (("rejection", None, "verify_residual_chunks"), ("strict", 3, "verify_rank_chunks")):
        expected = {f"engine.{chunk_op}.default": 1, "engine.verify_step.default": 1}
        got = kernel_outputs(step, mode, top_k, 8, 64)
        with capture_safety_check(vars(got)) as stats:
            launch(step, mode, top_k, got, 64)
        assert stats.op_counts == expected
        with FakeCuda() as fake:
            on_device = SimpleNamespace(**{k: v.to("cuda") if isinstance(v, torch.Tensor) else v
                                           for k, v in vars(step).items() if k != "batch"})
            on_device.batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to("cuda")
                                                            for f in dataclasses.fields(batch)
                                                            if isinstance(getattr(batch, f.name), torch.Tensor)})
            device_got = SimpleNamespace(**{k: v.to("cuda") for k, v in vars(got).items()})
            with capture_safety_check(vars(device_got), device="cuda", is_pinned=fake.is_pinned) as stats:
                launch(on_device, mode, top_k, device_got, 64)
        assert stats.op_counts == expected


@triton.jit
def _uniform_kernel(seed_ptr, position_ptr, out_ptr, STREAM: triton.language.constexpr):
    lanes = triton.language.arange(0, 64)
    seed = triton.language.load(seed_ptr + lanes)
    position = triton.language.load(position_ptr + lanes)
    triton.language.store(out_ptr + lanes, uniform_at(seed, position, STREAM))


def test_the_kernels_hash_gives_the_uniforms_of_engine_sampling_draw():
    """Extreme seeds (negative int64 = seeds >= 2**63) and positions, both streams: the same f64 bits."""
    from engine.sampling import draw as rng

    gen = torch.Generator().manual_seed(3)
    seed = torch.randint(-(2**63), 2**63 - 1, (64,), generator=gen, dtype=torch.int64)
    seed[:4] = torch.tensor([0, -1, 2**63 - 1, -(2**63)])
    position = torch.randint(0, 2**40, (64,), generator=gen, dtype=torch.int64)
    position[:3] = torch.tensor([0, 2**32 - 1, 2**32])
    for stream in (rng.ACCEPT, rng.RESIDUAL):
        out = torch.zeros(64, dtype=torch.float64)
        _uniform_kernel[(1,)](seed, position, out, STREAM=stream)
        assert torch.equal(out, rng.uniform(seed, position, stream, torch.zeros((), dtype=torch.int64)))


def test_inverse_cdf_over_masses_picks_the_first_token_past_floor_u_times_total():
    """The residual draw's definition (engine.sampling.draw.inverse_cdf), by hand: the first token whose
    running mass exceeds floor(u * total); a token of mass 0 is never picked; an all-zero row gives 0."""
    from engine.sampling.draw import inverse_cdf, probability_masses

    masses = torch.tensor([[2, 0, 2, 4], [2, 0, 2, 4], [0, 0, 0, 0], [0, 3, 0, 0]])
    u = torch.tensor([0.5, 0.49, 0.7, 0.999], dtype=torch.float64)  # levels 4, 3, 0, 2
    assert inverse_cdf(masses, u).tolist() == [3, 2, 0, 1]
    probs = torch.tensor([[0.5, 2.0**-61, float("nan"), 0.25]], dtype=torch.float64)
    assert probability_masses(probs).tolist() == [[2**59, 0, 0, 2**58]]
