"""The per-step field declaration (engine/host/step_fields.py) is the one
source of the request columns, the ledger's parameter arrays, the staged
arrays, the packed layout, padding, the typed device views, the sampler's
view and `explain`; and the forced token, wired from `SeqMeta.forced_token`
through the ledger into the `forced_tokens` field, reaches the emitted token.
"""
from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine, prepare_sampler_inputs
from engine.cli.explain import explain
from engine.host.param_records import SEQ_RECORD, derive_seed
from engine.host.request_table import RequestTable
from engine.host.ledger import SamplerInputs
from engine.host.step_fields import PARAM_FIELDS, STEP_FIELDS, StepField
from engine.sampling.row_params import RowParams
from engine.step.staging import StepArrays
from engine.step.staging import StepInputs
from engine.step.static_buffers import StepBuffers

MAX_REQS, MAX_DRAFTS, MAX_STOP = 4, 2, 3
VOCAB, HIDDEN = 48, 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Two fields a later stage might add: one per request, one per row, with
# paddings no other field uses, so finding them proves where they came from.
EXTRA = (
    StepField("presence_penalties", np.float32, "req", 0.25, "penalties", "step(presence_penalties)",
              "presence penalty, 0 = off"),
    StepField("bias_rows", np.int32, "row", 7, "penalties", "step(logit_bias)", "logit-bias row of each sample row"),
)


def _allocate(step_fields, device: str = "cpu") -> StepBuffers:
    return StepBuffers.allocate(
        step_fields=step_fields, max_reqs=MAX_REQS, max_draft_tokens=MAX_DRAFTS, max_source_rows=32,
        hidden_size=HIDDEN, vocab_size=VOCAB, max_logprobs=2, max_stop_ids=MAX_STOP,
        source_dtype=torch.float32, device=torch.device(device), pool_slots=MAX_REQS + 1,
    )


def _decode(rid: str, drafts: int = 0, *, forced: int | None = None, params: SamplingParams | None = None,
            write: int = 1) -> SeqMeta:
    return SeqMeta(rid, False, 1 + drafts, 6 + 3 + drafts, 6, num_generated=3,
                   params=params or SamplingParams(seed=11, top_k=5), mtp_write_slot=write, forced_token=forced)


def _batch() -> list[SeqMeta]:
    """Three requests, 1 + 3 + 2 sample rows: a prefill, two decodes with drafts."""
    prefill = SeqMeta("p", True, 4, 4, 4, params=SamplingParams(temperature=0.0, min_tokens=2), mtp_write_slot=3)
    return [prefill, _decode("d2", 2, forced=5, write=1), _decode("d1", 1, write=2)]


def _step_arrays(seqs: list[SeqMeta], **extra: np.ndarray) -> SimpleNamespace:
    """Everything a step stages: the ledger's fields, a stop-id matrix, drafts, next drafts and `extra`."""
    inputs = prepare_sampler_inputs(seqs, max_draft_tokens=MAX_DRAFTS)
    n, rows = inputs.num_reqs, inputs.num_sample_rows
    arrays = StepArrays.from_inputs(inputs, np.arange(n * MAX_STOP, dtype=np.int64).reshape(n, MAX_STOP))
    arrays.row_drafts = np.arange(rows, dtype=np.int64) + 20
    arrays.has_draft_probs = np.arange(rows) % 2 == 0
    arrays.next_draft_tokens = np.arange(n * MAX_DRAFTS, dtype=np.int64).reshape(n, MAX_DRAFTS) + 30
    arrays.next_draft_logprobs = -np.ones((n, MAX_DRAFTS), np.float32)
    arrays.control_slots = np.arange(n, dtype=np.int64) + 1
    return SimpleNamespace(**{f.name: getattr(arrays, f.name) for f in STEP_FIELDS}, **extra)


def _dense(f: StepField, value: np.ndarray, rows: int) -> np.ndarray:
    """The device form of a host value: row numbers become a mask, uint64 its int64 bits."""
    if f.host_form == "row numbers":
        mask = np.zeros(rows, bool)
        mask[value] = True
        return mask
    return value.view(np.int64) if value.dtype == np.uint64 else value


def _check_staged(b: StepBuffers, step_fields, arrays: SimpleNamespace, bucket: int) -> None:
    """Every declared field on the device: the real entries, then its padding up to the bucket."""
    rows, n = len(arrays.selected_token_indices), len(arrays.sample_positions)
    for f in step_fields:
        device = getattr(b.inputs, f.name).cpu().numpy()
        count, cap = (rows, b.rows_for(bucket)) if f.per == "row" else (n, bucket)
        value = getattr(arrays, f.name)
        if value is not None:
            np.testing.assert_array_equal(device[:count], _dense(f, value, rows), err_msg=f.name)
        padding = {"padding request": n if n < bucket else 0, "past request rows": 1 + MAX_DRAFTS}.get(f.padding, f.padding)
        assert (device[count if value is not None else 0 : cap] == padding).all(), f.name


