"""The controls kernel (engine/sampling/kernels/controls_kernel.py) against the torch path, under
Triton's interpreter on CPU tensors.

References: the torch stage functions composed in vLLM V1's order, which the torch path
adopts (`engine.sampling.sampler` on h-vllm): allowed tokens -> token bitmask -> EOS/stop
suppression (a per-row loop here) -> logit bias -> penalties; and `SamplingControls.apply`
itself where main's order (penalties -> bias -> allowed tokens, then the bitmask) gives
the same values and flags: no logit bias, no logit a penalty overflows.
Random batches (tests/kernel_batches.py): drafts 0..K per request, pool reads, padding
rows, every control, NaN and -inf rows, rows the bitmask leaves nothing.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling.allowed_tokens import apply_allowed_tokens_
from engine.sampling.logit_bias import apply_logit_bias_
from engine.sampling.penalties import apply_penalties_
from engine.sampling.token_bitmask import apply_token_bitmask, bitmask_words
from tests.kernel_batches import Batch, batches, same_values
from tests.kernel_interpreter import torch_math

triton = pytest.importorskip("triton")
from engine.sampling.kernels import controls as kernel  # noqa: E402  (needs triton)

# Huge logits times a penalty overflow to inf in the interpreter's numpy, as IEEE (and torch) say they should.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
LONG = os.environ.get("ENGINE_LONG_TESTS") == "1"
EXAMPLES = 400 if LONG else 10
NUM_STOPS = 3
MAX_BIAS = 6


@dataclass
class Controls:
    """The control slots' state, laid out as `SamplingControls` holds it, plus the step's per-row inputs."""

    counts: torch.Tensor  # [slots, V] int32
    prompt_words: torch.Tensor  # [slots, W] int32
    penalties: torch.Tensor  # [slots, 3] f32
    bias_ids: torch.Tensor  # [slots, L] int64
    bias_values: torch.Tensor  # [slots, L] f32
    allowed_words: torch.Tensor  # [slots, W] int32
    restricted: torch.Tensor  # [slots] bool
    control_slots: torch.Tensor  # [reqs] int64
    stop_ids: torch.Tensor  # [reqs, S] int64
    eos_rows: torch.Tensor  # [rows] bool
    bitmask: torch.Tensor | None  # [rows, W] int32


def pack(tokens: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.zeros(bitmask_words(vocab) * 32, dtype=bool)
    bits[np.asarray(tokens, dtype=np.int64)] = True
    return np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little").view("<i4").reshape(-1)


def random_controls(rng: np.random.Generator, batch: Batch, *, bias: bool = True, bitmask: bool = True) -> Controls:
    v, n, rows = batch.vocab, batch.num_reqs, batch.rows
    slots = n + 2
    words = bitmask_words(v)
    counts = (rng.integers(1, 4, (slots, v)) * (rng.random((slots, v)) < 0.1)).astype(np.int32)
    prompt = np.stack([pack(rng.integers(0, v, rng.integers(0, 8)), v) for _ in range(slots)])
    penalties = np.array([[rng.choice([1.0, 1.0, 0.5, 1.7]), rng.choice([0.0, 0.7, -1.3]),
                           rng.choice([0.0, 2.0, -0.4])] for _ in range(slots)], dtype=np.float32)
    bias_ids = np.zeros((slots, MAX_BIAS), np.int64)
    bias_values = np.zeros((slots, MAX_BIAS), np.float32)
    allowed = np.zeros((slots, words), np.int32)
    restricted = rng.random(slots) < 0.3
    for s in range(1, slots):
        if bias:
            ids = rng.choice(v, int(rng.integers(0, MAX_BIAS + 1)), replace=False)
            bias_ids[s, : len(ids)] = ids
            bias_values[s, : len(ids)] = rng.choice([-100.0, 100.0, 2.5, -0.75, 0.0, -0.0], len(ids))
        allowed[s] = pack(rng.choice(v, int(rng.integers(1, v // 3)), replace=False), v)
    counts[0], prompt[0], penalties[0], restricted[0] = 0, 0, (1.0, 0.0, 0.0), False  # slot 0: neutral
    control_slots = np.where(rng.random(n) < 0.7, rng.permutation(np.arange(1, slots))[:n], 0)
    control_slots[~np.isin(np.arange(n), batch.row_to_req[batch.real].numpy())] = 0  # a padding request
    stop_ids = np.where(rng.random((n, NUM_STOPS)) < 0.6, rng.integers(0, v, (n, NUM_STOPS)), -1)
    eos_rows = (rng.random(rows) < 0.4) & batch.real.numpy()
    mask = None
    if bitmask and rng.random() < 0.6:
        mask = np.full((rows, words), -1, np.int32)
        for r in range(rows):
            kind = rng.random()
            if kind < 0.3 and eos_rows[r]:  # only the stop ids: allowed, then suppressed (not "nothing allowed")
                stops = stop_ids[int(batch.row_to_req[r])]
                mask[r] = pack(stops[stops >= 0], v)
            elif kind < 0.5:
                mask[r] = rng.integers(-(2**31), 2**31, words)
            elif kind < 0.6:
                mask[r] = 0  # nothing allowed
            elif kind < 0.7:  # only tokens whose logits are -inf: nothing allowed with a finite score
                mask[r] = pack(np.flatnonzero(batch.logits[r].numpy() == -np.inf), v)
    t = torch.from_numpy
    return Controls(t(counts), t(prompt.astype(np.int32)), t(penalties), t(bias_ids), t(bias_values), t(allowed),
                    t(restricted), t(control_slots.astype(np.int64)), t(stop_ids.astype(np.int64)), t(eos_rows),
                    None if mask is None else t(mask))


def draft_counts(batch: Batch, c: Controls) -> torch.Tensor:
    """[rows, V] int32: each row's counts with the drafts of its request's earlier rows added."""
    slot = c.control_slots[batch.row_to_req]
    counts = c.counts[slot].clone()
    resolved = batch.resolved_drafts()
    for d in range(1, batch.max_drafts + 1):
        earlier = batch.local_step >= d
        draft = resolved[(torch.arange(batch.rows) - d).clamp(min=0)]
        counts.scatter_add_(1, draft.clamp(0, batch.vocab - 1)[:, None], (earlier & (draft >= 0)).to(torch.int32)[:, None])
    return counts


def suppressed(x: torch.Tensor, batch: Batch, c: Controls) -> torch.Tensor:
    """EOS/stop suppression, row by row: a row flagged in `eos_rows` gives its request's stop ids -inf."""
    x = x.clone()
    for r in range(batch.rows):
        if c.eos_rows[r]:
            for stop in c.stop_ids[int(batch.row_to_req[r])].tolist():
                if stop >= 0:
                    x[r, stop] = float("-inf")
    return x


