"""The request lifecycle under any call order (issue 25): each numbered failure of the
issue's first list, as a user of `PersistentBatch` or `StepEngine.step` would meet it.
Every case ends in a ValueError naming the request, the field and the value with nothing
changed, or in the tokens a fresh engine gives the request alone (`alone`, a plain
per-request run through a second engine)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine
from engine.host.token_constraints import GrammarCache
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.models.llama import LlamaModel
from engine.models.llama_weights import LlamaConfig
from engine.models.tokenizer import ByteChatMLTokenizer
from engine.step.batch import PersistentBatch

V, H, EOS = 64, 8, 1
PENALISED = SamplingParams(temperature=0.9, seed=5, presence_penalty=1.5, frequency_penalty=1.0,
                           repetition_penalty=1.3)
EMBED = torch.randn(V, H, generator=torch.Generator().manual_seed(3))
PLACE = torch.randn(64, H, generator=torch.Generator().manual_seed(4))


def engine(**config) -> StepEngine:
    base = dict(max_num_reqs=2, max_draft_tokens=0, max_control_slots=4, device="cpu", use_graphs=False,
                eos_token_id=EOS, seed_base=7)
    base.update(config)
    return StepEngine(torch.randn(V, H, generator=torch.Generator().manual_seed(0)), EngineConfig(**base))


def hidden(tokens: list[int], start: int) -> torch.Tensor:
    """[len(tokens), H]: a made-up model's rows, a function of each token and its position only."""
    return EMBED[torch.tensor(tokens) % V] + PLACE[torch.arange(start, start + len(tokens))]


def seq(request_id, prompt, output, params, chunk=None) -> tuple[SeqMeta, torch.Tensor]:
    """The SeqMeta of a request's next step (the whole prompt, or `chunk` of it, or one
    decode token) and its hidden rows."""
    if not output:
        done = 0 if chunk is None else chunk[0]
        end = len(prompt) if chunk is None else chunk[1]
        return (SeqMeta(request_id, True, end - done, end, len(prompt), prompt, 0, params),
                hidden(prompt[done:end], done))
    k = len(prompt) + len(output)
    return SeqMeta(request_id, False, 1, k, len(prompt), prompt, len(output), params), hidden([output[-1]], k - 1)


def step(e: StepEngine, requests: dict) -> None:
    """One step of `requests` (id -> [prompt, output, params]) through `e.step`; outputs grow."""
    pairs = [seq(rid, *r) for rid, r in requests.items()]
    out = e.step(torch.cat([h for _, h in pairs]), [s for s, _ in pairs])
    for r, tokens in zip(requests.values(), out.tokens):
        r[1].extend(tokens)


def alone(prompt: list[int], params: SamplingParams, steps: int, request_id="r") -> list[int]:
    """The request's tokens over `steps` steps (prefill, then decodes) in a fresh engine."""
    e, r = engine(), {request_id: [prompt, [], params]}
    for _ in range(steps):
        step(e, r)
    return r[request_id][1]


def batch_step(batch: PersistentBatch, requests: dict):
    """(prepared step, hidden) of `requests` (id -> [prompt, output]) in a persistent batch."""
    ids = list(requests)
    q, k, rows = [], [], []
    for rid in ids:
        prompt, output = requests[rid]
        s, h = seq(rid, prompt, output, SamplingParams())
        q.append(s.seqlen_q), k.append(s.seqlen_k), rows.append(h)
    return batch.prepare(ids, q, k), torch.cat(rows)


def run_batch(batch: PersistentBatch, requests: dict) -> None:
    prepared, h = batch_step(batch, requests)
    out = batch.engine.run(h, prepared.inputs, prepared.arrays)
    batch.record(prepared, out)
    for r, tokens in zip(requests.values(), out.tokens):
        r[1].extend(tokens)


# -- 1. an out-of-vocabulary prompt token on a penalised request ------------------------------