# -- the declaration and what derives from it ------------------------------------------


def test_every_field_has_the_contract_name_and_a_full_declaration():
    contract = {
        "selected_token_indices", "row_to_req", "local_step", "eos_suppression_rows", "forced_tokens",
        "temperatures", "top_ks", "top_ps", "min_ps", "seeds", "sample_positions", "stop_ids", "row_drafts",
        "mtp_info_read_rows", "has_draft_probs", "mtp_info_write_slots", "next_draft_tokens", "next_draft_logprobs",
        "control_slots", "draw_uniforms", "masked_rows",
    }
    assert [f.name for f in STEP_FIELDS] == list(dict.fromkeys(f.name for f in STEP_FIELDS))  # once each
    assert {f.name for f in STEP_FIELDS} == contract
    params = {f.name for f in dataclasses.fields(SamplingParams)}
    for f in STEP_FIELDS:
        assert f.meaning and f.stage in ("gather", "controls", "sample", "verify", "draft pool"), f.name
        assert f.param is None or f.param in params, f.name
    assert [f.name for f in PARAM_FIELDS] == ["temperatures", "top_ks", "top_ps", "min_ps", "seeds"]
    # The sampler's view is exactly the sample-stage fields.
    assert {f.name for f in STEP_FIELDS if f.stage == "sample"} == {f.name for f in dataclasses.fields(RowParams)}


def test_request_records_and_ledger_parameter_arrays_come_from_the_declaration():
    seqs = [_decode("a", params=SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1, seed=9)),
            _decode("b", params=SamplingParams())]
    table, empty = RequestTable(3, seed_base=4), RequestTable(3).cols
    rows = np.array([table.add(s.request_id, s.params, [1] * s.prompt_len) for s in seqs])
    cols, inputs = table.cols[rows], prepare_sampler_inputs(seqs, seed_base=4)
    for f in PARAM_FIELDS:
        want = [derive_seed(s.request_id, 4) if getattr(s.params, f.param) is None else getattr(s.params, f.param)
                for s in seqs]
        for got in (cols[f.name], getattr(inputs, f.name)):
            assert got.dtype == np.dtype(f.dtype), f.name
            np.testing.assert_array_equal(got, np.asarray(want, dtype=f.dtype), err_msg=f.name)
        assert (empty[f.name] == f.padding).all(), f.name  # empty table rows
    assert {f.name for f in PARAM_FIELDS} <= {f.name for f in dataclasses.fields(SamplerInputs)}
    assert [f.name for f in dataclasses.fields(StepArrays)] == [f.name for f in STEP_FIELDS] + ["draft_probs", "token_bitmask"]


def test_the_written_out_types_hold_the_declared_fields():
    """The types a declared field reaches are written out as classes (go-to-definition
    finds `inputs.temperatures`); each holds exactly the declaration's fields, in its
    order: the ledger's parameter arrays, the request records' fields, the staged host
    arrays and the device views."""
    params = [f.name for f in PARAM_FIELDS]
    assert [f.name for f in dataclasses.fields(SamplerInputs)][: len(params)] == params
    assert set(params) <= set(SEQ_RECORD.names)  # the records the ledger reads
    names = [f.name for f in STEP_FIELDS]
    assert [f.name for f in dataclasses.fields(StepArrays)][: len(names)] == names
    assert [f.name for f in dataclasses.fields(StepInputs)] == names
    b = _allocate(STEP_FIELDS)
    assert type(b.inputs) is StepInputs and set(vars(b.inputs)) == set(names)