def masked_and_suppressed(x: torch.Tensor, batch: Batch, c: Controls) -> tuple[torch.Tensor, torch.Tensor]:
    """The token bitmask, then the EOS/stop suppression, over scores `x`; and the rows the bitmask fails."""
    nothing = torch.zeros(batch.rows, dtype=torch.bool)
    if c.bitmask is not None:
        x, nothing = apply_token_bitmask(x, c.bitmask)
    return suppressed(x, batch, c), nothing


def vllm_order(batch: Batch, c: Controls) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch stage functions in vLLM's order: allowed tokens -> token bitmask -> suppression
    -> logit bias -> penalties."""
    slot = c.control_slots[batch.row_to_req]
    x = batch.logits.clone()
    apply_allowed_tokens_(x, c.allowed_words[slot], c.restricted[slot])
    x, nothing = masked_and_suppressed(x, batch, c)
    apply_logit_bias_(x, c.bias_ids[slot], c.bias_values[slot])
    pen = c.penalties[slot]
    apply_penalties_(x, draft_counts(batch, c), c.prompt_words[slot], pen[:, 0], pen[:, 1], pen[:, 2])
    return x, nothing


def op_args(batch: Batch, c: Controls, out: SimpleNamespace, masked_rows: torch.Tensor | None, programs: int,
            block: int, bias_block: int = 128) -> list:
    """`engine::apply_controls`'s arguments, in order."""
    return [batch.logits, out.scores, out.controlled, out.nothing, out.arrivals, out.resolved,
            batch.row_to_req, batch.local_step, c.control_slots, batch.row_drafts, batch.read_rows, batch.pool_tokens,
            c.counts, c.prompt_words, c.penalties, c.bias_ids, c.bias_values, c.allowed_words, c.restricted,
            c.stop_ids, c.eos_rows, c.bitmask, masked_rows, batch.max_drafts, programs, block, bias_block]


