"""The vectorised ledger against the per-request reference loop, hand-worked
cases for each docs/contract.md §1 rule, every validation error, and the columnar table."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import SamplingParams, SeqMeta, prepare_sampler_inputs
from engine.host.draft_slots import DraftSlots
from engine.host.ledger import LedgerInvariantError, _check_invariants
from engine.host.request_table import RequestTable
from tests.ledger_reference import reference_ledger

# CI runs a third of the examples; ENGINE_LONG_TESTS=1 runs them all.
SCALE = 1 if os.environ.get("ENGINE_LONG_TESTS") == "1" else 3

MAX_DRAFTS = 3


@st.composite
def sampling_params(draw) -> SamplingParams:
    return SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
        top_k=draw(st.sampled_from([0, 1, 50])),
        top_p=draw(st.sampled_from([1.0, 0.9])),
        min_p=draw(st.sampled_from([0.0, 0.1])),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        min_tokens=draw(st.integers(0, 4)),
        prompt_logprobs=draw(st.sampled_from([False, True, 3])),
    )


@st.composite
def seq_metas(draw, request_id: int, max_drafts: int) -> SeqMeta:
    params = draw(sampling_params())
    prompt_len = draw(st.integers(1, 40))
    prompt_tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=prompt_len, max_size=prompt_len))
    if draw(st.booleans()):  # a prefill chunk, last or not
        seqlen_k = draw(st.integers(1, prompt_len))
        seqlen_q = draw(st.integers(1, seqlen_k))
        return SeqMeta(request_id, True, seqlen_q, seqlen_k, prompt_len, prompt_tokens, 0, params, 0, draw(st.integers(0, 5)))
    drafts = draw(st.integers(0, max_drafts))
    num_generated = draw(st.integers(1, 8))
    seqlen_k = prompt_len + num_generated + drafts
    write = draw(st.integers(1, 5))
    read = draw(st.sampled_from([0, write]))
    return SeqMeta(request_id, False, 1 + drafts, seqlen_k, prompt_len, prompt_tokens, num_generated, params, read, write)


@st.composite
def batches(draw, max_drafts: int = MAX_DRAFTS) -> list[SeqMeta]:
    n = draw(st.integers(1, 12))
    return [draw(seq_metas(i, max_drafts)) for i in range(n)]


def assert_matches_reference(seqs, **kw):
    got = prepare_sampler_inputs(seqs, **kw)
    ref = reference_ledger(seqs, **kw)
    for name, want in ref.items():
        if name == "num_query_tokens":
            assert int(got.query_offsets[-1] + seqs[-1].seqlen_q) == want
            continue
        value = getattr(got, name)
        if want is None:
            assert value is None, name
        elif isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, np.asarray(want, dtype=value.dtype), err_msg=name)
        else:
            assert value == want, name
    return got


@settings(max_examples=1500 // SCALE, deadline=None)
@given(batches(), st.sampled_from([0, MAX_DRAFTS]))
def test_vectorised_ledger_equals_reference(seqs, mtp_drafts):
    # With max_draft_tokens=0 drafts are not allowed: replace decode requests by plain ones.
    if mtp_drafts == 0:
        seqs = [s if s.is_prompt or s.seqlen_q == 1 else _no_drafts(s) for s in seqs]
    got = assert_matches_reference(seqs, max_draft_tokens=mtp_drafts)
    assert got.selected_token_indices.dtype == np.int32
    assert got.sample_positions.dtype == np.int64
    assert got.seeds.dtype == np.uint64


@settings(max_examples=500 // SCALE, deadline=None)
@given(batches(), st.data())
def test_forced_tokens_equal_reference(seqs, data):
    """A request's forced token lands on its first sample row (prefill: its
    only row; decode: the row before any draft), every other row -1."""
    forced = data.draw(st.lists(st.one_of(st.none(), st.integers(0, 2**31 - 1)), min_size=len(seqs), max_size=len(seqs)))
    seqs = [dataclasses.replace(s, forced_token=t) for s, t in zip(seqs, forced)]
    got = assert_matches_reference(seqs, max_draft_tokens=MAX_DRAFTS)
    assert (got.forced_tokens is None) == all(t is None for t in forced)
    if got.forced_tokens is not None:
        assert got.forced_tokens.dtype == np.int64


@settings(max_examples=1000 // SCALE, deadline=None)
@given(batches(), st.integers(1, 30))
def test_compaction_equals_reference(seqs, keep):
    seqs = [_no_prompt_logprobs(s) for s in seqs]
    got = assert_matches_reference(seqs, max_draft_tokens=MAX_DRAFTS, compaction_keep_tokens=keep)
    assert (got.out_lens >= 1).all()


@settings(max_examples=300, deadline=None)
@given(batches())
def test_request_table_path_equals_seqmeta_path(seqs):
    table = RequestTable(64)
    rows = np.array([table.add(s.request_id, s.params, s.prompt_tokens, mtp_write_slot=s.mtp_write_slot) for s in seqs])
    table.record_emitted(rows, np.array([s.num_generated for s in seqs]))
    got = table.ledger(
        rows,
        np.array([s.is_prompt for s in seqs]),
        np.array([s.seqlen_q for s in seqs], np.int32),
        np.array([s.seqlen_k for s in seqs], np.int32),
        np.array([s.mtp_read_slot for s in seqs], np.int32),
        max_draft_tokens=MAX_DRAFTS,
    )
    assert got == prepare_sampler_inputs(seqs, max_draft_tokens=MAX_DRAFTS)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_steady_decode_steps_equal_a_fresh_ledger(seed):
    """The request table reuses the last all-decode step's layout while the
    batch is unchanged; over many steps with emitted tokens, read slots that
    come and go, draft counts that change and requests that join and leave,
    every step equals the ledger built from scratch."""
    rng = np.random.default_rng(seed)
    table = RequestTable(16)
    live: dict[int, dict] = {}
    next_id = 0

    def join():
        nonlocal next_id
        params = SamplingParams(temperature=0.5, min_tokens=int(rng.integers(0, 6)), seed=next_id)
        prompt = rng.integers(0, 100, int(rng.integers(1, 9)))
        row = table.add(next_id, params, prompt, mtp_write_slot=1 + next_id % 9)
        live[next_id] = dict(row=row, params=params, prompt=prompt, gen=1, write=1 + next_id % 9)
        table.record_emitted(np.array([row]), np.array([1]))
        next_id += 1

    for _ in range(int(rng.integers(1, 6))):
        join()
    drafts = {rid: int(rng.integers(0, MAX_DRAFTS + 1)) for rid in live}
    for _step in range(12):
        event = rng.random()
        if event < 0.15 and len(live) < 16:
            join()
        elif event < 0.25 and len(live) > 1:
            gone = int(rng.choice(list(live)))
            table.remove(gone)
            del live[gone]
        if rng.random() < 0.2:
            drafts = {rid: int(rng.integers(0, MAX_DRAFTS + 1)) for rid in live}
        ids = sorted(live)
        drafts = {rid: drafts.get(rid, 0) for rid in ids}
        seqs = [
            SeqMeta(rid, False, 1 + drafts[rid], len(live[rid]["prompt"]) + live[rid]["gen"] + drafts[rid],
                    len(live[rid]["prompt"]), live[rid]["prompt"], live[rid]["gen"], live[rid]["params"],
                    mtp_read_slot=live[rid]["write"] if rng.random() < 0.5 else 0, mtp_write_slot=live[rid]["write"])
            for rid in ids
        ]
        rows = np.array([live[rid]["row"] for rid in ids])
        got = table.ledger(rows, np.zeros(len(ids), bool), np.array([s.seqlen_q for s in seqs], np.int32),
                           np.array([s.seqlen_k for s in seqs], np.int32),
                           np.array([s.mtp_read_slot for s in seqs], np.int32), max_draft_tokens=MAX_DRAFTS)
        assert got == prepare_sampler_inputs(seqs, max_draft_tokens=MAX_DRAFTS)
        emitted = rng.integers(1, 3, len(ids))
        table.record_emitted(rows, emitted)
        for rid, e in zip(ids, emitted):
            live[rid]["gen"] += int(e)


def _no_drafts(s: SeqMeta) -> SeqMeta:
    drafts = s.seqlen_q - 1
    return SeqMeta(s.request_id, False, 1, s.seqlen_k - drafts, s.prompt_len, s.prompt_tokens, s.num_generated, s.params)


def _no_prompt_logprobs(s: SeqMeta) -> SeqMeta:
    p = s.params
    params = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=p.seed, min_tokens=p.min_tokens)
    return SeqMeta(s.request_id, s.is_prompt, s.seqlen_q, s.seqlen_k, s.prompt_len, s.prompt_tokens, s.num_generated, params, s.mtp_read_slot, s.mtp_write_slot)


# ---- hand-worked cases, one per rule ---------------------------------------------------------

def test_prefill_last_and_non_last_chunk():
    # prompt of 10 tokens in chunks 0..3 (non-last) and 4..9 (last); a second request decodes.
    tokens = list(range(100, 110))
    lp = SamplingParams(prompt_logprobs=True)
    first = prepare_sampler_inputs([SeqMeta("a", True, 4, 4, 10, tokens, params=lp), SeqMeta("b", False, 1, 8, 5, num_generated=3)])
    assert first.selected_token_indices.tolist() == [3, 4]  # last row of the chunk; b's only row
    assert first.sample_positions.tolist() == [4, 8]
    assert first.selected_prompt_indices.tolist() == [0, 1, 2, 3]  # all 4 rows: non-last chunk
    assert first.prompt_token_targets.tolist() == [101, 102, 103, 104]
    assert first.is_last_chunk.tolist() == [False, False]
    last = prepare_sampler_inputs([SeqMeta("a", True, 6, 10, 10, tokens, params=lp)])
    assert last.selected_token_indices.tolist() == [5]
    assert last.sample_positions.tolist() == [10]
    assert last.selected_prompt_indices.tolist() == [0, 1, 2, 3, 4]  # one short: row 5 predicts a generated token
    assert last.prompt_token_targets.tolist() == [105, 106, 107, 108, 109]
    # over both chunks: L - 1 = 9 prompt logprobs
    assert first.num_prompt_rows + last.num_prompt_rows == 9


def test_prompt_logprobs_none_vs_requested_and_cursor_advance():
    tokens = list(range(8))
    seqs = [
        SeqMeta("no-lp", True, 5, 5, 8, tokens),  # advances the output cursor, adds no prompt row
        SeqMeta("lp", True, 3, 3, 8, tokens, params=SamplingParams(prompt_logprobs=True)),
    ]
    got = prepare_sampler_inputs(seqs)
    assert got.selected_prompt_indices.tolist() == [5, 6, 7]
    assert got.prompt_row_counts.tolist() == [0, 3]
    assert prepare_sampler_inputs(seqs[:1]).selected_prompt_indices is None


def test_prompt_row_can_be_a_sample_row():
    got = prepare_sampler_inputs([SeqMeta("a", True, 3, 3, 9, list(range(9)), params=SamplingParams(prompt_logprobs=True))])
    assert got.selected_token_indices.tolist() == [2]
    assert 2 in got.selected_prompt_indices.tolist()


def test_decode_with_different_draft_counts():
    seqs = [
        SeqMeta("k0", False, 1, 11, 8, num_generated=3, mtp_write_slot=1),
        SeqMeta("k3", False, 4, 15, 8, num_generated=4, mtp_read_slot=2, mtp_write_slot=2),
        SeqMeta("k1", False, 2, 7, 4, num_generated=2, mtp_read_slot=0, mtp_write_slot=3),
    ]
    got = prepare_sampler_inputs(seqs, max_draft_tokens=3)
    assert got.selected_token_indices.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert got.row_to_req.tolist() == [0, 1, 1, 1, 1, 2, 2]
    assert got.local_step.tolist() == [0, 0, 1, 2, 3, 0, 1]
    assert got.sample_positions.tolist() == [11, 12, 6]  # seqlen_k - seqlen_q + 1
    assert got.mtp_first_token_positions.tolist() == [0, 1, 5]
    assert got.mtp_seqlens_q.tolist() == [1, 4, 2]
    assert got.mtp_info_write_slots.tolist() == [1, 2, 3]
    # k3 reads slot 2 rows 6, 7, 8 then padding; k1 reads slot 0 (nothing fresh) then padding
    assert got.mtp_info_read_rows.tolist() == [0, 6, 7, 8, 0, 0, 0]


def test_non_last_prefill_chunk_never_writes_draft_info():
    got = prepare_sampler_inputs(
        [SeqMeta("mid", True, 2, 2, 5, mtp_write_slot=4), SeqMeta("end", True, 3, 5, 5, mtp_write_slot=5)], max_draft_tokens=2
    )
    assert got.mtp_info_write_slots.tolist() == [0, 5]
    assert got.mtp_info_read_rows.tolist() == [0, 0]


def test_eos_suppression_rows_follow_min_tokens():
    p = SamplingParams(min_tokens=3)
    seqs = [
        SeqMeta("fresh", True, 4, 4, 4, params=p),  # produces generated token 0 -> suppressed
        SeqMeta("dec", False, 1, 6, 4, num_generated=2, params=p),  # produces token 2 -> suppressed
        SeqMeta("done", False, 1, 9, 4, num_generated=5, params=p),
    ]
    got = prepare_sampler_inputs(seqs)
    assert got.eos_suppression_rows.tolist() == [0, 1]


def test_eos_suppression_only_on_a_last_prefill_chunk():
    """A non-last chunk's sample row produces no token (it is discarded), so it
    never counts towards min_tokens and gets no suppression row; the last
    chunk's row produces generated token 0 and does."""
    p = SamplingParams(min_tokens=2)
    tokens = list(range(10))
    seqs = [
        SeqMeta("mid", True, 4, 4, 10, tokens, params=p),  # chunk 0..3 of 10: not last
        SeqMeta("end", True, 6, 10, 10, tokens, params=p),  # chunk 4..9: last
        SeqMeta("dec", False, 1, 11, 10, num_generated=1, params=p),
    ]
    got = assert_matches_reference(seqs)
    assert got.eos_suppression_rows.tolist() == [1, 2]
    assert prepare_sampler_inputs(seqs[:1]).eos_suppression_rows.tolist() == []
    # The persistent request-table path keeps the same rule.
    table = RequestTable(4)
    rows = np.array([table.add(s.request_id, p, tokens) for s in seqs])
    table.record_emitted(rows[2:], np.array([1]))
    via_table = table.ledger(rows, np.array([True, True, False]), np.array([4, 6, 1], np.int32), np.array([4, 10, 11], np.int32))
    assert via_table.eos_suppression_rows.tolist() == [1, 2]
    assert via_table == got