def test_1_an_out_of_vocabulary_prompt_token_takes_nothing():
    for e, add in ((engine(), None), (engine(), "batch")):
        free = e.controls.free_slots
        if add:
            batch = PersistentBatch(e)
            for _ in range(3):  # more than the table's 2 rows: nothing leaks
                with pytest.raises(ValueError, match=r"request 'a': prompt_tokens\[1\]=70: outside \[0, 64\)"):
                    batch.add("a", [3, V + 6], PENALISED)
            assert len(batch) == 0 and batch.state("a").value == "removed"
            batch.add("b", [3], PENALISED), batch.add("c", [4], PENALISED)
        else:
            for _ in range(5):
                with pytest.raises(ValueError, match=r"request 'a': prompt_tokens\[1\]=70: outside the vocabulary"):
                    step(e, {"a": [[3, V + 6], [], PENALISED]})
            assert len(e.seq_front.table) == 0
            step(e, {"b": [[3], [], PENALISED], "c": [[4], [], PENALISED]})
        assert e.controls.free_slots == free - 2


# -- 2. a penalised request is never evicted ---------------------------------------------------


def test_2_a_live_penalised_request_is_kept_while_new_ids_come_and_go():
    e = engine()  # the front's table: 4 rows
    p = {"p": [[5, 6, 7], [], PENALISED]}
    step(e, p)
    step(e, p)
    for j in range(4):  # four steps of three new ids each (no state): their rows are a cache
        step(e, {f"x{j}{i}": [[9 + i], [], SamplingParams(seed=i)] for i in range(3)})
    with pytest.raises(ValueError, match=r"request 'p': StepEngine.step: the step names 5 requests, more than the "
                                         r"4 rows of the request table .* engine.finish\(request_id\)"):
        step(e, {f"y{i}": [[9], [], SamplingParams()] for i in range(5)})
    step(e, {"z": [[9], [], SamplingParams()]})  # bystanders still run
    step(e, p)
    step(e, p)
    assert p["p"][1] == alone([5, 6, 7], PENALISED, 4, "p")


def test_2_a_step_that_needs_the_rows_of_live_requests_is_refused_naming_the_table():
    e = engine()
    live = {f"p{i}": [[5 + i], [], PENALISED] for i in range(3)}
    step(e, live)
    with pytest.raises(ValueError, match=r"the table holds 4 rows .* 3 of them belong to live requests"):
        step(e, {"n1": [[9], [], SamplingParams()], "n2": [[9], [], SamplingParams()]})
    assert set(e.seq_front.table.row_of) == {"p0", "p1", "p2"}  # nothing given up
    e.finish("p0")
    step(e, {"n1": [[9], [], SamplingParams()]})


# -- 3. a reused id on step() starts from nothing ------------------------------------------------


@pytest.mark.parametrize("ends", ["finish", "first chunk"])
def test_3_a_reused_id_inherits_nothing(ends):
    e = engine()
    old = {"a": [[5, 6, 7, 8], [], PENALISED]}
    for _ in range(4):
        step(e, old)
    if ends == "finish":
        e.finish("a")
        assert e.controls.free_slots == e.config.max_control_slots
    new = {"a": [[9, 10], [], PENALISED]}
    for _ in range(4):
        step(e, new)
    assert new["a"][1] == alone([9, 10], PENALISED, 4, "a")
    slot = int(e.seq_front.table.control_slot[e.seq_front.table.row("a")])
    assert int(e.controls.counts[slot].sum()) == 4  # the new request's tokens only


# -- 4. penalties are refused after generation, by any route ---------------------------------------


