"""The persistent batch (engine/step/batch.py): the embedding API
against the SeqMeta path step by step, its request life cycle and errors, the
draft-info pool it holds (or not), and the SeqMeta front `StepEngine.step`
runs on against the pure `prepare_sampler_inputs`."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine, prepare_sampler_inputs
from engine.step.batch import PersistentBatch

V, H, K, EOS = 64, 8, 3, 1


def engine(**config) -> StepEngine:
    base = dict(max_num_reqs=4, max_draft_tokens=K, device="cpu", use_graphs=False, eos_token_id=EOS, seed_base=7,
                max_stop_ids=4)
    base.update(config)
    return StepEngine(torch.randn(V, H, generator=torch.Generator().manual_seed(0)), EngineConfig(**base))


def random_params(rng: np.random.Generator) -> SamplingParams:
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])),
        seed=None if rng.random() < 0.5 else int(rng.integers(0, 2**40)), min_tokens=int(rng.integers(0, 4)),
        logprobs=None if rng.random() < 0.5 else 2, prompt_logprobs=bool(rng.random() < 0.3),
        stop_token_ids=tuple(int(t) for t in rng.integers(2, V, int(rng.integers(0, 3)))),
        ignore_eos=bool(rng.random() < 0.2))


def ledger_options(config: EngineConfig) -> dict:
    return dict(max_draft_tokens=config.max_draft_tokens, seed_base=config.seed_base, draft_pool=config.draft_pool)


# -- the embedding API against the SeqMeta path -------------------------------------------


def drive(seed: int, *, pool: bool, steps: int = 14) -> int:
    """Requests join, prefill in chunks, decode with drafts, change parameters and
    leave; every step through the persistent batch and `engine.run` equals the
    same step as a SeqMeta list through a second engine's `step`: the ledger,
    the stop ids and every output. Returns the tokens emitted."""
    rng = np.random.default_rng(seed)
    ours = engine(draft_pool_slots=None if pool else 1)
    theirs = engine(draft_pool_slots=None if pool else 1)
    batch = PersistentBatch(ours)
    live: dict[int, dict] = {}
    next_id, emitted = 0, 0
    for _ in range(steps):
        while len(live) < 4 and rng.random() < 0.6:
            prompt = rng.integers(2, V, int(rng.integers(1, 12))).tolist()
            params = random_params(rng)
            batch.add(next_id, prompt, params)
            live[next_id] = dict(prompt=prompt, params=params, prefilled=0, generated=0)
            next_id += 1
        if not live:
            continue
        decoding = [rid for rid, r in live.items() if r["generated"]]  # prompt logprobs stay as they began
        if decoding and rng.random() < 0.3:
            rid = int(rng.choice(decoding))
            live[rid]["params"] = random_params(rng)
            batch.update(rid, live[rid]["params"])
        ids = [int(r) for r in rng.permutation(list(live))]
        seqs, drafts, next_drafts = [], [], []
        for rid in ids:
            r = live[rid]
            row = batch.table.row(rid)
            if r["generated"] == 0:
                chunk = int(rng.integers(1, len(r["prompt"]) - r["prefilled"] + 1))
                seqs.append(SeqMeta(rid, True, chunk, r["prefilled"] + chunk, len(r["prompt"]), r["prompt"], 0,
                                    r["params"], 0, int(batch.table.cols["mtp_write_slot"][row])))
                drafts.append(None)
            else:
                k = int(rng.integers(0, K + 1))
                seqs.append(SeqMeta(rid, False, 1 + k, len(r["prompt"]) + r["generated"] + k, len(r["prompt"]),
                                    r["prompt"], r["generated"], r["params"], 0,
                                    int(batch.table.cols["mtp_write_slot"][row])))
                drafts.append(None if pool and rng.random() < 0.5 else rng.integers(2, V, k).tolist())
            next_drafts.append(rng.integers(2, V, int(rng.integers(0, K + 1))).tolist() if pool else None)
        step = batch.prepare(ids, [s.seqlen_q for s in seqs], [s.seqlen_k for s in seqs], draft_tokens=drafts,
                             next_drafts=next_drafts if pool else None)
        if pool:  # the batch chose the read slots (take-once); the SeqMeta caller states them
            seqs = [SeqMeta(s.request_id, s.is_prompt, s.seqlen_q, s.seqlen_k, s.prompt_len, s.prompt_tokens,
                            s.num_generated, s.params, int(read), s.mtp_write_slot)
                    for s, read in zip(seqs, step.read_slots)]
        assert step.inputs == prepare_sampler_inputs(seqs, **ledger_options(ours.config))
        np.testing.assert_array_equal(step.arrays.stop_ids, theirs.stop_rule.matrix(seqs))
        hidden = torch.randn(sum(s.seqlen_q for s in seqs), H, generator=torch.Generator().manual_seed(seed))
        out = ours.run(hidden, step.inputs, step.arrays)
        assert out == theirs.step(hidden, seqs, drafts, next_drafts=next_drafts if pool else None)
        batch.record(step, out)
        for s, tokens in zip(seqs, out.tokens):
            r = live[s.request_id]
            r["prefilled"] = min(s.seqlen_k, len(r["prompt"]))
            r["generated"] += len(tokens)
            emitted += len(tokens)
            if r["generated"] >= 6 or (r["generated"] and rng.random() < 0.15):
                batch.remove(s.request_id)
                ours.prompt_logprobs.discard(s.request_id)
                theirs.prompt_logprobs.discard(s.request_id)
                del live[s.request_id]
    return emitted


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), pool=st.booleans())
def test_persistent_batch_steps_equal_seqmeta_steps(seed, pool):
    assert drive(seed, pool=pool) > 0


def test_a_request_by_row_or_by_id_gives_the_same_step():
    e = engine()
    batch = PersistentBatch(e)
    rows = [batch.add(rid, [3, 4, 5], SamplingParams(seed=i)) for i, rid in enumerate("abc")]
    by_id = batch.prepare(["c", "a"], [3, 2], [3, 2])
    by_row = batch.prepare_rows(np.array([rows[2], rows[0]]), np.array([3, 2]), np.array([3, 2]))
    assert by_id.inputs == by_row.inputs and by_id.inputs.request_ids == ("c", "a")
    assert "a" in batch and len(batch) == 3


def test_update_rewrites_parameters_and_stop_ids_and_a_bad_one_changes_nothing():
    e = engine()
    batch = PersistentBatch(e)
    batch.add("a", [5, 6], SamplingParams(temperature=0.5, stop_token_ids=(9,)))
    step = batch.prepare(["a"], [2], [2])
    assert step.inputs.temperatures.tolist() == [0.5] and step.arrays.stop_ids[0].tolist() == [EOS, 9, -1, -1]
    batch.update("a", SamplingParams(temperature=0.0, ignore_eos=True, stop_token_ids=(7, 8)))
    step = batch.prepare(["a"], [2], [2])
    # ignore_eos: EOS does not end the request, but min_tokens still holds it back (vLLM).
    assert step.inputs.temperatures.tolist() == [0.0] and step.arrays.stop_ids[0].tolist() == [EOS, 7, 8, -1]
    with pytest.raises(ValueError, match=r"request 'a': params.stop_token_ids: 5 stop ids"):
        batch.update("a", SamplingParams(stop_token_ids=(2, 3, 4, 5)))
    assert batch.prepare(["a"], [2], [2]).inputs == step.inputs


# -- the life cycle and the errors --------------------------------------------------------


def test_bad_requests_and_bad_steps_raise_naming_the_request_and_the_field():
    batch = PersistentBatch(engine(max_num_reqs=2))
    batch.add("a", [5, 6, 7], SamplingParams())
    with pytest.raises(ValueError, match=r"request 'a': request_id is already in the table"):
        batch.add("a", [1], SamplingParams())
    with pytest.raises(ValueError, match=r"request 'b': prompt_tokens\[1\]=2.5"):
        batch.add("b", [1, 2.5], SamplingParams())
    with pytest.raises(ValueError, match=r"request 'b': prompt_len=0"):
        batch.add("b", [], SamplingParams())
    with pytest.raises(ValueError, match=r"request 'b': prompt_tokens=None"):
        batch.add("b", None, SamplingParams())
    with pytest.raises(ValueError, match=r"request 'b': params.stop_token_ids=\(70,\): outside the vocabulary"):
        batch.add("b", [1], SamplingParams(stop_token_ids=(70,)))
    with pytest.raises(ValueError, match=r"request 'zz': not in the table"):
        batch.prepare(["zz"], [1], [1])
    with pytest.raises(ValueError, match=r"request 'zz': not in the table"):
        batch.update("zz", SamplingParams())
    cases = [
        ((["a"], [4], [4]), r"request 'a': seqlen_k=4: a prompt chunk reaches past prompt_len=3"),
        ((["a"], [2], [1]), r"request 'a': seqlen_k=1: is smaller than seqlen_q=2"),
        ((["a"], [0], [2]), r"request 'a': seqlen_q=0: must be >= 1"),
        ((["a", "a"], [1, 1], [1, 1]), r"request 'a': request_id appears twice in one batch"),
        ((["a"], [1.0], [1]), r"seqlen_q: expected 1 int counts"),
        ((["a"], [1, 1], [1]), r"seqlen_q: expected 1 int counts"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            batch.prepare(*args)
    with pytest.raises(ValueError, match=r"rows: table row 1 holds no request"):
        batch.prepare_rows(np.array([1]), [1], [1])
    step = batch.prepare(["a"], [3], [3])
    batch.record(step, engine_run(batch, step))
    with pytest.raises(ValueError, match=r"request 'a': seqlen_k=5: a decode step has seqlen_k == prompt_len \+ "
                                         r"generated \+ drafts = 3 \+ 1 \+ 0 = 4"):
        batch.prepare(["a"], [1], [5])
    with pytest.raises(ValueError, match=r"request 'a': seqlen_q=5: verifies 4 drafts but max_draft_tokens=3"):
        batch.prepare(["a"], [5], [8])
    batch.add("b", [1], SamplingParams())
    with pytest.raises(RuntimeError, match="full"):
        batch.add("c", [1], SamplingParams())
    batch.remove("a")
    batch.add("c", [1], SamplingParams())  # the freed row is reused
    assert len(batch) == 2


def engine_run(batch: PersistentBatch, step):
    return batch.engine.run(torch.zeros(step.inputs.num_output_rows, H), step.inputs, step.arrays)


def test_pool_slots_are_held_per_request_and_read_once_after_each_write():
    batch = PersistentBatch(engine(max_num_reqs=2))  # pool of max_num_reqs + 1 slots
    a = batch.add("a", [5, 6, 7, 8], SamplingParams(temperature=0.0))
    slot_a = int(batch.table.cols["mtp_write_slot"][a])
    batch.add("b", [5], SamplingParams())
    with pytest.raises(RuntimeError, match="full"):
        batch.add("c", [5], SamplingParams())
    batch.remove("b")
    assert int(batch.table.cols["mtp_write_slot"][batch.add("c", [5], SamplingParams())]) != slot_a
    batch.remove("c")
    chunk = batch.prepare(["a"], [2], [2])  # a non-last chunk writes no draft info
    assert chunk.inputs.mtp_info_write_slots.tolist() == [0]
    batch.record(chunk, engine_run(batch, chunk))
    last = batch.prepare(["a"], [2], [4], next_drafts=[[9, 9]])
    assert last.read_slots.tolist() == [0] and last.inputs.mtp_info_write_slots.tolist() == [slot_a]
    batch.record(last, engine_run(batch, last))
    decode = batch.prepare(["a"], [3], [7])  # drafts from the pool: what `last` wrote
    assert decode.read_slots.tolist() == [slot_a]
    assert batch.prepare(["a"], [3], [7]).read_slots.tolist() == [slot_a]  # not recorded: not consumed
    out = engine_run(batch, decode)
    batch.record(decode, out)
    assert batch.engine.buffers.resolved_drafts[:2].tolist() == [9, 9]
    drafts = 1 + out.num_accepted[0]
    assert batch.prepare(["a"], [1 + drafts], [4 + 1 + drafts + drafts]).read_slots.tolist() == [slot_a]


# -- no draft-info pool -------------------------------------------------------------------


def test_without_a_pool_write_slots_are_zero_and_nothing_is_written():
    e = engine(draft_pool_slots=1)
    assert not e.config.draft_pool
    batch = PersistentBatch(e)
    assert batch.draft_slots is None
    batch.add("a", [5, 6, 7], SamplingParams(temperature=0.0))
    e.buffers.pool_tokens.fill_(11)  # a sentinel: any pool write shows
    e.buffers.pool_logprobs.fill_(-2.0)
    step = batch.prepare(["a"], [3], [3])
    batch.record(step, engine_run(batch, step))
    step = batch.prepare(["a"], [3], [6], draft_tokens=[[4, 4]])
    assert step.inputs.mtp_info_write_slots.tolist() == [0]
    engine_run(batch, step)
    assert (e.buffers.pool_tokens == 11).all() and (e.buffers.pool_logprobs == -2.0).all()
    # A SeqMeta caller may leave the write slot at 0, and must: there is no slot to write.
    e.step(torch.zeros(3, H), [SeqMeta("x", False, 3, 6, 3, num_generated=1)], [[4, 4]])
    with pytest.raises(ValueError, match=r"request 'x': mtp_write_slot=1: EngineConfig\(draft_pool_slots=1\) has no "
                                         r"draft-info pool"):
        e.step(torch.zeros(3, H), [SeqMeta("x", False, 3, 6, 3, num_generated=1, mtp_write_slot=1)], [[4, 4]])
    with pytest.raises(ValueError, match=r"next_drafts: given but EngineConfig\(draft_pool_slots=1\) has no draft-info"):
        e.step(torch.zeros(3, H), [SeqMeta("x", False, 3, 6, 3, num_generated=1)], [[4, 4]], next_drafts=[[5]])
    with pytest.raises(ValueError, match=r"request 'x': mtp_write_slot=0: a running request's draft-info write slot "
                                         r"is never 0"):
        engine().step(torch.zeros(1, H), [SeqMeta("x", False, 1, 4, 3, num_generated=1)])


def test_draft_pool_slots_accepts_one_and_rejects_zero():
    assert EngineConfig(max_draft_tokens=2, draft_pool_slots=1).pool_slots == 1
    assert EngineConfig(max_draft_tokens=2).draft_pool and not EngineConfig().draft_pool
    with pytest.raises(ValueError, match=r"EngineConfig.draft_pool_slots=0: must be an int >= 1"):
        EngineConfig(draft_pool_slots=0)


# -- the SeqMeta front of StepEngine.step -------------------------------------------------


def front_steps(rng: np.random.Generator, e: StepEngine, steps: int = 25):
    """SeqMeta lists as an embedder's scheduler hands them over: ids from a small
    pool reused by new requests, batches in any order and of any size (above
    the front's capacity too), parameters replaced now and then, sometimes by an
    equal object that asks for something else (prompt_logprobs True == 1)."""
    known: dict[int, dict] = {}
    for _ in range(steps):
        n = int(rng.integers(0, 3 * e.config.max_num_reqs + 1))
        ids = rng.choice(12, size=min(n, 12), replace=False)
        seqs = []
        for rid in ids.tolist():
            if rid not in known or rng.random() < 0.1:
                known[rid] = dict(prompt=rng.integers(0, V, int(rng.integers(1, 10))).tolist(), params=random_params(rng),
                                  write=int(rng.integers(1, e.config.pool_slots)))
            r = known[rid]
            if rng.random() < 0.1:
                r["params"] = SamplingParams(prompt_logprobs=1 if r["params"].prompt_logprobs is True else True)
            if rng.random() < 0.1:
                r["write"] = int(rng.integers(1, e.config.pool_slots))
            plen = len(r["prompt"])
            if rng.random() < 0.4:
                k = int(rng.integers(1, plen + 1))
                q = int(rng.integers(1, k + 1))
                seqs.append(SeqMeta(rid, True, q, k, plen, r["prompt"], 0, r["params"], 0, r["write"]))
            else:
                drafts, generated = int(rng.integers(0, K + 1)), int(rng.integers(1, 9))
                seqs.append(SeqMeta(rid, False, 1 + drafts, plen + generated + drafts, plen,
                                    r["prompt"] if rng.random() < 0.5 else None, generated, r["params"],
                                    int(rng.choice([0, r["write"]])), r["write"]))
        yield seqs
        for _ in range(int(rng.integers(0, 3))):  # the same batch again, one token on: the steady decode path
            seqs = [s if s.is_prompt else SeqMeta(
                s.request_id, False, s.seqlen_q, s.seqlen_k + 1, s.prompt_len, s.prompt_tokens, s.num_generated + 1,
                s.params, s.mtp_read_slot, int(rng.integers(1, e.config.pool_slots)) if rng.random() < 0.1
                else s.mtp_write_slot) for s in seqs]
            yield seqs


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_seqmeta_front_equals_the_pure_ledger_over_many_steps(seed):
    e = engine(max_num_reqs=3)  # the front holds 6 requests: evictions and growth happen
    for seqs in front_steps(np.random.default_rng(seed), e):
        inputs, stop_ids = e.seq_front.ledger(seqs)
        assert inputs == prepare_sampler_inputs(seqs, **ledger_options(e.config))
        np.testing.assert_array_equal(stop_ids, e.stop_rule.matrix(seqs))


def test_seqmeta_front_rewrites_a_request_only_when_its_params_object_changes():
    e = engine()
    params = SamplingParams(prompt_logprobs=True)
    seq = SeqMeta("a", True, 2, 2, 4, [1, 2, 3, 4], params=params)
    assert e.seq_front.ledger([seq])[0].num_prompt_logprobs.tolist() == [0]
    equal = SamplingParams(prompt_logprobs=1)
    assert equal == params  # True == 1, yet one more alternative is asked for
    again = SeqMeta("a", True, 2, 4, 4, [1, 2, 3, 4], params=equal)
    assert e.seq_front.ledger([again])[0].num_prompt_logprobs.tolist() == [1]


def test_seqmeta_front_keeps_the_pure_paths_errors():
    e = engine()
    seq = SeqMeta("a", False, 1, 4, 3, num_generated=1, mtp_write_slot=1)
    with pytest.raises(TypeError, match="expected SeqMeta, got dict"):
        e.seq_front.ledger([seq, {"request_id": "b"}])
    with pytest.raises(ValueError, match=r"request 'a': request_id appears twice in one batch"):
        e.seq_front.ledger([seq, seq])
    inputs, stop_ids = e.seq_front.ledger([])
    assert inputs.num_reqs == 0 and stop_ids.shape == (0, e.config.max_stop_ids)
    assert e.seq_front.ledger([seq])[0] == prepare_sampler_inputs([seq], **ledger_options(e.config))