def test_compaction_shifts_later_requests():
    # keep the last 3 tokens of each sequence: a 10-token one-shot prefill keeps rows for 7..9
    seqs = [SeqMeta("long", True, 10, 10, 10), SeqMeta("short", True, 2, 2, 2), SeqMeta("dec", False, 1, 6, 4, num_generated=2)]
    got = prepare_sampler_inputs(seqs, compaction_keep_tokens=3)
    assert got.out_lens.tolist() == [3, 2, 1]
    assert got.out_offsets.tolist() == [0, 3, 5]
    assert got.query_offsets.tolist() == [0, 10, 12]
    assert got.selected_token_indices.tolist() == [2, 4, 5]
    assert got.num_output_rows == 6
    # an early chunk entirely before the kept tail still keeps one row, for its sample
    early = prepare_sampler_inputs([SeqMeta("early", True, 4, 4, 20)], compaction_keep_tokens=3)
    assert early.out_lens.tolist() == [1]


def test_default_seed_is_derived_and_reported():
    a = prepare_sampler_inputs([SeqMeta("r", True, 1, 1, 1)])
    b = prepare_sampler_inputs([SeqMeta("x", True, 1, 1, 1), SeqMeta("r", True, 1, 1, 1)])
    assert a.seeds[0] == b.seeds[1] != b.seeds[0]
    assert prepare_sampler_inputs([SeqMeta("r", True, 1, 1, 1)], seed_base=7).seeds[0] != a.seeds[0]
    assert prepare_sampler_inputs([SeqMeta("r", True, 1, 1, 1, params=SamplingParams(seed=2**64 - 1))]).seeds[0] == 2**64 - 1