def outputs(rows: int, vocab: int) -> SimpleNamespace:
    """The op's outputs, filled with values it must overwrite (or, for skipped rows, leave)."""
    return SimpleNamespace(scores=torch.full((rows, vocab), 7.25), controlled=torch.ones(rows, dtype=torch.bool),
                           nothing=torch.ones(rows, dtype=torch.bool), arrivals=torch.zeros(rows, dtype=torch.int32),
                           resolved=torch.full((rows,), -9, dtype=torch.int64))


def run_kernel(batch: Batch, c: Controls, *, masked_rows: torch.Tensor | None = None, programs: int = 1,
               block: int = 64, bias_block: int = 128, pass_one: kernel.PassOne | None = None,
               raw_max: torch.Tensor | None = None) -> SimpleNamespace:
    out = outputs(*batch.logits.shape)
    handoff = () if pass_one is None else (*vars(pass_one).values(), True, raw_max)
    torch.ops.engine.apply_controls(*op_args(batch, c, out, masked_rows, programs, block, bias_block), *handoff)
    return out


def check(batch: Batch, c: Controls, out: SimpleNamespace, expected: torch.Tensor, nothing: torch.Tensor,
          masked: torch.Tensor) -> None:
    slot = c.control_slots[batch.row_to_req]
    suppressing = c.eos_rows & (c.stop_ids[batch.row_to_req] >= 0).any(-1)
    controlled = (slot > 0) | suppressing | masked
    assert torch.equal(out.controlled, controlled)
    for r in range(batch.rows):
        if controlled[r]:
            assert same_values(out.scores[r], expected[r]), f"row {r}"
        else:  # skipped: its scores are the logits, and `out` was not written
            assert same_values(batch.logits[r], expected[r]) and bool((out.scores[r] == 7.25).all()), f"row {r}"
    assert torch.equal(out.nothing, nothing & masked)
    assert not out.arrivals.any()
    if batch.max_drafts:
        assert torch.equal(out.resolved, batch.resolved_drafts())


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), seed=st.integers(0, 2**32 - 1), programs=st.sampled_from([1, 16]),
       block=st.sampled_from([64, 256]), bias_block=st.sampled_from([2, 128]))
def test_controls_kernel_equals_the_stages_in_vllm_order(batch: Batch, seed: int, programs: int, block: int,
                                                         bias_block: int):
    """Bias lists over several blocks of entries (some of them 0.0) when `bias_block` is 2."""
    c = random_controls(np.random.default_rng(seed), batch)
    expected, nothing = vllm_order(batch, c)
    out = run_kernel(batch, c, programs=programs, block=block, bias_block=bias_block)
    masked = torch.full((batch.rows,), c.bitmask is not None)
    check(batch, c, out, expected, nothing, masked)


