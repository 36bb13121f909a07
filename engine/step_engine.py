"""StepEngine: one step of the tail, top to bottom.

    step(hidden, seqs)
      -> ledger         which rows, positions, parameters (host, numpy)
      -> validate       everything, before any buffer is touched
      -> stage + copy   one packed host-to-device copy into the static buffers
      -> replay         the bucket's captured graph: gather -> logits -> sample
      -> output copy    truncated to the real rows, copied out before the next replay
      -> exact rows     rows whose kept set reached past the candidates (eager)
      -> prompt logprobs  chunked, eager, outside the graph
      -> StepOutput

`EngineConfig(use_graphs=False)` runs the same step function over the same
static buffers without a graph; a step with more requests than the largest
bucket runs eagerly on tensors of its own size. With `batch_invariant=True`
(the default) all three give identical tokens: the LM head runs in fixed row
blocks and the sampler's arithmetic is per row.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, NamedTuple, Sequence

import numpy as np
import torch

from engine.ledger import SamplerInputs, prepare_sampler_inputs
from engine.ops import DEFAULT_BLOCK_ROWS, gather, get_logits
from engine.params import SeqMeta
from engine.prompt_logprobs import DEFAULT_CHUNK_ROWS, PromptLogprob, PromptLogprobAccumulator, compute_prompt_logprobs
from engine.sampler import RowParams, SampleOutput, SamplerConfig, sample, sample_exact
from graphs.buckets import BucketTable
from graphs.replay import CaptureReport, GraphReplayer
from graphs.static_buffers import StepBuffers
from profiling.ranges import stage


class TokenLogprob(NamedTuple):
    """Logprob of one emitted token: its value, its rank, and the top-N alternatives."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class EngineConfig:
    max_num_reqs: int = 64
    max_draft_tokens: int = 0
    buckets: tuple[int, ...] | None = None  # None: the default rule of graphs/buckets.py
    device: str = "auto"  # "auto": cuda when available, else cpu
    use_graphs: bool = True
    max_source_rows: int = 8192  # rows of the static hidden-state source
    source_dtype: torch.dtype | None = None  # None: the LM-head weight's dtype
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    batch_invariant: bool = True  # LM head in fixed row blocks: tokens independent of the bucket
    logits_block_rows: int = DEFAULT_BLOCK_ROWS
    eos_token_id: int | None = None
    max_stop_ids: int = 8  # EOS plus stop_token_ids per request, for min_tokens suppression
    prompt_logprobs_chunk_rows: int = DEFAULT_CHUNK_ROWS
    compaction_keep_tokens: int | None = None
    seed_base: int = 0  # salts the seeds of requests that bring none
    check_addresses_each_replay: bool = False  # debug: verify static addresses before every replay

    def __post_init__(self) -> None:
        def positive(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"EngineConfig.{name}={value!r}: must be an int >= {minimum}")

        for name in ("max_num_reqs", "max_source_rows", "logits_block_rows", "max_stop_ids", "prompt_logprobs_chunk_rows"):
            positive(name)
        positive("max_draft_tokens", 0)
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as err:
                raise ValueError(f"EngineConfig.device={self.device!r}: {err}") from None
        if self.eos_token_id is not None and (isinstance(self.eos_token_id, bool) or not isinstance(self.eos_token_id, int) or self.eos_token_id < 0):
            raise ValueError(f"EngineConfig.eos_token_id={self.eos_token_id!r}: must be None or an int >= 0")
        if self.compaction_keep_tokens is not None:
            positive("compaction_keep_tokens")
        if not isinstance(self.sampler, SamplerConfig):
            raise ValueError(f"EngineConfig.sampler={self.sampler!r}: must be a SamplerConfig")
        BucketTable(self.max_num_reqs, self.buckets)  # raises naming the bad bucket

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class StepOutput:
    """Per request, in batch order."""

    request_ids: tuple[Hashable, ...]
    tokens: list[list[int]]  # emitted this step; empty for a non-last prefill chunk
    logprobs: list[list[TokenLogprob] | None]  # one per emitted token, None when not requested
    prompt_logprobs: list[list[PromptLogprob] | None]  # SPEC §1.1: None / [] / the full list
    seeds: list[int]  # the seed each request sampled with
    num_accepted: list[int]  # drafts accepted per request (0 without drafts)
    bucket: int | None  # graph bucket used, None for an eager fallback
    replayed: bool  # True when a captured graph ran