def test_invariant_violation_raises():
    got = prepare_sampler_inputs([SeqMeta("a", True, 2, 2, 2)])
    got.selected_token_indices = got.selected_token_indices + 5
    with pytest.raises(LedgerInvariantError, match="selected_token_indices outside"):
        _check_invariants(got, planned_sample_rows=1)
    with pytest.raises(LedgerInvariantError, match="planned 2"):
        _check_invariants(prepare_sampler_inputs([SeqMeta("a", True, 2, 2, 2)]), planned_sample_rows=2)


# ---- validation: every bad value names the request, the field and the value -----------------

@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_k=-2), "top_k=-2"),  # -1 is vLLM's "off"
        (dict(min_p=1.2), "min_p=1.2"),
        (dict(min_p=-0.1), "min_p=-0.1"),
        (dict(seed=-2), "seed=-2"),  # -1 is vLLM's None
        (dict(seed=2**64), "seed=18446744073709551616"),
        (dict(min_tokens=-2), "min_tokens=-2"),
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(logprobs=-2), "logprobs=-2"),  # -1 is vLLM's "the whole vocabulary"
        (dict(prompt_logprobs=-3), "prompt_logprobs=-3"),
        (dict(stop_token_ids=(5, 2**31)), "stop_token_ids"),
        (dict(top_k=True), "top_k=True"),
    ],
)
def test_sampling_params_errors_name_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(is_prompt=True, seqlen_q=0, seqlen_k=0, prompt_len=4), "seqlen_q=0"),
        (dict(is_prompt=True, seqlen_q=3, seqlen_k=2, prompt_len=4), "seqlen_k=2"),
        (dict(is_prompt=True, seqlen_q=3, seqlen_k=6, prompt_len=4), "seqlen_k=6: a prompt chunk reaches past prompt_len=4"),
        (dict(is_prompt=True, seqlen_q=2, seqlen_k=2, prompt_len=2, params=SamplingParams(prompt_logprobs=True)), "prompt_tokens is None"),
        (dict(is_prompt=True, seqlen_q=2, seqlen_k=2, prompt_len=2, prompt_tokens=[1, 2**31]), r"prompt_tokens\[1\]=2147483648"),
        (dict(is_prompt=True, seqlen_q=2, seqlen_k=2, prompt_len=2, prompt_tokens=[1, -4]), r"prompt_tokens\[1\]=-4"),
        (dict(is_prompt=True, seqlen_q=2, seqlen_k=2, prompt_len=2, prompt_tokens=[1]), "has 1 tokens but prompt_len=2"),
        (dict(is_prompt=False, seqlen_q=1, seqlen_k=5, prompt_len=4, num_generated=-1), "num_generated=-1"),
        (dict(is_prompt=False, seqlen_q=1, seqlen_k=5, prompt_len=4, mtp_write_slot=-1), "mtp_write_slot=-1"),
        (dict(is_prompt=1, seqlen_q=1, seqlen_k=5, prompt_len=4), "is_prompt=1"),
        (dict(is_prompt=True, seqlen_q=1, seqlen_k=2**31, prompt_len=4), "seqlen_k=2147483648"),
        (dict(is_prompt=False, seqlen_q=1, seqlen_k=5, prompt_len=4, num_generated=1, forced_token=-1), "forced_token=-1"),
        (dict(is_prompt=False, seqlen_q=1, seqlen_k=5, prompt_len=4, num_generated=1, forced_token=True), "forced_token=True"),
        (dict(is_prompt=False, seqlen_q=1, seqlen_k=5, prompt_len=4, num_generated=1, forced_token=3.0), "forced_token=3.0"),
    ],
)
def test_seq_meta_errors_name_request_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=r"request 'req-7': .*" + match):
        SeqMeta("req-7", **kwargs)