@settings(max_examples=max(EXAMPLES // 3, 3), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_drafts=(0, 2)), seed=st.integers(0, 2**32 - 1))
def test_masked_rows_flag_skips_unrestricted_rows(batch: Batch, seed: int):
    """With `masked_rows`, a row outside it ignores the bitmask: `nothing_allowed` stays False."""
    rng = np.random.default_rng(seed)
    c = random_controls(rng, batch)
    if c.bitmask is None:
        c.bitmask = torch.full((batch.rows, bitmask_words(batch.vocab)), -1, dtype=torch.int32)
    masked = torch.from_numpy(rng.random(batch.rows) < 0.5)
    c.bitmask[~masked] = -1  # what the host stages for rows it does not restrict
    expected, nothing = vllm_order(batch, c)
    out = run_kernel(batch, c, masked_rows=masked, programs=4)
    check(batch, c, out, expected, nothing, masked)


class _Buffers:
    """What `SamplingControls.apply` reads of the step's static buffers."""

    def __init__(self, batch: Batch, control_slots: torch.Tensor) -> None:
        self.logits = batch.logits.clone()
        self.rows_per_req = batch.max_drafts + 1
        self.resolved_drafts = batch.resolved_drafts()
        self.inputs = SimpleNamespace(local_step=batch.local_step, row_to_req=batch.row_to_req,
                                      control_slots=control_slots)

    def rows_for(self, bucket: int) -> int:
        return self.logits.shape[0]


@settings(max_examples=max(EXAMPLES // 3, 3), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), seed=st.integers(0, 2**32 - 1))
def test_controls_kernel_equals_sampling_controls_apply(batch: Batch, seed: int):
    """The torch stages over `SamplingControls.rows` (slots filled by `join`) where the two orders agree: no logit
    bias, and no finite logit a penalty takes to -inf (the bitmask's verdict reads the scores after
    the penalties there, before them in vLLM's order): logits within +-1e30."""
    from engine.host.params import SamplingParams
    from engine.sampling.allowed_tokens import apply_allowed_tokens_
    from engine.sampling.penalties import apply_penalties_
    from engine.step.engine_config import EngineConfig
    from engine.step.control_state import SamplingControls

    finite = batch.logits.isfinite()
    batch = dataclasses.replace(batch, logits=torch.where(finite, batch.logits.clamp(-1e30, 1e30), batch.logits))
    rng = np.random.default_rng(seed)
    c = random_controls(rng, batch, bias=False)
    state = SamplingControls(EngineConfig(max_control_slots=c.counts.shape[0] - 1, max_logit_bias=MAX_BIAS,
                                          device="cpu"), batch.vocab, batch.rows, torch.device("cpu"))
    for slot in range(1, c.counts.shape[0]):
        allowed = np.flatnonzero(np.unpackbits(c.allowed_words[slot].numpy().view(np.uint8), bitorder="little"))
        rp, fp, pp = (float(x) for x in c.penalties[slot])
        params = SamplingParams(repetition_penalty=rp, frequency_penalty=fp, presence_penalty=pp,
                                allowed_token_ids=allowed.tolist() if c.restricted[slot] else None)
        prompt = np.flatnonzero(np.unpackbits(c.prompt_words[slot].numpy().view(np.uint8), bitorder="little"))
        assert state.join(params, prompt.tolist()) == slot
        state.counts[slot] = c.counts[slot]
    buffers = _Buffers(batch, c.control_slots)
    # The torch stages of the controls, as engine.sampling.sampler runs them on each row's
    # gathered slot (`SamplingControls.rows`): allowed tokens, then the penalties (no bias here).
    rows = state.rows(buffers, batch.num_reqs)
    apply_allowed_tokens_(buffers.logits, rows.allowed_words, rows.restricted)
    apply_penalties_(buffers.logits, rows.counts, rows.prompt_words, rows.penalties[:, 0], rows.penalties[:, 1],
                     rows.penalties[:, 2])
    expected, nothing = masked_and_suppressed(buffers.logits, batch, c)
    c = dataclasses.replace(c, prompt_words=state.prompt_words, allowed_words=state.allowed_words,
                            restricted=state.restricted, penalties=state.penalties, bias_ids=state.bias_ids,
                            bias_values=state.bias_values)
    out = run_kernel(batch, c, programs=2)
    check(batch, c, out, expected, nothing, torch.full((batch.rows,), c.bitmask is not None))


@settings(max_examples=1, deadline=None)
@given(batch=batches(vocabs=(200,), max_drafts=(3,)), seed=st.integers(0, 2**32 - 1))
def test_apply_controls_is_one_capture_safe_op_on_cpu_and_on_fake_cuda(batch: Batch, seed: int):
    """One op under the capture-safety check, interpreted on the CPU and as a fake-CUDA dry run
    (which launches nothing); its outputs are static buffers that keep their addresses."""
    from graphs.capture_safety import capture_safety_check
    from profiling.fake_cuda import FakeCuda

    c = random_controls(np.random.default_rng(seed), batch)
    out = outputs(*batch.logits.shape)
    args = op_args(batch, c, out, None, 4, 64)
    with capture_safety_check(vars(out)) as stats:
        torch.ops.engine.apply_controls(*args)
    assert stats.op_counts == {"engine.apply_controls.default": 1}
    with FakeCuda() as fake:
        device_args = [a.to("cuda") if isinstance(a, torch.Tensor) else a for a in args]
        static = {f"out{i}": device_args[i] for i in range(1, 6)}
        with capture_safety_check(static, device="cuda", is_pinned=fake.is_pinned) as stats:
            torch.ops.engine.apply_controls(*device_args)
    assert stats.op_counts == {"engine.apply_controls.default": 1}


def test_apply_controls_refuses_what_it_cannot_read():
    """ValueError before any launch: `out` in the logits' memory, a wrong dtype, a bitmask of the wrong shape."""
    batch = Batch(45, 0, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.bool),
                  torch.full((2,), -1), torch.zeros(2, dtype=torch.int64), torch.full((1,), 44), torch.zeros(2, 45), 1)
    c = random_controls(np.random.default_rng(0), batch, bitmask=False)
    out = outputs(2, 45)
    args = op_args(batch, c, out, None, 1, 64)
    for position, bad, message in ((1, batch.logits, "shares its memory"), (0, batch.logits.double(), "logits is"),
                                   (21, torch.zeros(2, 1, dtype=torch.int32), "token_bitmask")):
        with pytest.raises(ValueError, match=message):
            torch.ops.engine.apply_controls(*args[:position], bad, *args[position + 1:])
    with pytest.raises(ValueError, match="raw_max without a PassOne"):  # raw masses need the handed raw top-N
        torch.ops.engine.apply_controls(*args, raw_max=torch.zeros(2, dtype=torch.int64))


def test_bitmask_verdict_reads_the_scores_before_the_penalties():
    """A row whose one allowed token has a huge negative logit that the repetition penalty takes
    to -inf: in vLLM's order the bitmask saw a finite score, so the row is not the bitmask's failure."""
    vocab = 40
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, 5] = -3e38
    batch = Batch(vocab, 0, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                  torch.ones(1, dtype=torch.bool), torch.full((1,), -1), torch.zeros(1, dtype=torch.int64),
                  torch.full((1,), vocab - 1), logits, 1)
    c = random_controls(np.random.default_rng(1), batch, bias=False, bitmask=False)
    c.control_slots[:] = 1
    c.restricted[1] = False
    c.penalties[1] = torch.tensor([2.0, 0.0, 0.0])
    c.prompt_words[1] = torch.from_numpy(pack(np.array([5]), vocab).astype(np.int32))
    c.bitmask = torch.from_numpy(pack(np.array([5]), vocab).astype(np.int32))[None]
    expected, nothing = vllm_order(batch, c)
    assert not nothing[0] and expected[0, 5] == float("-inf")
    out = run_kernel(batch, c)
    check(batch, c, out, expected, nothing, torch.ones(1, dtype=torch.bool))


# -- the sampler's pass 1, handed over (`PassOne`) --------------------------------------------

NUM_TOP = 3


def raw_max_keys(logits: torch.Tensor) -> torch.Tensor:
    """[rows] int64: each row's largest non-NaN logit keyed as the LM head keys it, by the
    LM head's own function (an input here, not what is checked)."""
    from engine.step.lm_head_kernel import row_max_keys

    return row_max_keys(logits, torch.zeros(logits.shape[0], dtype=torch.int64))


def check_pass_one(batch: Batch, out: SimpleNamespace, pass_one: kernel.PassOne, raw_mass: bool = False) -> None:
    """Each controlled row's PassOne against its scores and logits, by plain torch: the largest
    score (NaN left out) and its smallest index (0 where every score is -inf or NaN), the
    logits' largest non-NaN value, whether one is not finite, and their NUM_TOP largest
    (value descending, id ascending) and, `raw_mass`, the sum of floor(exp(x - max) * 2**S)
    (both checked where every logit is finite)."""
    from engine.sampling.thresholds import mass_bits

    id_bits = max(1, (batch.vocab - 1).bit_length())
    for r in range(batch.rows):
        if not out.controlled[r]:
            continue
        scores, logits = out.scores[r], batch.logits[r]
        clean = torch.where(scores.isnan(), float("-inf"), scores)
        best = clean.max()
        first = 0 if best == float("-inf") else int((clean == best).nonzero()[0])
        raw = torch.where(logits.isnan(), float("-inf"), logits).max()
        assert same_values(pass_one.row_f[r, :1], best[None]) and int(pass_one.row_i[r, 0]) == first, f"row {r}: M"
        assert same_values(pass_one.row_f[r, 1:], raw[None]), f"row {r}: logits' maximum"
        assert int(pass_one.row_i[r, 1]) == int(not bool(logits.isfinite().all())), f"row {r}: finite check"
        if logits.isfinite().all():
            order = sorted(range(batch.vocab), key=lambda t: (-float(logits[t]), t))[:NUM_TOP]
            keys = pass_one.row_top[r, :NUM_TOP]
            ids = ((1 << id_bits) - 1 - (keys & ((1 << id_bits) - 1))).tolist()
            assert ids == order, f"row {r}: top-{NUM_TOP} {ids} != {order}"
            if raw_mass:
                masses = ((logits - logits.max()).exp() * 2.0 ** mass_bits(batch.vocab)).floor()
                assert int(pass_one.row_i[r, 2]) == int(masses.to(torch.int64).sum()), f"row {r}: raw masses"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), seed=st.integers(0, 2**32 - 1), programs=st.sampled_from([1, 16]),
       block=st.sampled_from([64, 256]), bias_block=st.sampled_from([2, 128]))