@pytest.mark.parametrize("device", DEVICES)
def test_a_field_added_to_the_declaration_is_staged_viewed_padded_and_explained(device: str):
    """Buffers for the declaration plus two new fields: typed views, staging,
    padding and the high-water reset handle them with no other edit."""
    declared = STEP_FIELDS + EXTRA
    b = _allocate(declared, device)
    for f in EXTRA:
        view = getattr(b.inputs, f.name)  # a typed attribute, not a string key
        assert view.dtype == {np.float32: torch.float32, np.int32: torch.int32}[f.dtype]
        assert view.shape == ((b.max_rows,) if f.per == "row" else (b.max_reqs,))
        assert (view.cpu().numpy() == f.padding).all()  # allocate pads with the declared value
    seqs = _batch()
    big = _step_arrays(seqs, presence_penalties=np.array([0.5, 1.5, 2.5], np.float32),
                       bias_rows=np.arange(6, dtype=np.int32) + 100)
    b.load(big, MAX_REQS)
    _check_staged(b, declared, big, MAX_REQS)
    # A smaller step: what the big one left past its entries goes back to padding.
    small = _step_arrays(seqs[:1], presence_penalties=np.array([3.5], np.float32), bias_rows=np.array([9], np.int32))
    b.load(small, MAX_REQS)
    _check_staged(b, declared, small, MAX_REQS)
    # A field left None stages padding only.
    b.load(SimpleNamespace(**{**vars(big), "bias_rows": None}), MAX_REQS)
    assert (b.inputs.bias_rows.cpu().numpy() == 7).all()
    # The sampler's view is unchanged: leading slices of the sample-stage fields.
    params = b.params(2)
    assert {f.name for f in dataclasses.fields(params)} == {f.name for f in dataclasses.fields(RowParams)}
    assert params.temperatures.data_ptr() == b.inputs.temperatures.data_ptr() and len(params.temperatures) == 2
    assert len(params.forced_tokens) == b.rows_for(2)
    lines = explain(seqs, max_draft_tokens=MAX_DRAFTS, step_fields=declared).splitlines()
    for f in EXTRA:
        # A field's row, then what it means on the indented lines under it (the table wraps by row).
        at = next(i for i, line in enumerate(lines) if line.startswith(f.name + " "))
        under = itertools.takewhile(lambda line: line.startswith(" "), lines[at + 1 :])
        block = " ".join(" ".join([lines[at], *under]).split())
        assert " ".join(f.meaning.split()) in block and f.source in block and f.stage in block
        assert str(f.padding) in lines[at]


def test_padding_values_come_from_the_declaration():
    """Change two paddings in the declaration: the padding slots hold the new
    values. The step-dependent rules: padding rows point at the first padding
    request slot (0 when every slot is real) and lie past every real row."""
    moved = {"top_ps": 0.5, "selected_token_indices": -7}
    declared = tuple(dataclasses.replace(f, padding=moved.get(f.name, f.padding)) for f in STEP_FIELDS)
    b = _allocate(declared)
    seqs = _batch()
    b.load(_step_arrays(seqs), MAX_REQS)
    assert b.inputs.top_ps[3:].tolist() == [0.5]
    assert b.inputs.selected_token_indices[6 : b.rows_for(MAX_REQS)].unique().tolist() == [-7]
    assert b.inputs.row_to_req[6 : b.rows_for(MAX_REQS)].unique().tolist() == [3]
    assert b.inputs.local_step[6 : b.rows_for(MAX_REQS)].unique().tolist() == [1 + MAX_DRAFTS]
    b.load(_step_arrays(seqs), 3)  # every request slot real: padding rows share slot 0
    assert b.inputs.row_to_req[6 : b.rows_for(3)].unique().tolist() == [0]


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda fs: fs + (dataclasses.replace(fs[0], name="wide", dtype=np.complex128),), "'wide': dtype=complex128"),
        (lambda fs: fs + (dataclasses.replace(fs[0], name="ruled", padding="mean of the row"),), "'ruled': padding="),
        (lambda fs: fs + (dataclasses.replace(fs[0], name="odd", width="vocab"),), "'odd': width='vocab'"),
        (lambda fs: fs + fs[-1:], "'next_draft_logprobs': declared twice"),
        (lambda fs: tuple(f for f in fs if f.name != "min_ps"), r"missing \['min_ps'\]"),
    ],
)
def test_a_declaration_the_buffers_cannot_stage_is_refused_naming_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        _allocate(change(STEP_FIELDS))


def test_splitting_a_step_slices_every_declared_field():
    """The arrays of requests [a, b) of a batch are those of that sub-batch
    alone: per-row fields by rows, per-request ones by requests, request
    slots and suppressed row numbers renumbered; only the gather index keeps
    pointing into the whole batch's model output."""
    seqs = _batch() + [_decode("d0", 0, forced=2, params=SamplingParams(min_tokens=9), write=4)]
    inputs = prepare_sampler_inputs(seqs, max_draft_tokens=MAX_DRAFTS)
    whole = StepArrays(**vars(_step_arrays(seqs)))
    for a, b in ((0, 2), (1, 3), (2, 4), (3, 4)):
        part = whole.requests(a, b, inputs.sample_offsets, inputs.sample_counts)
        alone = _step_arrays(seqs[a:b])
        r0, r1 = int(inputs.sample_offsets[a]), int(inputs.sample_offsets[b - 1] + inputs.sample_counts[b - 1])
        for f in STEP_FIELDS:
            want = getattr(alone, f.name)
            if not f.from_ledger and getattr(whole, f.name) is not None:  # the engine built it: its slice
                want = getattr(whole, f.name)[r0:r1] if f.per == "row" else getattr(whole, f.name)[a:b]
            if f.name == "selected_token_indices":
                want = want + int(inputs.out_offsets[a])
            if want is None:
                assert getattr(part, f.name) is None, (a, b, f.name)
            else:
                np.testing.assert_array_equal(getattr(part, f.name), want, err_msg=f"{a}:{b} {f.name}")


