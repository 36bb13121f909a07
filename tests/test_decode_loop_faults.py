"""The decode loop under hostile submissions, aborts and faults (issue 11): hostile
submissions change nothing, abort frees what a request holds, run() skips idle steps,
a step that raises anywhere is undone, and a failed row finishes only its own request.
The helpers that snapshot a loop (`loop_state`, `assert_no_trace`, `failed_without_trace`,
`holds_nothing`) serve tests/test_chaos.py and tests/test_samples_and_stops.py too."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.loop.requests import StepEvent
from engine.models.llama import LlamaModel
from engine.models.llama_weights import LlamaConfig, random_weights
from tests.test_decode_loop import CONFIG, prompts_and_params, run_loop, shared_prefix_prompts, tiny_model

# -- hostile submissions, abort, idle clocks, atomic steps, failed rows (issue 11) -------


def loop_state(loop: DecodeLoop) -> dict:
    """Everything a step, a submission or an abort may change, as plain values."""
    def request(r):
        c = r.completion
        return (r.request_id, r.prefilled, r.kv_slot, r.table_row, list(c.tokens),
                None if c.logprobs is None else len(c.logprobs), c.prompt_logprobs, c.seed, c.finish_reason, c.error)

    return dict(
        waiting=[(arrival, request(r)) for arrival, r in loop.waiting],
        running=[request(r) for r in loop.running],
        finished={rid: (c.finish_reason, list(c.tokens)) for rid, c in loop.finished.items()},
        known=set(loop._known),
        retained=[(slot, held.tolist()) for slot, held in loop.retained.items()],
        free_kv_slots=list(loop.model.kv.slots.free),
        table=(dict(loop.batch.table.row_of), loop.batch.table.cols["num_generated"].tolist(), list(loop.batch.table._free)),
        stop_ids=loop.batch.table.stop_ids.tolist(),
        stats=counters(loop.stats),
        engine=(loop.engine.stats.steps, loop.engine.stats.replays, dict(loop.engine.stats.bucket_histogram),
                {rid: len(v) for rid, v in loop.batch.prompt_logprobs.snapshot().items()}),
    )


def failed_without_trace(loop: DecodeLoop, errors: tuple[type[BaseException], ...]) -> bool:
    """One loop step; when it raises one of `errors`, the loop holds no trace of it (True)."""
    before = loop_state(loop)
    try:
        loop.step()
    except errors:
        assert_no_trace(before, loop_state(loop))
        return True
    return False


def assert_no_trace(before: dict, after: dict) -> None:
    """A failed step left the loop as it found it, except that a retained cache whose slot
    it handed to a new request may keep only a prefix of what it held (see `_unadmit`)."""
    assert [slot for slot, _ in after["retained"]] == [slot for slot, _ in before["retained"]]
    for (_, held_after), (_, held_before) in zip(after["retained"], before["retained"]):
        assert held_after == held_before[: len(held_after)]
    assert {k: v for k, v in after.items() if k != "retained"} == {k: v for k, v in before.items() if k != "retained"}


def counters(stats) -> dict:
    """A stats dataclass without its timings."""
    return {k: v for k, v in dataclasses.asdict(stats).items() if not k.endswith("seconds")}


def holds_nothing(loop: DecodeLoop) -> None:
    assert len(loop.batch) == 0 and not loop.running and not loop.retained
    assert sorted(loop.model.kv.slots.free) == list(range(loop.model.num_slots))
    assert loop.batch.prompt_logprobs.pending == ()
    assert (loop.batch.table.stop_ids == -1).all()


def completions(done: dict) -> list:
    return [(rid, c.tokens, c.logprobs, c.prompt_logprobs, c.seed, c.finish_reason) for rid, c in sorted(done.items())]


def _loop(num_slots: int = 8, model=None, **options) -> DecodeLoop:
    config = dict(max_num_reqs=4, token_budget=32)
    config.update(options)
    return DecodeLoop(model or tiny_model(num_slots), LoopConfig(seed_base=0, **config), engine_config=EngineConfig(device="cpu"))


def _reject_all(loop, cases) -> None:
    for args, kwargs, match in cases:
        before = loop_state(loop)
        with pytest.raises(ValueError, match=match):
            loop.submit(*args, **kwargs)
        assert loop_state(loop) == before, (args, kwargs)


V = CONFIG.vocab_size


def test_submit_refuses_malformed_ids_prompts_and_arrivals_and_changes_nothing():
    loop = _loop()
    loop.submit("ok", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
    loop.step()  # a running request and a table row exist while the bad submissions come in
    g = SamplingParams()
    _reject_all(loop, [
        ((None, [1, 2], g), {}, "request_id=None: must not be None"),
        (([1, 2], [1, 2], g), {}, r"request_id=\[1, 2\]: must be hashable"),
        ((("a", [1]), [1, 2], g), {}, r"request_id=\('a', \[1\]\): must be hashable"),
        (("ok", [1, 2], g), {}, "request 'ok': request_id was already submitted"),
        (("nest", [[1, 2], [3, 4]], g), {}, r"request 'nest': prompt_tokens\[0\]=\[1, 2\]: must be an int token id"),
        (("float", [5.7, 6.2], g), {}, r"request 'float': prompt_tokens\[0\]=5.7: must be an int token id"),
        (("str", "123", g), {}, r"request 'str': prompt_tokens='123': text, not token ids; encode it first \(tokenizer.encode\(text\)\)"),
        (("bytes", b"12", g), {}, "request 'bytes': prompt_tokens=b'12': must be a sequence of int token ids, not a bytes"),
        (("bool", [True, False], g), {}, r"request 'bool': prompt_tokens\[0\]=True: must be an int token id, not a bool"),
        (("npbool", np.array([1, 0], dtype=bool), g), {}, "request 'npbool': prompt_tokens: a numpy array of bool"),
        (("npfloat", np.array([1.0, 2.0]), g), {}, "request 'npfloat': prompt_tokens: a numpy array of float64"),
        (("np2d", np.ones((2, 2), dtype=np.int64), g), {}, r"request 'np2d': prompt_tokens: shape \(2, 2\)"),
        (("tfloat", torch.tensor([1.0, 2.0]), g), {}, "request 'tfloat': prompt_tokens: a tensor of torch.float32"),
        (("gen", (t for t in [1, 2]), g), {}, "request 'gen': prompt_tokens=<generator"),
        (("set", {1, 2}, g), {}, r"request 'set': prompt_tokens=\{1, 2\}: must be a sequence"),
        (("huge", [3, 2**63], g), {}, r"request 'huge': prompt_tokens\[1\]=9223372036854775808: outside \[0, 256\)"),
        (("uhuge", np.array([3, 2**63], dtype=np.uint64), g), {}, r"request 'uhuge': prompt_tokens\[1\]=9223372036854775808"),
        (("neg", [3, -1], g), {}, r"request 'neg': prompt_tokens\[1\]=-1: outside \[0, 256\)"),
        (("empty", np.zeros(0, dtype=np.int64), g), {}, "request 'empty': prompt is empty"),
        (("params", [1, 2], {"temperature": 0}), {}, "request 'params': params must be SamplingParams, got dict"),
        (("emptyparams", [1, 2], {}), {}, "request 'emptyparams': params must be SamplingParams, got dict"),
        (("none", [1, 2], g), dict(arrival_step=None), "request 'none': arrival_step=None: must be an int >= 0"),
        (("neg", [1, 2], g), dict(arrival_step=-1), "request 'neg': arrival_step=-1: must be an int >= 0"),
        (("true", [1, 2], g), dict(arrival_step=True), "request 'true': arrival_step=True: must be an int >= 0"),
        (("half", [1, 2], g), dict(arrival_step=1.5), "request 'half': arrival_step=1.5: must be an int >= 0"),
    ])
    # What is well formed still goes in: numpy ints (also inside a list), tuples, ranges, tensors.
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    loop.submit("np", np.array([5, 6, 7], dtype=np.int32), greedy, arrival_step=np.int64(1))
    loop.submit("tuple", (np.int64(5), 6, np.uint8(7)), greedy)
    loop.submit("range", range(5, 8), greedy)
    loop.submit("tensor", torch.tensor([5, 6, 7]), greedy)
    done = loop.run()
    assert len({tuple(done[rid].tokens) for rid in ("ok", "np", "tuple", "range", "tensor")}) == 1
    holds_nothing(loop)


def test_a_stop_set_that_covers_the_vocabulary_under_min_tokens_is_refused_at_submit():
    config = LlamaConfig.tiny(vocab_size=32)
    model = LlamaModel.random(config, seed=0, num_slots=2, batch_invariant=True)
    loop = DecodeLoop(model, LoopConfig(seed_base=0, max_num_reqs=2, token_budget=8),
                      engine_config=EngineConfig(device="cpu", max_stop_ids=32))
    others = tuple(t for t in range(32) if t != config.eos_token_id)  # with EOS: every id
    _reject_all(loop, [
        (("all", [2, 3], SamplingParams(min_tokens=1, max_tokens=4, stop_token_ids=others)), {},
         r"request 'all': params.stop_token_ids=\(0, 2, .*, 31\) with EOS cover the whole vocabulary \(32 ids\) while min_tokens=1"),
        # min_tokens holds EOS back even with ignore_eos (as vLLM): no id is left either.
        (("eos", [2, 3], SamplingParams(min_tokens=2, max_tokens=4, ignore_eos=True, stop_token_ids=others)), {},
         r"request 'eos': params.stop_token_ids=.* with EOS cover the whole vocabulary \(32 ids\) while min_tokens=2"),
    ])
    # Without min_tokens something can be sampled.
    loop.submit("free", [2, 3], SamplingParams(max_tokens=4, stop_token_ids=others))
    done = loop.run()
    assert len(done["free"].tokens) == 1 and done["free"].finish_reason == "stop"  # every token stops it


def test_abort_queued_and_running_requests_frees_what_they_hold_and_bystanders_run_on():
    prompts, params = prompts_and_params(5, seed=2)
    prompts[1] = list(range(3, 33))  # a long prompt with prompt logprobs: aborted between its chunks
    params[1] = SamplingParams(temperature=0.7, seed=1, max_tokens=10, prompt_logprobs=1)
    reference, _ = run_loop(prompts, params, drafts=2, token_budget=12, max_num_reqs=4)
    loop = _loop(max_num_reqs=4, token_budget=12, max_draft_tokens=2)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p, arrival_step=40 if i == 4 else 0)
    loop.step()
    assert loop.batch.prompt_logprobs.pending == (1,)  # request 1 is between prompt chunks
    loop.step()
    loop.step()
    free_kv = len(loop.model.kv.slots.free)
    aborted = {1: loop.abort(1), 4: loop.abort(4)}  # running mid-prefill; queued
    assert loop.batch.prompt_logprobs.pending == ()
    assert len(loop.model.kv.slots.free) == free_kv + 1 and len(loop.batch) == 3
    loop.step()
    loop.step()
    aborted[2] = loop.abort(2)  # running mid-decode
    for rid in (1, 2, 4, "nobody"):
        with pytest.raises(ValueError, match=rf"request {rid!r}: (already finished|unknown request_id)"):
            loop.abort(rid)
    with pytest.raises(ValueError, match="request_id=None"):
        loop.abort(None)
    done = loop.run()
    holds_nothing(loop)
    for rid, c in aborted.items():
        assert done[rid] is c and c.finish_reason == "abort" and c.error is None
        assert c.tokens == reference[rid][0][: len(c.tokens)]
    assert aborted[1].tokens == [] and aborted[4].tokens == [] and aborted[2].tokens
    for rid in (0, 3):
        assert completions(done)[rid][1:] == reference[rid]


def test_aborting_the_request_others_wait_on_for_a_shared_prefix_does_not_wedge_them():
    prompts, params = shared_prefix_prompts(4)
    prompts[0] = prompts[2][:24] + [9, 9]  # the donor holds both system prompts' first 12 tokens, and all of 2's
    params[2] = dataclasses.replace(params[2], prompt_logprobs=False)  # (prompt logprobs never share)
    reference, _ = run_loop(prompts, params, token_budget=32, min_shared_prefix=8)
    loop = _loop(token_budget=32, min_shared_prefix=8)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    loop.step()
    donor, *waiters = loop.running
    assert donor.prefilled == len(prompts[0]) and [r.prefilled for r in waiters] == [0, 0, 0]  # they wait for it
    loop.abort(0)
    done = loop.run()
    holds_nothing(loop)
    assert [c[1:] for c in completions(done)[1:]] == reference[1:]


def test_run_jumps_over_idle_steps_to_the_next_arrival():
    prompts, params = prompts_and_params(2)
    reference, _ = run_loop(prompts, params)
    loop = _loop()
    loop.submit(0, prompts[0], params[0], arrival_step=10**9)
    loop.submit(1, prompts[1], params[1], arrival_step=10**9 + 3)
    calls = []
    step = loop.step

    def counted():
        calls.append(loop.stats.steps)
        assert len(calls) < 1000, "run() steps through the idle steps one by one"
        return step()

    loop.step = counted
    done = loop.run()
    assert [c[1:] for c in completions(done)] == reference
    assert calls[0] == 10**9 and loop.stats.steps == 10**9 + len(calls)  # the clock counts the skipped steps


class Boom(Exception):
    pass


class FaultyModel:
    """The tiny model with faults on cue: `fail("before" | "after", exc)` makes the next
    forward raise before it starts or after it wrote the cache and the output rows;
    `poison` holds KV slots whose rows the next forwards fill with NaN."""

    def __init__(self, model: LlamaModel):
        self.model = model
        self.fault: tuple[str, BaseException] | None = None
        self.poison: set[int] = set()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def fail(self, where: str, exc: BaseException) -> None:
        self.fault = (where, exc)

    def _fire(self, where: str) -> None:
        if self.fault is not None and self.fault[0] == where:
            exc, self.fault = self.fault[1], None
            raise exc

    def forward(self, token_ids, positions, batch, out=None):
        self._fire("before")
        hidden = self.model.forward(token_ids, positions, batch, out=out)
        offsets = batch.token_offsets
        for i, slot in enumerate(batch.slots.tolist()):
            if slot in self.poison:
                hidden[offsets[i] : offsets[i + 1]] = float("nan")
        self._fire("after")
        return hidden


class _AskedIds:
    """Stop ids whose every membership test goes through `wrap` (a fault injector)."""

    def __init__(self, ids: tuple[int, ...], wrap) -> None:
        self.ids, self.contains = ids, wrap(ids.__contains__)

    def __contains__(self, token: int) -> bool:
        return self.contains(token)


def atomic_workload():
    """Chunked prefill with prompt logprobs (request 0: 30 tokens at a 12-token budget, so
    its early chunks are not last ones), drafts, shared prefixes, staggered arrivals, and
    fewer KV slots than requests."""
    prompts, params = shared_prefix_prompts(6, seed=5)
    prompts[0] = list(range(3, 33))
    params[0] = SamplingParams(temperature=0.8, seed=7, max_tokens=6, prompt_logprobs=2, logprobs=1)
    params[1] = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2)
    return prompts, params, [0, 0, 1, 3, 4, 9]


def _atomic_loop(model=None) -> DecodeLoop:
    return _loop(num_slots=4, model=model, max_num_reqs=3, token_budget=12, max_draft_tokens=2, min_shared_prefix=8)


def _submit(loop, prompts, params, arrivals) -> None:
    for i, (prompt, p, arrival) in enumerate(zip(prompts, params, arrivals)):
        loop.submit(i, prompt, p, arrival_step=arrival)


FAULTS = ["forward before", "forward after", "interrupt after forward", "engine before", "engine after",
          "stop check", "commit"]


@functools.cache
def atomic_reference() -> tuple[list, dict, int]:
    """The uninterrupted run: completions, loop counters, engine steps."""
    clean = _atomic_loop()
    _submit(clean, *atomic_workload())
    return completions(clean.run()), counters(clean.stats), clean.engine.stats.steps


@pytest.mark.parametrize("fault", FAULTS)
def test_a_step_that_raises_leaves_no_trace_and_the_run_ends_as_if_it_never_happened(fault):
    prompts, params, arrivals = atomic_workload()
    model = FaultyModel(tiny_model(4))
    loop = _atomic_loop(model)
    _submit(loop, prompts, params, arrivals)
    exc = KeyboardInterrupt() if fault.startswith("interrupt") else Boom(fault)
    armed = []

    def one_shot(target):
        def wrapped(*args, **kwargs):
            if armed and armed[0] == "before":
                armed.clear()
                raise exc
            result = target(*args, **kwargs)
            if armed and armed[0] == "after":
                armed.clear()
                raise exc
            return result
        return wrapped

    if fault.startswith("engine"):
        loop.engine.run = one_shot(loop.engine.run)
    elif fault == "stop check":  # the model's stop ids, asked after each emitted token
        model.stop_token_ids = _AskedIds(model.model.stop_token_ids, one_shot)
    elif fault == "commit":
        loop.batch.record = one_shot(loop.batch.record)

    def arm() -> bool:
        """Arm the fault unless it is still armed (a step without tokens never reaches the stop check)."""
        if model.fault is not None or armed:
            return False
        if "forward" in fault:
            model.fail("before" if "before" in fault else "after", exc)
        else:
            armed[:] = ["before" if fault.endswith("before") else "after"]
        return True

    # Clock steps 1 and 2 admit requests, 9 and 13 admit them into retained caches' slots.
    targets, failures, arms = [1, 2, 4, 9, 13], 0, 0
    while loop.has_work() and loop.stats.steps < 40:
        if targets and loop.stats.steps == targets[0]:
            arms += arm()
            targets.pop(0)
        failures += failed_without_trace(loop, (Boom, KeyboardInterrupt))
    assert failures == arms >= 4
    done = loop.run()
    assert (completions(done), counters(loop.stats), loop.engine.stats.steps) == atomic_reference()
    holds_nothing(loop)


def test_a_failed_row_finishes_its_request_with_an_error_and_frees_what_it_held():
    prompts, params = prompts_and_params(4, seed=3)
    reference, _ = run_loop(prompts, params, drafts=2, token_budget=32, max_num_reqs=4)
    loop = _loop(max_num_reqs=4, max_draft_tokens=2)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    run = loop.engine.run

    def fails_request_2_at_step_3(hidden, inputs, arrays, **kwargs):
        out = run(hidden, inputs, arrays, **kwargs)
        if loop.stats.steps == 3:
            i = out.request_ids.index(2)
            out.errors[i] = "request 2: non-finite logits"
            out.tokens[i] = []
            out.logprobs[i] = [] if out.logprobs[i] is not None else None
        return out

    loop.engine.run = fails_request_2_at_step_3
    events = [loop.step() for _ in range(4)]
    assert [e for e in events[3] if e.request_id == 2] == [StepEvent(2, [], True)]
    failed = loop.finished[2]
    assert failed.finish_reason == "error" and failed.error == "request 2: non-finite logits"
    assert failed.tokens == reference[2][0][: len(failed.tokens)] and len(failed.tokens) >= 2
    assert len(loop.batch) == 3 and len(loop.model.kv.slots.free) == 5
    done = loop.run()
    holds_nothing(loop)
    assert [completions(done)[i][1:] for i in (0, 1, 3)] == [reference[i] for i in (0, 1, 3)]



def test_a_retained_cache_that_a_failed_step_wrote_over_keeps_only_what_it_still_holds():
    """A failed step hands a retained cache's slot to a new request, whose forward writes
    its own prompt there before the step raises. Rolled back, the cache must not claim
    positions it lost: a later request sharing its prefix would copy the wrong keys."""
    rng = np.random.default_rng(8)
    donor_prompt = rng.integers(3, V, 24).tolist()
    later = donor_prompt + [7, 8]
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=4, logprobs=1)
    weights = random_weights(CONFIG, seed=0)
    weights.embed = weights.embed * 0.05  # flat logits: every logprob moves with any change to a hidden state
    alone = _loop(model=LlamaModel(CONFIG, weights, num_slots=1, batch_invariant=True), max_num_reqs=1,
                  min_shared_prefix=8)
    alone.submit("later", later, sampled)
    reference = completions(alone.run())

    model = FaultyModel(LlamaModel(CONFIG, weights, num_slots=2, batch_invariant=True))
    loop = _loop(model=model, max_num_reqs=2, min_shared_prefix=8)
    loop.submit("donor", donor_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    loop.submit("long", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    loop.step()
    donor_slot, = loop.retained  # the donor finished; "long" holds the other slot
    loop.submit("new", [(donor_prompt[0] + 1) % V, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=2))
    model.fail("after", Boom("after the new request's prompt was written"))
    with pytest.raises(Boom):
        loop.step()  # "new" took the donor's slot, wrote position 0 on, then the step failed
    assert list(loop.retained) == [donor_slot] and len(loop.retained[donor_slot]) == 0
    loop.abort("new")
    loop.abort("long")  # a free slot: "later" is admitted there and may copy from the donor
    loop.submit("later", later, sampled)
    done = loop.run()
    assert completions({"later": done["later"]}) == reference
    assert loop.stats.shared_prefix_tokens == 0  # the donor lost its first positions: nothing to share


def test_a_nan_hidden_row_fails_only_its_request():
    prompts, params = prompts_and_params(4, seed=4)
    reference, _ = run_loop(prompts, params, token_budget=32, max_num_reqs=4)
    model = FaultyModel(tiny_model())
    loop = _loop(model=model, max_num_reqs=4)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        loop.submit(i, prompt, p)
    loop.step()
    loop.step()
    model.poison = {next(r.kv_slot for r in loop.running if r.request_id == 1)}
    loop.step()
    model.poison = set()
    assert loop.finished[1].finish_reason == "error" and "request 1" in loop.finished[1].error
    done = loop.run()
    holds_nothing(loop)
    assert [completions(done)[i][1:] for i in (0, 2, 3)] == [reference[i] for i in (0, 2, 3)]
    assert done[1].tokens == reference[1][0][: len(done[1].tokens)]