def test_pass_one_handed_over_is_the_rows_maximum_finite_check_and_top_n(batch: Batch, seed: int, programs: int,
                                                                         block: int, bias_block: int):
    """The scores as without the handoff; every controlled row's PassOne as its scores and
    logits say (bias lists of +-100 and 2.5 over several blocks of entries, rows the bitmask
    leaves nothing, which the last program rewrites whole)."""
    c = random_controls(np.random.default_rng(seed), batch)
    expected, nothing = vllm_order(batch, c)
    pass_one = kernel.PassOne.allocate(batch.rows, batch.vocab, "cpu", NUM_TOP, programs=programs, block=block)
    for tensor in vars(pass_one).values():
        tensor.fill_(-7)  # what the kernel must overwrite
    raw_max = raw_max_keys(batch.logits)
    with torch_math():
        out = run_kernel(batch, c, programs=programs, block=block, bias_block=bias_block, pass_one=pass_one,
                         raw_max=raw_max)
    check(batch, c, out, expected, nothing, torch.full((batch.rows,), c.bitmask is not None))
    check_pass_one(batch, out, pass_one, raw_mass=True)
    assert not raw_max.any(), "the LM head's row maxima are left 0 for the next step"


@pytest.mark.parametrize("bias", [
    {7: -100.0},  # the maximum's token biased below another: its range is read again
    {7: -100.0, 3: 100.0},  # and another raised above it
    {7: -1.0, 9: 1.0},  # the maximum moves to a token whose new score ties nothing
    {20: 1.0},  # a token raised to tie the maximum at a smaller id than... none: 20 > 7
    {2: 1.0},  # raised to tie the maximum at a smaller id: it becomes the first index
    {7: -1.0, 2: 1.0},  # both: the tie is broken by the lowered one
    {150: 1.0},  # raised to tie the maximum in a later program: the first program's index stays
])
@pytest.mark.parametrize("programs", [1, 3])
def test_pass_one_after_a_logit_bias_that_moves_the_maximum(bias, programs):
    """Hand-built bias lists on a row whose maximum (5.0 at token 7) the bias moves: the
    maximum and its first index are the biased scores', in one program or three."""
    vocab = 200
    logits = torch.zeros(1, vocab)
    logits[0, 7], logits[0, 9], logits[0, 2], logits[0, 20], logits[0, 150] = 5.0, 4.5, 4.0, 4.0, 4.0
    batch = Batch(vocab, 0, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                  torch.ones(1, dtype=torch.bool), torch.full((1,), -1), torch.zeros(1, dtype=torch.int64),
                  torch.full((1,), vocab - 1), logits, 1)
    c = random_controls(np.random.default_rng(2), batch, bias=False, bitmask=False)
    c.control_slots[:] = 1
    c.restricted[1], c.penalties[1], c.stop_ids[:] = False, torch.tensor([1.0, 0.0, 0.0]), -1
    for i, (token, value) in enumerate(bias.items()):
        c.bias_ids[1, i], c.bias_values[1, i] = token, value
    expected, nothing = vllm_order(batch, c)
    pass_one = kernel.PassOne.allocate(1, vocab, "cpu", NUM_TOP, programs=programs, block=64)
    out = run_kernel(batch, c, programs=programs, block=64, bias_block=2, pass_one=pass_one)
    check(batch, c, out, expected, nothing, torch.zeros(1, dtype=torch.bool))
    check_pass_one(batch, out, pass_one)