def test_4_penalties_after_generation_are_refused_by_any_route():
    batch = PersistentBatch(engine())
    batch.add("a", [5, 6], SamplingParams())
    run_batch(batch, {"a": [[5, 6], []]})
    batch.update("a", SamplingParams(logit_bias={3: 1.0}))  # a slot taken after generation: fine for a bias
    with pytest.raises(ValueError, match=r"request 'a': presence_penalty=0.5: penalties must be set before the first"):
        batch.update("a", SamplingParams(logit_bias={3: 1.0}, presence_penalty=0.5))
    assert batch.table.params[batch.table.row("a")].presence_penalty == 0  # nothing written
    e = engine()
    s = {"b": [[5, 6], [], SamplingParams()]}
    step(e, s)
    s["b"][2] = SamplingParams(logit_bias={3: 1.0})
    step(e, s)
    s["b"][2] = SamplingParams(logit_bias={3: 1.0}, frequency_penalty=0.5)
    with pytest.raises(ValueError, match=r"request 'b': frequency_penalty=0.5: penalties must be set before"):
        step(e, s)
    # A slot joined before generation counted from the first token: penalties may follow.
    batch.add("c", [5], SamplingParams(logit_bias={3: 1.0}))
    run_batch(batch, {"c": [[5], []]})
    batch.update("c", SamplingParams(logit_bias={3: 1.0}, presence_penalty=0.5))


# -- 5. a prepared step is checked against the table's state ----------------------------------------


def test_5_a_stale_prepared_step_is_refused_and_a_step_is_recorded_once():
    e = engine()
    batch = PersistentBatch(e)
    batch.add("a", [5, 6], PENALISED), batch.add("b", [7], SamplingParams(seed=1))
    r = {"a": [[5, 6], []], "b": [[7], []]}
    run_batch(batch, r)
    prepared, h = batch_step(batch, r)
    batch.remove("a")
    batch.add("c", [9, 10], PENALISED)  # takes a's row and control slot
    counts = e.controls.counts.clone()
    with pytest.raises(ValueError, match=r"request 'a': stale step: it was removed and table row 0 now holds "
                                         r"request 'c'; prepare the step again"):
        e.run(h, prepared.inputs, prepared.arrays)
    assert torch.equal(e.controls.counts, counts)
    c = {"c": [[9, 10], []]}
    for _ in range(3):
        run_batch(batch, c)
    assert c["c"][1] == alone([9, 10], PENALISED, 3, "c")
    prepared, h = batch_step(batch, c)
    out = e.run(h, prepared.inputs, prepared.arrays)
    with pytest.raises(ValueError, match=r"request 'c': stale step: the request changed"):
        e.run(h, prepared.inputs, prepared.arrays)  # the same step twice
    batch.record(prepared, out)
    with pytest.raises(ValueError, match=r"request 'c': stale step: record\(step, out\) takes the step"):
        batch.record(prepared, out)
    assert batch.table.cols["num_generated"][batch.table.row("c")] == 4


# -- 6. remove mid-prefill frees the partial prompt logprobs ------------------------------------------


def test_6_remove_mid_prefill_leaves_no_prompt_logprobs():
    e = engine()
    batch = PersistentBatch(e)
    batch.add("a", [5, 6, 7, 8, 9, 10], SamplingParams(prompt_logprobs=1))
    prepared = batch.prepare(["a"], [3], [3])
    batch.record(prepared, e.run(hidden([5, 6, 7], 0), prepared.inputs, prepared.arrays))
    assert batch.state("a").value == "prefilling" and batch.prompt_logprobs.pending == ("a",)
    batch.remove("a")
    assert batch.prompt_logprobs.pending == ()
    batch.add("a", [20, 21, 22, 23, 24, 25], SamplingParams(prompt_logprobs=1))
    prepared = batch.prepare(["a"], [3], [6])  # a chunk at position 3 of a new prompt: nothing to continue
    with pytest.raises(ValueError, match=r"request 'a': prompt chunk starts at position 3 but 0 prompt logprobs"):
        e.run(hidden([23, 24, 25], 3), prepared.inputs, prepared.arrays)


# -- 7. a refused rollback changes nothing ---------------------------------------------------------