def test_batch_errors_name_the_request():
    ok = SeqMeta("ok", False, 1, 5, 4, num_generated=1, mtp_write_slot=1)
    with pytest.raises(ValueError, match=r"request 'greedy-drafter': seqlen_q=4: verifies 3 drafts but max_draft_tokens=2"):
        prepare_sampler_inputs([ok, SeqMeta("greedy-drafter", False, 4, 9, 4, num_generated=2, mtp_write_slot=2)], max_draft_tokens=2)
    with pytest.raises(ValueError, match=r"request 'no-slot': mtp_write_slot=0"):
        prepare_sampler_inputs([ok, SeqMeta("no-slot", False, 1, 5, 4, num_generated=1)], max_draft_tokens=2)
    lp = SeqMeta("lp", True, 2, 2, 2, [1, 2], params=SamplingParams(prompt_logprobs=True))
    with pytest.raises(ValueError, match=r"request 'lp': params.prompt_logprobs=0: .*compaction"):
        prepare_sampler_inputs([lp], compaction_keep_tokens=4)
    with pytest.raises(ValueError, match=r"request 'ok': request_id appears twice"):
        prepare_sampler_inputs([ok, ok], max_draft_tokens=1)
    with pytest.raises(ValueError, match="compaction_keep_tokens=0"):
        prepare_sampler_inputs([lp], compaction_keep_tokens=0)


