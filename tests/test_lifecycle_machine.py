"""Random call orders against the request lifecycle (issue 25): a hypothesis
`RuleBasedStateMachine` drives `PersistentBatch` (add, step, remove, finish, reused ids,
rollback, stale prepared steps, bad prompts and counts) and another the `step()` front
(step, finish, reused ids, eviction pressure, bad prompts), each against a plain model:
after every call nothing is leaked (rows, control slots, prompt logprobs) and every
request's tokens equal a fresh engine's run of that request alone, step for step.

100 sequences per machine in CI (200 in all); ENGINE_LONG_TESTS=1 runs 1000 each."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import EngineConfig, SamplingParams, SeqMeta, StepEngine
from engine.step.batch import PersistentBatch

V, H, EOS = 48, 8, 1
IDS = ("a", "b", "c", "d", "e")
PARAMS = (
    SamplingParams(temperature=0.9, seed=11),
    SamplingParams(temperature=0.8, seed=12, presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.4),
    SamplingParams(temperature=0.7, seed=13, logit_bias={2: 5.0, 3: -3.0}, prompt_logprobs=1),
    SamplingParams(temperature=0.0, prompt_logprobs=True, presence_penalty=0.5),
)
LONG = os.environ.get("ENGINE_LONG_TESTS") == "1"
EXAMPLES, STEPS = (1000, 16) if LONG else (100, 8)
EMBED = torch.randn(V, H, generator=torch.Generator().manual_seed(3))
PLACE = torch.randn(96, H, generator=torch.Generator().manual_seed(4))
WEIGHT = torch.randn(V, H, generator=torch.Generator().manual_seed(0))


def engine(**config) -> StepEngine:
    base = dict(max_num_reqs=2, max_draft_tokens=0, max_control_slots=3, device="cpu", use_graphs=False,
                eos_token_id=EOS, seed_base=7)
    base.update(config)
    return StepEngine(WEIGHT, EngineConfig(**base))


def hidden(tokens: list[int], start: int) -> torch.Tensor:
    """[len(tokens), H]: a made-up model's rows, a function of each token and its position only."""
    return EMBED[torch.tensor(tokens)] + PLACE[torch.arange(start, start + len(tokens))]


@dataclass
class Request:
    """The plain model of one request: its prompt, parameters, the chunks it ran and its tokens."""

    prompt: list[int]
    params: SamplingParams
    chunks: list[int] = field(default_factory=list)  # the prompt end of each prefill chunk it ran
    output: list[int] = field(default_factory=list)

    @property
    def prefilled(self) -> int:
        return self.chunks[-1] if self.chunks else 0

    def next_step(self, chunk: int) -> tuple[bool, int, int, torch.Tensor]:
        """(is_prompt, seqlen_q, seqlen_k, hidden rows) of its next step: a prefill chunk of
        at most `chunk` tokens, or one decode token."""
        if self.prefilled < len(self.prompt):
            end = min(len(self.prompt), self.prefilled + chunk)
            return True, end - self.prefilled, end, hidden(self.prompt[self.prefilled:end], self.prefilled)
        k = len(self.prompt) + len(self.output)
        return False, 1, k, hidden([self.output[-1]], k - 1)

    def seq(self, request_id: str, chunk: int) -> tuple[SeqMeta, torch.Tensor]:
        is_prompt, q, k, h = self.next_step(chunk)
        return SeqMeta(request_id, is_prompt, q, k, len(self.prompt), self.prompt, len(self.output), self.params), h

    def advance(self, is_prompt: bool, seqlen_k: int, tokens: list[int]) -> None:
        if is_prompt:
            self.chunks.append(seqlen_k)
        self.output.extend(tokens)


def alone(request_id: str, r: Request) -> list[int]:
    """The request's tokens run alone, with the same chunks, through a fresh engine's step()."""
    return list(_alone(request_id, tuple(r.prompt), PARAMS.index(r.params), tuple(r.chunks), len(r.output)))


@functools.lru_cache(maxsize=4096)  # hypothesis replays a request's history often: run it once
def _alone(request_id: str, prompt: tuple, which: int, chunks: tuple, num_tokens: int) -> tuple:
    r = Request(list(prompt), PARAMS[which], list(chunks), [None] * num_tokens)
    e, fresh = engine(), Request(r.prompt, r.params)
    for end in r.chunks:
        out = e.step(hidden(r.prompt[fresh.prefilled:end], fresh.prefilled),
                     [SeqMeta(request_id, True, end - fresh.prefilled, end, len(r.prompt), r.prompt, 0, r.params)])
        fresh.advance(True, end, out.tokens[0])
    while len(fresh.output) < len(r.output):
        s, h = fresh.seq(request_id, 1)
        fresh.advance(False, s.seqlen_k, e.step(h, [s]).tokens[0])
    return tuple(fresh.output[:num_tokens])