@dataclass
class EngineStats:
    steps: int = 0
    replays: int = 0
    eager_steps: int = 0  # use_graphs=False
    eager_fallbacks: int = 0  # above the largest bucket
    source_copies: int = 0  # steps whose hidden states were copied into the static source
    exact_rows: int = 0  # rows redone over the full vocabulary
    bucket_histogram: dict[int, int] = field(default_factory=dict)
    host_seconds: float = 0.0  # ledger + validation + staging, summed


class StepEngine:
    """The captured tail of an inference step (SPEC §4, §6)."""

    def __init__(self, lm_head_weight: torch.Tensor, config: EngineConfig | None = None):
        config = config or EngineConfig()
        if lm_head_weight.dim() != 2:
            raise ValueError(f"lm_head_weight: shape {tuple(lm_head_weight.shape)} is not [vocab, hidden]")
        self.config = config
        self.device = config.resolved_device()
        if lm_head_weight.device.type != self.device.type:
            raise ValueError(
                f"lm_head_weight is on {lm_head_weight.device} but the engine runs on {self.device}: "
                "move the weight or set EngineConfig.device"
            )
        self.weight = lm_head_weight
        self.vocab_size, self.hidden_size = lm_head_weight.shape
        if config.eos_token_id is not None and config.eos_token_id >= self.vocab_size:
            raise ValueError(f"EngineConfig.eos_token_id={config.eos_token_id}: outside the vocabulary ({self.vocab_size})")
        self.buckets = BucketTable(config.max_num_reqs, config.buckets)
        max_rows = config.max_num_reqs * (1 + config.max_draft_tokens)
        if config.max_source_rows < max_rows:
            raise ValueError(
                f"EngineConfig.max_source_rows={config.max_source_rows}: must hold at least one step's "
                f"sample rows, max_num_reqs * (1 + max_draft_tokens) = {max_rows}"
            )
        self.buffers = StepBuffers.allocate(
            max_reqs=config.max_num_reqs,
            max_draft_tokens=config.max_draft_tokens,
            max_source_rows=config.max_source_rows,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            max_logprobs=config.sampler.max_logprobs,
            max_stop_ids=config.max_stop_ids,
            source_dtype=config.source_dtype or lm_head_weight.dtype,
            device=self.device,
        )
        self.replayer = GraphReplayer(
            self._device_step,
            self.buckets,
            self.buffers.static_tensors(),
            self.device,
            check_addresses_each_replay=config.check_addresses_each_replay,
        )
        self.prompt_logprobs = PromptLogprobAccumulator()
        self.stats = EngineStats()

    # -- the hidden-state source ------------------------------------------------

    @property
    def source(self) -> torch.Tensor:
        """[max_source_rows, H]: a model that writes its last-layer rows here
        (batch order, from row 0) makes `step(engine.source, seqs)` zero-copy."""
        return self.buffers.source

    def _is_source(self, hidden: torch.Tensor) -> bool:
        src = self.buffers.source
        return (
            hidden.data_ptr() == src.data_ptr()
            and hidden.stride() == src.stride()
            and hidden.dtype == src.dtype
            and hidden.device == src.device
        )

    # -- capture ------------------------------------------------------------------

    def capture(self, progress: bool = False) -> CaptureReport:
        """Capture one graph per bucket (largest first); on CPU, run each once
        under the capture safety check. Reports buckets, seconds, pool bytes."""
        return self.replayer.capture(progress=progress)

    def _device_step(self, bucket: int) -> None:
        """The captured part: reads and writes only the static buffers."""
        b = self.buffers
        rows = b.rows_for(bucket)
        gather(b.source, b.fields["sample_rows"][:rows], out=b.hidden[:rows])
        get_logits(
            b.hidden[:rows],
            self.weight,
            out=b.logits[:rows],
            batch_invariant=self.config.batch_invariant,
            block_rows=self.config.logits_block_rows,
        )
        sample(b.logits[:rows], b.params(bucket), self.config.sampler, out=b.outputs(rows))

    # -- one step -----------------------------------------------------------------

    def stop_id_matrix(self, seqs: Sequence[SeqMeta]) -> np.ndarray:
        """[n, max_stop_ids] int64: EOS (unless ignore_eos) and stop ids, -1 padded."""
        width = self.config.max_stop_ids
        matrix = np.full((len(seqs), width), -1, dtype=np.int64)
        eos = self.config.eos_token_id
        for i, seq in enumerate(seqs):
            ids = list(seq.params.stop_token_ids)
            if eos is not None and not seq.params.ignore_eos:
                ids.insert(0, eos)
            if not ids:
                continue
            if len(ids) > width:
                raise ValueError(
                    f"request {seq.request_id!r}: params.stop_token_ids: {len(ids)} stop ids (with EOS) "
                    f"but EngineConfig.max_stop_ids={width}"
                )
            if max(ids) >= self.vocab_size:
                raise ValueError(
                    f"request {seq.request_id!r}: params.stop_token_ids={seq.params.stop_token_ids}: "
                    f"outside the vocabulary ({self.vocab_size})"
                )
            matrix[i, : len(ids)] = ids
        return matrix

    def step(
        self,
        hidden_states: torch.Tensor,
        seqs: Sequence[SeqMeta],
        draft_tokens: Sequence[Sequence[int] | None] | None = None,
    ) -> StepOutput:
        """Sample the step of `seqs` from `hidden_states` ([rows, H], batch order).

        `draft_tokens[i]`: the `seqlen_q - 1` draft tokens a decode request
        verifies this step (its query tokens after the first), None otherwise."""
        start = time.perf_counter()
        with stage("ledger"):
            inputs = prepare_sampler_inputs(
                seqs,
                max_draft_tokens=self.config.max_draft_tokens,
                compaction_keep_tokens=self.config.compaction_keep_tokens,
                seed_base=self.config.seed_base,
            )
            stop_ids = self.stop_id_matrix(seqs)
            row_drafts = self.row_drafts(inputs, draft_tokens)
        return self.run(hidden_states, inputs, stop_ids, row_drafts, host_start=start)

    def row_drafts(self, inputs: SamplerInputs, draft_tokens: Sequence[Sequence[int] | None] | None) -> np.ndarray:
        """[sample rows] int64: the draft each sample row is asked to predict
        (row j of a decode request verifies its draft j), -1 where none."""
        rows = np.full(inputs.num_sample_rows, -1, dtype=np.int64)
        drafts_per_req = np.where(inputs.is_prompt, 0, inputs.sample_counts - 1)
        if draft_tokens is None:
            if drafts_per_req.any():
                i = int(np.flatnonzero(drafts_per_req)[0])
                raise ValueError(
                    f"request {inputs.request_ids[i]!r}: seqlen_q={int(inputs.sample_counts[i])} verifies "
                    f"{int(drafts_per_req[i])} drafts but draft_tokens is None"
                )
            return rows
        if len(draft_tokens) != inputs.num_reqs:
            raise ValueError(f"draft_tokens: {len(draft_tokens)} entries for {inputs.num_reqs} requests")
        for i, drafts in enumerate(draft_tokens):
            count = 0 if drafts is None else len(drafts)
            if count != drafts_per_req[i]:
                raise ValueError(
                    f"request {inputs.request_ids[i]!r}: draft_tokens has {count} tokens but the request "
                    f"verifies {int(drafts_per_req[i])} this step (seqlen_q - 1 for a decode)"
                )
            if count:
                values = np.asarray(drafts, dtype=np.int64)
                if values.min() < 0 or values.max() >= self.vocab_size:
                    raise ValueError(
                        f"request {inputs.request_ids[i]!r}: draft_tokens={list(drafts)}: outside the "
                        f"vocabulary [0, {self.vocab_size})"
                    )
                lo = int(inputs.sample_offsets[i])
                rows[lo : lo + count] = values
        return rows

    def _validate(self, hidden: torch.Tensor, inputs: SamplerInputs) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states: shape {tuple(hidden.shape)}, expected [rows, {self.hidden_size}]")
        if hidden.device.type != self.device.type:
            raise ValueError(f"hidden_states: on {hidden.device}, the engine runs on {self.device}")
        if not self._is_source(hidden) and hidden.shape[0] < inputs.num_output_rows:
            raise ValueError(
                f"hidden_states: {hidden.shape[0]} rows, but the batch's ledger needs {inputs.num_output_rows} "
                f"(requests {list(inputs.request_ids)[:4]}{'...' if inputs.num_reqs > 4 else ''})"
            )
        if self._is_source(hidden) and inputs.num_output_rows > hidden.shape[0]:
            raise ValueError(
                f"the batch needs {inputs.num_output_rows} output rows but the static source holds "
                f"{hidden.shape[0]}: raise EngineConfig.max_source_rows"
            )
        targets = inputs.prompt_token_targets
        if targets is not None and len(targets) and targets.max() >= self.vocab_size:
            bad = int(np.flatnonzero(targets >= self.vocab_size)[0])
            req = int(np.searchsorted(np.cumsum(inputs.prompt_row_counts), bad, side="right"))
            raise ValueError(
                f"request {inputs.request_ids[req]!r}: prompt_tokens: token {int(targets[bad])} "
                f"is outside the vocabulary ({self.vocab_size})"
            )
        top_n = int(inputs.num_logprobs.max(initial=-1))
        if top_n > self.config.sampler.max_logprobs:
            req = int(np.argmax(inputs.num_logprobs))
            raise ValueError(
                f"request {inputs.request_ids[req]!r}: params.logprobs={top_n}: more than "
                f"SamplerConfig.max_logprobs={self.config.sampler.max_logprobs}"
            )

    def run(
        self,
        hidden_states: torch.Tensor,
        inputs: SamplerInputs,
        stop_ids: np.ndarray,
        row_drafts: np.ndarray | None = None,
        *,
        host_start: float | None = None,
    ) -> StepOutput:
        """The step from a prepared ledger (the decode loop's path: it builds
        `inputs` from its request table). Validates before touching anything."""
        host_start = time.perf_counter() if host_start is None else host_start
        bucket = self.stage_step(hidden_states, inputs, stop_ids)
        n = inputs.num_reqs
        if bucket is None:
            if n:
                self.replayer.record_eager_fallback(n)
            result = self._eager_fallback(hidden_states, inputs, stop_ids)
            self.stats.eager_fallbacks += 1
            replayed = False
        else:
            self.stats.host_seconds += time.perf_counter() - host_start
            replayed = self.config.use_graphs and self.replayer.captured
            with stage("replay" if replayed else "eager step"):
                if replayed:
                    self.replayer.replay(bucket)
                    self.stats.replays += 1
                else:
                    self.replayer.run_eager(bucket)
                    self.stats.eager_steps += 1
            rows, capacity = inputs.num_sample_rows, self.buffers.rows_for(bucket)
            with stage("exact rows"):
                self._redo_exact_rows(
                    self.buffers.logits[:capacity], self.buffers.params(bucket), self.buffers.outputs(capacity), rows
                )
            with stage("output copy"):
                # The next replay overwrites the static outputs: copy them out now.
                result = _host_results(self.buffers.outputs(rows), want_top=bool((inputs.num_logprobs > 0).any()))
            self.stats.bucket_histogram[bucket] = self.stats.bucket_histogram.get(bucket, 0) + 1
        self.stats.steps += 1

        with stage("prompt logprobs"):
            prompt_lp = self._prompt_logprobs(hidden_states, inputs)
        return self._assemble(inputs, result, row_drafts, prompt_lp, bucket, replayed)

    def stage_step(self, hidden_states: torch.Tensor, inputs: SamplerInputs, stop_ids: np.ndarray) -> int | None:
        """The host part of a step: validate everything, pick the bucket, stage
        the per-step arrays and issue the one host-to-device copy. Returns the
        bucket, or None when the step is above the largest bucket (eager)."""
        self._validate(hidden_states, inputs)
        bucket = self.buckets.bucket_for(inputs.num_reqs) if inputs.num_reqs else None
        if bucket is None:
            return None
        sample_rows = inputs.selected_token_indices
        with stage("staging copy"):
            if not self._is_source(hidden_states):
                # Not zero-copy: bring only the sample rows into the static
                # source and point the gather at them.
                index = torch.as_tensor(sample_rows, device=hidden_states.device, dtype=torch.int64)
                self.buffers.source[: len(sample_rows)].copy_(hidden_states[index])
                sample_rows = np.arange(len(sample_rows), dtype=np.int64)
                self.stats.source_copies += 1
            self.buffers.load(
                bucket=bucket,
                sample_rows=sample_rows,
                row_to_req=inputs.row_to_req,
                local_step=inputs.local_step,
                suppress_rows=inputs.eos_suppression_rows,
                temperature=inputs.temperatures,
                top_k=inputs.top_ks,
                top_p=inputs.top_ps,
                min_p=inputs.min_ps,
                seed=inputs.seeds,
                sample_position=inputs.sample_positions,
                stop_ids=stop_ids,
            )
        return bucket

    def _redo_exact_rows(self, logits: torch.Tensor, params: RowParams, out: SampleOutput, real_rows: int) -> None:
        flags = out.needs_exact[:real_rows].cpu()
        if bool(flags.any()):
            index = torch.nonzero(flags).flatten()
            sample_exact(logits, params, self.config.sampler, index, out)
            self.stats.exact_rows += len(index)

    def _eager_fallback(self, hidden: torch.Tensor, inputs: SamplerInputs, stop_ids: np.ndarray) -> dict[str, np.ndarray]:
        """A step larger than every bucket: the same ops on tensors of its own size."""
        suppress = np.zeros(inputs.num_sample_rows, dtype=bool)
        suppress[inputs.eos_suppression_rows] = True
        with stage("eager step"):
            index = torch.as_tensor(inputs.selected_token_indices, dtype=torch.int64, device=self.device)
            rows = gather(hidden, index).to(self.buffers.source.dtype)
            logits = get_logits(
                rows, self.weight, batch_invariant=self.config.batch_invariant, block_rows=self.config.logits_block_rows
            )
            params = RowParams.from_numpy(
                temperature=inputs.temperatures,
                top_k=inputs.top_ks,
                top_p=inputs.top_ps,
                min_p=inputs.min_ps,
                seed=inputs.seeds,
                sample_position=inputs.sample_positions,
                row_to_req=inputs.row_to_req,
                local_step=inputs.local_step,
                stop_ids=stop_ids,
                suppress_eos=suppress,
                device=self.device,
            )
            out = SampleOutput.allocate(len(index), self.config.sampler.max_logprobs, self.device)
            sample(logits, params, self.config.sampler, out=out)
            self._redo_exact_rows(logits, params, out, len(index))
        return _host_results(out, want_top=bool((inputs.num_logprobs > 0).any()))

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: SamplerInputs) -> list[list[PromptLogprob] | None]:
        if not inputs.is_prompt.any() or not (inputs.num_prompt_logprobs >= 0).any():
            return [None] * inputs.num_reqs
        results = compute_prompt_logprobs(
            hidden,
            self.weight,
            inputs,
            chunk_rows=self.config.prompt_logprobs_chunk_rows,
            batch_invariant=self.config.batch_invariant,
        )
        return self.prompt_logprobs.add(inputs, results)

    def _assemble(
        self,
        inputs: SamplerInputs,
        result: dict[str, np.ndarray],
        row_drafts: np.ndarray | None,
        prompt_lp: list[list[PromptLogprob] | None],
        bucket: int | None,
        replayed: bool,
    ) -> StepOutput:
        tokens, logprobs, num_accepted = [], [], []
        drawn = result["tokens"]
        for i in range(inputs.num_reqs):
            lo = int(inputs.sample_offsets[i])
            hi = lo + int(inputs.sample_counts[i])
            # Strict verification: row j's draw is keyed by the position it
            # produces, exactly as in plain decoding, so accepting drafts while
            # they equal the draws emits what one-token steps would have.
            accepted = 0
            if row_drafts is not None:
                while lo + accepted < hi - 1 and drawn[lo + accepted] == row_drafts[lo + accepted]:
                    accepted += 1
            num_accepted.append(accepted)
            if inputs.is_prompt[i] and not inputs.is_last_chunk[i]:
                emitted = range(0)  # the token sampled for a non-last chunk is discarded
            else:
                emitted = range(lo, lo + accepted + 1)
            tokens.append([int(result["tokens"][r]) for r in emitted])
            n_top = int(inputs.num_logprobs[i])
            if n_top < 0:
                logprobs.append(None)
                continue
            logprobs.append(
                [
                    TokenLogprob(
                        int(result["tokens"][r]),
                        float(result["logprob"][r]),
                        int(result["rank"][r]),
                        tuple(zip(result["top_ids"][r, :n_top].tolist(), result["top_logprobs"][r, :n_top].tolist()))
                        if n_top
                        else (),
                    )
                    for r in emitted
                ]
            )
        return StepOutput(
            request_ids=inputs.request_ids,
            tokens=tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
            seeds=[int(s) for s in inputs.seeds],
            num_accepted=num_accepted,
            bucket=bucket,
            replayed=replayed,
        )


def _host_results(out: SampleOutput, *, want_top: bool) -> dict[str, np.ndarray]:
    """Copy the real rows of the outputs to the host. A copy also on CPU, where
    `.cpu()` would return the static buffer itself and the next step would
    overwrite the results under the caller's feet."""
    names = ("tokens", "logprob", "rank", "top_ids", "top_logprobs") if want_top else ("tokens", "logprob", "rank")
    return {name: getattr(out, name).to("cpu", copy=True).numpy() for name in names}