def handed_and_made(batch: Batch, c: Controls, rng: np.random.Generator, programs: int, mode: str | None) -> None:
    """The controls kernel, then `sample_rows` with and without its PassOne: every output the
    same bits (tokens, codes, logprobs, ranks, top-N)."""
    from engine.sampling.kernels.sample import SampleScratch, sample_rows
    from engine.sampling.row_params import RowParams
    from engine.sampling.sample_output import SampleOutput
    pass_one = kernel.PassOne.allocate(batch.rows, batch.vocab, "cpu", NUM_TOP, programs=4, block=64)
    with torch_math():
        made = run_kernel(batch, c, programs=4, pass_one=pass_one, raw_max=raw_max_keys(batch.logits))
    n, rows = batch.num_reqs, batch.rows
    params = RowParams.from_numpy(
        temperatures=np.resize(rng.permutation([0.0, 0.7, 1.0]), n).astype(np.float32),  # greedy and sampled
        top_ks=rng.choice([0, 1, 5, 40], n).astype(np.int32), top_ps=rng.choice([1.0, 0.8, 0.3], n).astype(np.float32),
        min_ps=rng.choice([0.0, 0.0, 0.05], n).astype(np.float32), seeds=np.zeros(n, np.uint64),
        sample_positions=np.zeros(n, np.int64), row_to_req=batch.row_to_req.numpy(),
        local_step=batch.local_step.numpy(), stop_ids=c.stop_ids.numpy(), eos_suppression_rows=c.eos_rows.numpy(),
        forced_tokens=np.where(rng.random(rows) < 0.2, rng.integers(0, batch.vocab, rows), -1),
        draw_uniforms=rng.random(rows))
    outs = []
    for handed in (None, pass_one):
        out = SampleOutput.allocate(rows, NUM_TOP)
        with torch_math():
            sample_rows(made.scores, params, out, SampleScratch.allocate(rows, batch.vocab, "cpu", NUM_TOP),
                        logits=batch.logits, nothing_allowed=made.nothing, logprobs=mode,
                        row_controlled=made.controlled, programs=programs, handed=handed,
                        handed_raw=handed is not None)
        outs.append(out)
    for name, mine in vars(outs[1]).items():
        assert same_values(mine, getattr(outs[0], name)), f"{name}: {mine} != {getattr(outs[0], name)}"


