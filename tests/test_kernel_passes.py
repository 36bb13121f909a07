"""How many times the sampling kernel reads a row, per row kind: the table in the docstring
of engine/sampling/kernels/sample.py, counted under Triton's interpreter.

Every load the interpreter executes is counted by address: the elements of the score row
it reads, divided by V, is the number of full passes; the draw reads one more block. The
loads made where a merge settles a row from its kept list (engine/sampling/kernels/
kept_list.py: the listed ids' scores, at most twice the list) are counted apart.
"""
from __future__ import annotations

from collections.abc import Iterator
import sys
from contextlib import contextmanager

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from engine.sampling.kernels import sample as kernel_module
from engine.sampling.kernels.kept_set import LIST_CAP
from engine.sampling.kernels.sample import SampleScratch, sample_rows
from engine.sampling.thresholds import BLOCK
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from tests.kernel_interpreter import torch_math

VOCAB = 3000  # three draw blocks: the last one short


def _from_kept_list() -> bool:
    """Whether the load being made comes from `kept_list` (a frame of that file on the stack)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith("kept_list.py"):
            return True
        frame = frame.f_back
    return False


@contextmanager
def reads_of(tensor: torch.Tensor) -> Iterator[tuple[list[int], list[int]]]:
    """Counts the elements of `tensor` the interpreter loads (one entry per load): those of
    the passes, and those of the kept list's merge."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_masked_load"):
        pytest.skip("triton's interpreter has no InterpreterBuilder.create_masked_load to count loads")
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    counts: list[int] = []
    listed: list[int] = []
    saved = builder.create_masked_load

    def counting_load(self, ptrs, mask, other, cache_policy, is_volatile):  # noqa: ANN001, ANN202
        addresses = ptrs.data.astype(np.uint64)
        read = int(((addresses >= start) & (addresses < end) & mask.data).sum())
        (listed if read and _from_kept_list() else counts).append(read)
        return saved(self, ptrs, mask, other, cache_policy, is_volatile)

    builder.create_masked_load = counting_load
    try:
        yield counts, listed
    finally:
        builder.create_masked_load = saved


def _row(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
         forced: int = -1) -> tuple[torch.Tensor, RowParams]:
    rng = np.random.default_rng(3)
    scores = torch.from_numpy(rng.standard_normal((1, VOCAB)).astype(np.float32) * 3)
    params = RowParams.from_numpy(
        temperatures=np.array([temperature], np.float32), top_ks=np.array([top_k], np.int32),
        top_ps=np.array([top_p], np.float32), min_ps=np.array([min_p], np.float32),
        seeds=np.zeros(1, np.uint64), sample_positions=np.zeros(1, np.int64), row_to_req=np.zeros(1, np.int64),
        local_step=np.zeros(1, np.int64), forced_tokens=np.array([forced]), draw_uniforms=np.array([0.37]))
    return scores, params


# (row controls, logprobs mode, full passes, plus the draw's block, settled from the kept list)
KINDS = [
    (dict(temperature=0.0), None, 1, False, False),
    (dict(temperature=0.0), "raw", 2, False, False),
    (dict(temperature=0.0), "processed", 2, False, False),
    (dict(temperature=1.0, forced=17), None, 1, False, False),
    (dict(temperature=1.0, forced=17), "raw", 2, False, False),
    (dict(temperature=1.0, forced=17), "processed", 2, False, False),
    (dict(temperature=1.0), None, 2, True, False),
    (dict(temperature=1.0, min_p=0.1), None, 2, True, False),
    (dict(temperature=1.0), "raw", 3, True, False),
    (dict(temperature=1.0), "processed", 3, True, False),
    (dict(temperature=1.0, top_k=50), None, 4, False, True),
    (dict(temperature=1.0, top_p=0.9), None, 4, False, True),
    (dict(temperature=0.0, top_k=50, top_p=0.9), "processed", 2, False, False),  # a greedy request has no filters
    (dict(temperature=1.0, top_k=50), "raw", 4, False, True),  # raw masses in pass 2, the rank from the list
    (dict(temperature=1.0, top_p=0.9), "raw", 4, False, True),
    (dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01), "raw", 4, False, True),
    (dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01), "processed", 4, False, True),
    # Top-k's list overflows (2000 ids): top-p makes its passes and settles from its own list.
    (dict(temperature=1.0, top_k=2000, top_p=0.9), None, 7, False, True),
    (dict(temperature=1.0, top_k=2000, top_p=0.9), "raw", 7, False, True),
    # Both overflow (a flat row keeps thousands): every pass, as without the list.
    (dict(temperature=100.0, top_k=2000, top_p=0.9999), "processed", 9, True, False),
]


@pytest.mark.parametrize("programs", [1, 3], ids=["one program", "split in 3"])
@pytest.mark.parametrize("controls, mode, passes, draws, listed", KINDS,
                         ids=[f"{'-'.join(f'{k}={v}' for k, v in c.items())}-{m}" for c, m, *_ in KINDS])