def test_7_a_refused_rollback_changes_nothing():
    e = engine()
    r = {"a": [[5, 6], [], PENALISED], "b": [[5, 6, 7, 8], [], SamplingParams(prompt_logprobs=1)]}
    mark = e.checkpoint()
    step(e, {"a": r["a"]})
    step(e, {"a": r["a"], "b": [[5, 6, 7, 8], [], SamplingParams(prompt_logprobs=1), (0, 2)]})
    stats, pending, counts = e.stats.steps, e.prompt_logprobs.pending, e.controls.counts.clone()
    with pytest.raises(ValueError, match=r"checkpoint: a rollback can undo one step of the penalty counts, 2 ran"):
        e.rollback(mark)
    assert e.stats.steps == stats and e.prompt_logprobs.pending == pending
    assert torch.equal(e.controls.counts, counts)


# -- 8. a decode never verifies drafts it was not given ----------------------------------------------


def test_8_a_phantom_draft_is_refused():
    e = engine(max_draft_tokens=2, draft_pool_slots=1)
    batch = PersistentBatch(e)
    batch.add("a", [5, 6], SamplingParams())
    run_batch(batch, {"a": [[5, 6], []]})
    with pytest.raises(ValueError, match=r"request 'a': seqlen_q=2 claims 1 drafts but draft_tokens gives none"):
        batch.prepare(["a"], [2], [4])
    batch.prepare(["a"], [2], [4], draft_tokens=[[7]])
    e = engine(max_draft_tokens=2, draft_pool_slots=1)
    s = SeqMeta("b", False, 2, 4, 2, [5, 6], 1, SamplingParams())
    with pytest.raises(ValueError, match=r"request 'b': seqlen_q=2 claims 1 drafts"):
        e.step(hidden([7, 8], 2), [s])


# -- 9. caps -----------------------------------------------------------------------------------------


def small_loop(**config) -> DecodeLoop:
    model = LlamaModel.random(LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                                          num_heads=2, num_kv_heads=1, head_dim=8, max_position=64,
                                          eos_token_id=EOS), seed=0, num_slots=4, batch_invariant=True)
    return DecodeLoop(model, LoopConfig(seed_base=0, max_num_reqs=2, token_budget=16, **config),
                      engine_config=EngineConfig(device="cpu"), capture=False)


def test_9_prompt_logprobs_and_n_are_capped():
    batch = PersistentBatch(engine())
    with pytest.raises(ValueError, match=r"request 'a': params.prompt_logprobs=21: more than max_logprobs=20"):
        batch.add("a", list(range(2, 30)), SamplingParams(prompt_logprobs=21))
    batch.add("a", list(range(2, 30)), SamplingParams(prompt_logprobs=20))
    e = engine()
    with pytest.raises(ValueError, match=r"request 'b': params.prompt_logprobs=10\*\*9|prompt_logprobs=1000000000"):
        step(e, {"b": [[2, 3], [], SamplingParams(prompt_logprobs=10**9)]})
    loop = small_loop()
    with pytest.raises(ValueError, match=r"request 'x': params.n=129: more than LoopConfig.max_n=128"):
        loop.submit("x", [3], SamplingParams(n=129))
    loop.check("x", [3], SamplingParams(n=128))
    assert not loop.waiting and not loop.families


def test_9_the_loop_keeps_a_bounded_number_of_finished_records():
    loop = small_loop(max_finished=2, default_max_tokens=2)
    for i in range(3):
        loop.submit(i, [3 + i], SamplingParams(temperature=0))
    loop.submit("fam", [4], SamplingParams(temperature=0.5, n=2))
    done = loop.run()
    assert set(done) == {0, 1, 2, ("fam", 0), ("fam", 1)}  # run hands every one back
    assert len(loop.finished) <= 2 and len(loop._known) <= 3 and len(loop.families) <= 1
    loop.submit(0, [3], SamplingParams(temperature=0))  # a dropped id may come again
    assert loop.run()[0].tokens == done[0].tokens