ids = st.sampled_from(IDS)
prompts = st.lists(st.integers(2, V - 1), min_size=1, max_size=6)
bad_prompts = st.sampled_from([[3, V + 2], [[3, 4]], {3: 4}, [3, 2.5], [], "ab"])
params = st.sampled_from(PARAMS)


class Lifecycle(RuleBasedStateMachine):
    """What both machines share: the live requests, the tokens check, the leak check."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, Request] = {}

    def holders(self) -> int:
        return sum(1 for r in self.live.values() if r.params.has_penalties or r.params.logit_bias)

    def check_alone(self, request_id: str) -> None:
        r = self.live[request_id]
        assert r.output == alone(request_id, r), request_id

    def teardown(self) -> None:
        for request_id in self.live:
            self.check_alone(request_id)


class BatchMachine(Lifecycle):
    """`PersistentBatch` + `engine.run` under any order of calls."""

    def __init__(self) -> None:
        super().__init__()
        self.e = engine()
        self.batch = PersistentBatch(self.e, capacity=3)

    def prepared(self, chosen: list[str], chunk: int):
        steps = [self.live[rid].next_step(chunk) for rid in chosen]
        prepared = self.batch.prepare(chosen, [q for _, q, _, _ in steps], [k for _, _, k, _ in steps])
        return prepared, steps

    @rule(request_id=ids, prompt=prompts, p=params)
    def add(self, request_id, prompt, p):
        if request_id in self.live or len(self.live) == 3 or (self.holders() == 3 and p in PARAMS[1:3]):
            with pytest.raises((ValueError, RuntimeError)):
                self.batch.add(request_id, prompt, p)
            return
        self.batch.add(request_id, prompt, p)
        self.live[request_id] = Request(prompt, p)

    @rule(request_id=ids, prompt=bad_prompts, p=params)
    def add_a_bad_prompt(self, request_id, prompt, p):
        with pytest.raises(ValueError, match=rf"request {request_id!r}: prompt"):
            self.batch.add(request_id, prompt, p)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 4))
    def step(self, data, chunk, including=None):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        if including is not None and including not in chosen:
            chosen.append(including)
        prepared, steps = self.prepared(chosen, chunk)
        out = self.e.run(torch.cat([h for *_, h in steps]), prepared.inputs, prepared.arrays)
        self.batch.record(prepared, out)
        for rid, (is_prompt, _, k, _), tokens in zip(chosen, steps, out.tokens):
            self.live[rid].advance(is_prompt, k, tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 4))
    def step_then_roll_back(self, data, chunk):
        """A caller whose own code failed after run and record undoes the step."""
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        mark = self.e.checkpoint()
        generated = [len(self.live[rid].output) for rid in chosen]
        prepared, steps = self.prepared(chosen, chunk)
        out = self.e.run(torch.cat([h for *_, h in steps]), prepared.inputs, prepared.arrays)
        self.batch.record(prepared, out)
        self.e.rollback(mark)
        self.batch.set_generated(prepared.rows, np.array(generated, np.int32))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), change=st.sampled_from(["remove", "finish", "record another", "reuse"]))
    def a_stale_step_is_refused(self, data, change):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        prepared, steps = self.prepared(chosen, 2)
        victim = chosen[0]
        if change == "record another":
            # Another step over one of this step's requests (a step over other rows leaves it valid).
            self.step(data, 2, including=chosen[0])
            victim = None  # whichever changed
        else:
            getattr(self.batch, "finish" if change == "finish" else "remove")(victim)
            del self.live[victim]
            if change == "reuse":
                self.add(victim, [5, 6], PARAMS[1])
        counts = None if self.e.controls is None else self.e.controls.counts.clone()
        with pytest.raises(ValueError, match=r"stale step" if victim is None else rf"request {victim!r}: stale step"):
            self.e.run(torch.cat([h for *_, h in steps]), prepared.inputs, prepared.arrays)
        assert torch.equal(self.e.controls.counts, counts)

    @precondition(lambda self: len(self.live) >= 2)
    @rule(data=st.data())
    def a_step_over_other_rows_leaves_a_prepared_step_valid(self, data):
        """Prepare over some requests, run and record a step over the others, then run
        and record the first: its requests did not change, so it is not stale."""
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=len(self.live) - 1,
                                    unique=True))
        prepared, steps = self.prepared(chosen, 2)
        others = [rid for rid in sorted(self.live) if rid not in chosen]
        between, between_steps = self.prepared(others, 1)
        out = self.e.run(torch.cat([h for *_, h in between_steps]), between.inputs, between.arrays)
        self.batch.record(between, out)
        for rid, (is_prompt, _, k, _), tokens in zip(others, between_steps, out.tokens):
            self.live[rid].advance(is_prompt, k, tokens)
        out = self.e.run(torch.cat([h for *_, h in steps]), prepared.inputs, prepared.arrays)
        self.batch.record(prepared, out)
        for rid, (is_prompt, _, k, _), tokens in zip(chosen, steps, out.tokens):
            self.live[rid].advance(is_prompt, k, tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def a_count_past_int32_is_refused(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        with pytest.raises(ValueError, match=rf"request {request_id!r}: seqlen_q=4294967297"):
            self.batch.prepare([request_id], np.array([2**32 + 1]), np.array([1]))

    @rule(request_id=ids, how=st.sampled_from(["remove", "finish"]))
    def remove(self, request_id, how):
        if request_id not in self.live:
            with pytest.raises(ValueError, match=rf"request {request_id!r}: not in the table"):
                getattr(self.batch, how)(request_id)
            return
        self.check_alone(request_id)
        getattr(self.batch, how)(request_id)
        del self.live[request_id]

    @invariant()
    def nothing_leaks(self):
        table = self.batch.table
        assert set(table.row_of) == set(self.live) and int(table.occupied.sum()) == len(self.live)
        assert self.e.controls.free_slots == 3 - self.holders()
        assert set(self.e.prompt_logprobs.pending) <= set(self.live)
        assert (table.stop_ids[~table.occupied] == -1).all() and not table.control_slot[~table.occupied].any()


class FrontMachine(Lifecycle):
    """`StepEngine.step(hidden, seqs)` and `finish` under any order of calls."""

    def __init__(self) -> None:
        super().__init__()
        self.e = engine()  # the front's table: 4 rows

    def stateful(self) -> set[str]:
        return {rid for rid, r in self.live.items() if r.params.has_penalties or r.params.logit_bias
                or rid in self.e.prompt_logprobs.pending}

    @rule(request_id=ids, prompt=prompts, p=params)
    def start(self, request_id, prompt, p):
        """A new request (under a reused id, too: its first chunk starts it afresh)."""
        if len(self.stateful() | {request_id}) > self.e.seq_front.table.capacity or (
                len(self.stateful() - {request_id}) == 3 and (p.has_penalties or p.logit_bias)):
            return  # more than the table or the control slots hold: covered by `step`'s refusal
        r = Request(prompt, p)
        s, h = r.seq(request_id, 2)
        r.advance(True, s.seqlen_k, self.e.step(h, [s]).tokens[0])
        self.live[request_id] = r

    @rule(request_id=ids, prompt=bad_prompts)
    def start_with_a_bad_prompt(self, request_id, prompt):
        free, held = self.e.controls.free_slots, dict(self.e.seq_front.table.row_of)
        with pytest.raises(ValueError, match=rf"request {request_id!r}: prompt|^request_id"):
            self.e.step(hidden([3], 0), [SeqMeta(request_id, True, 1, 1, 1, prompt, params=PARAMS[1])])
        assert self.e.controls.free_slots == free and dict(self.e.seq_front.table.row_of) == held

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 4))
    def step(self, data, chunk):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        pairs = [self.live[rid].seq(rid, chunk) for rid in chosen]
        out = self.e.step(torch.cat([h for _, h in pairs]), [s for s, _ in pairs])
        for rid, (s, _), tokens in zip(chosen, pairs, out.tokens):
            self.live[rid].advance(s.is_prompt, s.seqlen_k, tokens)

    @rule(count=st.integers(3, 5))
    def new_ids_crowd_in(self, count):
        """Requests that hold no state, each named once: they never push out a live one."""
        seqs = [SeqMeta(f"x{i}", True, 1, 1, 1, [4 + i], params=PARAMS[0]) for i in range(count)]
        capacity, kept = self.e.seq_front.table.capacity, len(self.stateful())
        # Past the table's rows it grows only while no request holds state; else the crowd
        # and the requests that hold state must fit together.
        if (count > capacity and kept) or (count <= capacity and count + kept > capacity):
            with pytest.raises(ValueError, match=r"request table"):
                self.e.step(hidden([4 + i for i in range(count)], 0), seqs)
            return
        self.e.step(torch.cat([hidden([4 + i], 0) for i in range(count)]), seqs)

    @rule(request_id=ids)
    def finish(self, request_id):
        if request_id in self.live:
            self.check_alone(request_id)
            del self.live[request_id]
        self.e.finish(request_id)

    @invariant()
    def nothing_leaks(self):
        table = self.e.seq_front.table
        holders = sum(1 for r in self.live.values() if r.params.has_penalties or r.params.logit_bias)
        assert self.e.controls.free_slots == 3 - holders
        assert set(self.e.prompt_logprobs.pending) <= set(self.live)
        assert self.stateful() <= set(table.row_of)  # a live request with state is never dropped
        assert (table.stop_ids[~table.occupied] == -1).all() and not table.control_slot[~table.occupied].any()


SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                    suppress_health_check=list(HealthCheck))
TestBatchLifecycle = BatchMachine.TestCase
TestBatchLifecycle.settings = SETTINGS
TestFrontLifecycle = FrontMachine.TestCase
TestFrontLifecycle.settings = SETTINGS