def test_bad_request_never_touches_the_table():
    table = RequestTable(4)
    table.add("good", SamplingParams(temperature=0.5), [1, 2, 3])
    before = table.cols.copy()
    with pytest.raises(ValueError, match=r"request 'bad': params.top_p=2.0"):
        table.add("bad", _bypass(top_p=2.0), [1])
    with pytest.raises(ValueError, match=r"request 'good': request_id is already"):
        table.add("good", SamplingParams(), [1])
    assert np.array_equal(before, table.cols)
    assert len(table) == 1 and len(table._free) == 3


def _bypass(**fields) -> SamplingParams:
    """A SamplingParams whose invalid field slipped past __post_init__ (e.g. mutated by a caller)."""
    p = SamplingParams()
    for k, v in fields.items():
        object.__setattr__(p, k, v)
    return p


# ---- draft-info slots: the take-once rule --------------------------------------------------------

def test_take_once_read_slot_rule():
    slots = DraftSlots(4)
    a, b = slots.allocate(), slots.allocate()
    assert 0 not in (a, b)
    decode = np.array([True, True])
    # new requests: nothing fresh -> padding slot 0
    assert slots.take_read_slots(np.array([a, b]), decode).tolist() == [0, 0]
    slots.mark_written(np.array([a, b]))
    # fresh: each reads its own slot once ...
    assert slots.take_read_slots(np.array([a, b]), decode).tolist() == [a, b]
    # ... and a second read without a new write gets padding
    assert slots.take_read_slots(np.array([a, b]), decode).tolist() == [0, 0]
    # a request in prefill (e.g. preempted and recomputed) reads padding even if its slot is fresh
    slots.mark_written(np.array([a]))
    assert slots.take_read_slots(np.array([a]), np.array([False])).tolist() == [0]
    # a slot handed to a new request is never fresh
    slots.mark_written(np.array([b]))
    slots.release(b)
    c = slots.allocate()
    assert slots.take_read_slots(np.array([c]), np.array([True])).tolist() == [0]
    with pytest.raises(RuntimeError, match="exhausted"):
        slots.allocate(), slots.allocate()
    with pytest.raises(ValueError, match="slot=0"):
        slots.release(0)