def test_passes_over_the_row_per_row_kind(controls, mode, passes, draws, listed, programs, monkeypatch):
    """Split in 3 (chunks of 1024, one launch per phase), each part reads its third of the
    row per pass: the same passes, the draw's block read once (by the merge)."""
    scores, params = _row(**controls)
    out, scratch = SampleOutput.allocate(1, 4), SampleScratch.allocate(1, VOCAB, "cpu", num_top=4)
    if programs > 1:
        monkeypatch.setattr(kernel_module, "_chunk", lambda vocab, device: BLOCK)
    with torch_math(), reads_of(scores) as (counts, listed_reads):
        sample_rows(scores, params, out, scratch, logprobs=mode, programs=programs)
    assert out.error.tolist() == [0]
    # The draw reads the block its token lies in (the last one holds VOCAB % BLOCK tokens).
    block = min(BLOCK, VOCAB - int(out.tokens[0]) // BLOCK * BLOCK) if draws else 0
    scalar_reads = sum(c for c in counts if c == 1)  # a known token's score, read on its own
    assert sum(counts) - scalar_reads == passes * VOCAB + block, f"{sum(counts) - scalar_reads} elements read"
    # The merge reads the listed ids' scores (top-p over the list reads the survivors again).
    assert (0 < sum(listed_reads) <= 2 * int(LIST_CAP)) if listed else sum(listed_reads) == 0, listed_reads


@pytest.mark.parametrize("programs", [1, 3], ids=["one program", "split in 3"])
@pytest.mark.parametrize("handed", ["made", "handed", "raw"],
                         ids=["pass 1 made", "pass 1 handed over", "raw masses handed over too"])
def test_a_controlled_row_handed_its_pass_one_reads_scores_and_logits_once_less(handed, programs, monkeypatch):
    """A row the controls kernel controls (a suppressed stop id), top-k with raw logprobs: the
    sampler reads its scores in pass 1 and three radix passes and its logits in pass 1 and
    the logprob pass; with the controls kernel's `PassOne`, pass 1 is not made; with its raw
    masses (the LM head keyed the row's maximum) and a token on the raw top-N, nor the
    logprob pass. The outputs are the same bits each way."""
    from engine.sampling.kernels.controls import PassOne
    from engine.step.lm_head_kernel import row_max_keys
    from tests.kernel_batches import Batch
    from tests.test_kernel_controls import op_args, outputs, random_controls

    logits, _ = _row(temperature=1.0)
    stop = int(logits.argmax())  # suppressed: the row's maximum moves
    batch = Batch(VOCAB, 0, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                  torch.ones(1, dtype=torch.bool), torch.full((1,), -1), torch.zeros(1, dtype=torch.int64),
                  torch.full((1,), 0), logits, 1)
    c = random_controls(np.random.default_rng(0), batch, bias=False, bitmask=False)
    c.control_slots[:], c.stop_ids[:], c.eos_rows[:] = 0, -1, True
    c.stop_ids[0, 0] = stop
    pass_one = PassOne.allocate(1, VOCAB, "cpu", num_top=4)
    made = outputs(1, VOCAB)
    keys = torch.zeros(1, dtype=torch.int64)
    row_max_keys(logits, keys)
    with torch_math():
        torch.ops.engine.apply_controls(*op_args(batch, c, made, None, 1, 256), *vars(pass_one).values(), True, keys)
    assert bool(made.controlled[0])
    _, params = _row(temperature=1.0, top_k=3)  # the scores' top 3: the logits' 2nd to 4th, on the raw top-4
    params.stop_ids, params.eos_suppression_rows = c.stop_ids, c.eos_rows
    out, scratch = SampleOutput.allocate(1, 4), SampleScratch.allocate(1, VOCAB, "cpu", num_top=4)
    if programs > 1:
        monkeypatch.setattr(kernel_module, "_chunk", lambda vocab, device: BLOCK)
    with torch_math(), reads_of(made.scores) as (score_reads, _), reads_of(logits) as (logit_reads, _):
        sample_rows(made.scores, params, out, scratch, logits=logits, logprobs="raw", row_controlled=made.controlled,
                    programs=programs, handed=pass_one if handed != "made" else None, handed_raw=handed == "raw")
    assert out.error.tolist() == [0] and int(out.tokens[0]) != stop
    full = lambda counts: sum(n for n in counts if n > 1)  # noqa: E731  (a known token's value, read alone, is 1)
    assert full(score_reads) == (4 if handed == "made" else 3) * VOCAB, full(score_reads)
    assert full(logit_reads) == {"made": 2, "handed": 1, "raw": 0}[handed] * VOCAB, full(logit_reads)
    made_out = SampleOutput.allocate(1, 4)
    with torch_math():
        sample_rows(made.scores, params, made_out, SampleScratch.allocate(1, VOCAB, "cpu", num_top=4), logits=logits,
                    logprobs="raw", row_controlled=made.controlled, programs=programs)
    for name, value in vars(out).items():
        assert torch.equal(value, getattr(made_out, name)), name