def test_9_the_grammar_cache_drops_the_least_recently_used():
    cache = GrammarCache(ByteChatMLTokenizer(), 264, [257], max_entries=2)
    first = cache.compiled("r", "regex", "a+")
    cache.compiled("r", "regex", "b+")
    assert cache.compiled("r", "regex", "a+") is first  # a hit makes it the most recent
    cache.compiled("r", "regex", "c+")
    assert len(cache) == 2 and cache.compiled("r", "regex", "a+") is first
    assert cache.compiled("r", "regex", "b+") is not None and len(cache) == 2
    tight = GrammarCache(ByteChatMLTokenizer(), 264, [257], max_bytes=first.memory_size_bytes)
    tight.compiled("r", "regex", "a+")
    tight.compiled("r", "regex", "b+")
    assert len(tight) == 1 and tight.nbytes <= first.memory_size_bytes
    none = GrammarCache(ByteChatMLTokenizer(), 264, [257], max_bytes=1)
    assert none.compiled("r", "regex", "a+") is not None and len(none) == 0 and none.nbytes == 0


# -- 10. wrong exceptions, misleading messages -------------------------------------------------------


def test_10_bad_prompts_are_refused_naming_the_request_and_the_field():
    e = engine()
    batch = PersistentBatch(e)
    with pytest.raises(ValueError, match=r"request 'a': prompt_tokens\[0\]=\[5, 6\]: must be an int token id"):
        batch.add("a", [[5, 6], [7, 8]], PENALISED)
    with pytest.raises(ValueError, match=r"request 'a': prompt_tokens=\{5: 6\}: must be a sequence of int token ids"):
        batch.add("a", {5: 6}, SamplingParams())
    with pytest.raises(ValueError, match=r"request 'a': prompt_tokens=\{5: 6\}: must be a flat sequence"):
        SeqMeta("a", True, 1, 1, 1, {5: 6})
    with pytest.raises(ValueError, match=r"request 'a': prompt_tokens: shape \(1, 2\)"):
        SeqMeta("a", True, 1, 1, 1, np.array([[5, 6]]))
    assert len(batch) == 0 and e.controls.free_slots == e.config.max_control_slots


def test_10_an_out_of_vocabulary_stop_id_with_structured_output_is_a_value_error():
    batch = PersistentBatch(engine(), tokenizer=ByteChatMLTokenizer())
    with pytest.raises(ValueError, match=r"request 'a': params.stop_token_ids=\(70,\): .*outside the vocabulary"):
        batch.add("a", [5], SamplingParams(regex="a+", stop_token_ids=(70,)))
    constraints = batch.constraints
    with pytest.raises(ValueError, match=r"request 'a': params.stop_token_ids=\(70,\): token 70 is outside"):
        constraints.make("a", SamplingParams(regex="a+", stop_token_ids=(70,)))


def test_10_a_count_past_int32_is_refused_not_wrapped():
    batch = PersistentBatch(engine())
    batch.add("a", [5, 6, 7], SamplingParams())
    for name, q, k in (("seqlen_q", 2**32 + 3, 3), ("seqlen_k", 3, 2**32 + 3)):
        with pytest.raises(ValueError, match=rf"request 'a': {name}=4294967299: must lie in \[0, 2\*\*31\)"):
            batch.prepare(["a"], np.array([q], np.int64), np.array([k], np.int64))


def test_10_numpy_scalars_are_numbers_and_a_logit_bias_hashes():
    p = SamplingParams(top_p=np.float32(0.9), temperature=np.float64(0.5), top_k=np.int64(4), seed=np.uint64(3),
                       logit_bias={np.int64(3): np.float32(1.5)})
    assert type(p.top_p) is float and type(p.top_k) is int and type(p.seed) is int
    assert p.logit_bias == {3: 1.5} and type(next(iter(p.logit_bias))) is int
    same = SamplingParams(top_p=float(np.float32(0.9)), temperature=0.5, top_k=4, seed=3, logit_bias={3: 1.5})
    assert p == same and hash(p) == hash(same) and len({p, same}) == 1
    with pytest.raises(ValueError, match=r"top_k=np.True_|top_k=True"):
        SamplingParams(top_k=np.bool_(True))