@settings(max_examples=30, deadline=None)
@given(batches(), st.integers(0, 2**20))
def test_the_packed_records_read_what_each_request_holds(seqs, seed_base):
    """prepare_sampler_inputs reads each SeqMeta's packed record (`ledger_record`), with the
    engine's seed for a request that brought none: field by field what the SeqMeta holds."""
    from engine.host.ledger import StepSchedule
    from engine.host.param_records import derive_seed, derive_seeds
    from engine.host.params import SEQ_RECORD
    from engine.host.step_fields import PARAM_FIELDS

    records = np.frombuffer(bytearray(b"".join(s.ledger_record for s in seqs)), dtype=SEQ_RECORD)
    ids = [s.request_id for s in seqs]
    got = derive_seeds(records.copy(), ids, seed_base)
    for i, s in enumerate(seqs):
        p = s.params
        want = {"prompt_len": s.prompt_len, "num_generated": s.num_generated, "mtp_write_slot": s.mtp_write_slot,
                "min_tokens": p.min_tokens, "num_logprobs": p.num_logprobs, "num_prompt_logprobs": p.num_prompt_logprobs,
                **{f.name: getattr(p, f.param) for f in PARAM_FIELDS}}
        if p.seed is None:
            want["seeds"] = derive_seed(s.request_id, seed_base)
        with np.errstate(over="ignore"):
            for name, value in want.items():
                assert got[name][i] == np.asarray(value, dtype=SEQ_RECORD[name]), (i, name)
    a, b = StepSchedule.from_records(records, ids, seqs), StepSchedule.from_seqs(seqs)
    for name in ("is_prompt", "seqlen_q", "seqlen_k", "mtp_read_slot"):
        assert np.array_equal(getattr(a, name), getattr(b, name)) and getattr(a, name).dtype == getattr(b, name).dtype
    assert (a.forced_tokens is None) == (b.forced_tokens is None)
    assert [a.prompt_tokens[i] for i in range(len(seqs))] == [b.prompt_tokens[i] for i in range(len(seqs))]