# -- the forced token through StepEngine.step ------------------------------------------


def _engine(use_graphs: bool, device: str = "cpu") -> StepEngine:
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device)
    engine = StepEngine(weight, EngineConfig(max_num_reqs=MAX_REQS * 2, max_draft_tokens=MAX_DRAFTS, device=device,
                                             use_graphs=use_graphs, buckets=(2, 4, 8)))
    if use_graphs:
        engine.capture()
    return engine


def _crowd(forced: dict[str, int]) -> list[SeqMeta]:
    """Six requests: greedy, filtered and plain sampling, a prefill and decodes with drafts."""
    specs = [
        ("g", 0, SamplingParams(temperature=0.0)),
        ("k", 2, SamplingParams(top_k=4, seed=3, logprobs=2)),
        ("p", 0, SamplingParams(top_p=0.7, seed=5, logprobs=0)),
        ("m", 1, SamplingParams(min_p=0.2, seed=7)),
        ("plain", 0, SamplingParams(seed=8, logprobs=1)),
    ]
    seqs = [_decode(rid, drafts, forced=forced.get(rid), params=params, write=i + 1)
            for i, (rid, drafts, params) in enumerate(specs)]
    seqs.append(SeqMeta("pre", True, 5, 5, 5, params=SamplingParams(seed=2, logprobs=1), mtp_write_slot=6,
                        forced_token=forced.get("pre")))
    return seqs


def _hidden(seqs: list[SeqMeta], device: str) -> torch.Tensor:
    rows = sum(s.seqlen_q for s in seqs)
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(2)).to(device) * 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_graphs", [False, True])
def test_the_forced_token_is_emitted_alone_and_in_a_crowd(use_graphs: bool, device: str):
    engine = _engine(use_graphs, device)
    forced = {"g": 40, "k": 1, "plain": 0, "pre": 47}
    seqs = _crowd(forced)
    out = engine.step(_hidden(seqs, device), seqs)
    assert out.replayed == use_graphs and out.errors == [None] * len(seqs)
    for seq, tokens, logprobs in zip(seqs, out.tokens, out.logprobs):
        if seq.forced_token is not None:
            assert tokens[0] == seq.forced_token, seq.request_id
            if logprobs:
                assert logprobs[0].token == seq.forced_token
    # Alone, in the smallest bucket: the same token.
    alone = engine.step(_hidden(seqs[:1], device), seqs[:1])
    assert alone.tokens[0][0] == 40


@pytest.mark.parametrize("device", DEVICES)
def test_replay_equals_eager_with_forced_tokens(device: str):
    seqs = _crowd({"m": 9, "p": 33})
    eager, replay = _engine(False, device), _engine(True, device)
    a, b = eager.step(_hidden(seqs, device), seqs), replay.step(_hidden(seqs, device), seqs)
    assert b.replayed and not a.replayed
    assert (a.tokens, a.logprobs, a.num_accepted) == (b.tokens, b.logprobs, b.num_accepted)


@pytest.mark.parametrize("use_graphs", [False, True])
def test_a_neighbours_forced_token_changes_nothing_else(use_graphs: bool):
    """Bit-identical tokens and logprobs for every other request, with and
    without a forced token on request "k" (whose drafts now verify against it)."""
    engine = _engine(use_graphs)
    plain, forced = _crowd({}), _crowd({"k": 17})
    a = engine.step(_hidden(plain, "cpu"), plain)
    b = engine.step(_hidden(forced, "cpu"), forced)
    k = [s.request_id for s in plain].index("k")
    assert b.tokens[k][0] == 17
    for i in range(len(plain)):
        if i != k:
            assert (a.tokens[i], a.logprobs[i], a.num_accepted[i]) == (b.tokens[i], b.logprobs[i], b.num_accepted[i])


def test_an_out_of_vocabulary_forced_token_names_the_request():
    engine = _engine(False)
    seqs = _crowd({"p": VOCAB})
    with pytest.raises(ValueError, match=rf"request 'p': forced_token={VOCAB}: outside the vocabulary \({VOCAB}\)"):
        engine.step(_hidden(seqs, "cpu"), seqs)
    assert engine.stats.steps == 0  # refused before anything ran


def test_explain_shows_the_forced_tokens():
    lines = explain([_decode("a", 1, forced=7), _decode("b")], max_draft_tokens=MAX_DRAFTS).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("forced_tokens "))
    under = " ".join(" ".join(lines[at + 1 : at + 3]).split())  # this step's values, under the field's row
    assert "this step: 7 -1 -1" in under