@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("mode", ["raw", "processed", None])
@settings(max_examples=max(EXAMPLES // 3, 3), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_reqs=6), seed=st.integers(0, 2**32 - 1))
def test_the_sampler_handed_pass_one_samples_what_its_own_pass_one_does(batch: Batch, seed: int, programs: int,
                                                                        mode: str | None):
    """Over random batches, controls, cuts, forced tokens and failed rows, in one program a
    row or each row split over 3 (a launch per phase)."""
    rng = np.random.default_rng(seed)
    handed_and_made(batch, random_controls(rng, batch), rng, programs, mode)


@pytest.mark.parametrize("mode", ["raw", "processed", None])
def test_handed_pass_one_on_rows_that_all_sample(mode):
    """A fixed batch whose rows all have controls and finite logits, greedy among them."""
    rng = np.random.default_rng(4)
    rows, vocab = 9, 333
    logits = torch.from_numpy(rng.normal(0.0, 3.0, (rows, vocab)).astype(np.float32))
    batch = Batch(vocab, 0, torch.arange(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64),
                  torch.ones(rows, dtype=torch.bool), torch.full((rows,), -1), torch.zeros(rows, dtype=torch.int64),
                  torch.full((1,), 0), logits, rows)
    c = random_controls(rng, batch, bitmask=False)
    c.control_slots[:] = torch.arange(rows) % (c.counts.shape[0] - 1) + 1
    handed_and_made(batch, c, rng, 1, mode)