def test_records_hold_a_forced_token_and_a_temperature_past_float32():
    seqs = [SeqMeta("a", False, 1, 6, 5, num_generated=1, forced_token=9),
            SeqMeta("b", False, 1, 6, 5, num_generated=1, params=SamplingParams(temperature=1e300))]
    inputs = prepare_sampler_inputs(seqs)
    assert inputs.forced_tokens.tolist() == [9, -1] and inputs.temperatures[1] == np.inf
    with pytest.raises(TypeError, match="expected SeqMeta, got dict"):
        prepare_sampler_inputs([seqs[0], {"request_id": "c"}])


@pytest.mark.parametrize("field", ["min_tokens", "logprobs", "prompt_logprobs"])
def test_counts_past_int32_are_refused_where_the_params_are_built(field):
    with pytest.raises(ValueError, match=rf"{field}={2**31}: must be .*an int in \[0, 2\*\*31\)"):
        SamplingParams(**{field: 2**31})


def test_the_record_stays_out_of_vars_and_survives_copy_and_pickle():
    import copy
    import pickle

    params = SamplingParams(temperature=0.5, seed=3, min_tokens=2)
    seq = SeqMeta("a", False, 1, 6, 5, num_generated=1, params=params)
    assert "ledger_record" not in vars(params) and "ledger_record" not in vars(seq)
    assert SamplingParams(**vars(params)) == params  # rebuilding from the fields still works
    for twin in (copy.copy(seq), copy.deepcopy(seq), pickle.loads(pickle.dumps(seq))):
        assert twin == seq and twin.ledger_record == seq.ledger_record
        assert prepare_sampler_inputs([twin]) == prepare_sampler_inputs([seq])
