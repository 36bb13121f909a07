"""The LM head of a step: the strategy a StepEngine is built with.

The engine owns the ledger, the static buffers, the graphs and the host side
of every step. Its `LMHead` owns what depends on where the vocabulary lives:
the weight, the captured part from the gathered hidden rows to the sampled
tokens, which of its graph sets a step uses, and the prompt logprobs.

- `LocalHead`: the whole head on this device (`StepEngine(weight, config)`).
- `engine.step.kernel_head.KernelHead`: the same with the Triton kernels.
- `engine.parallel.shard_heads`: either over one rank's vocabulary shard.
"""
from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch

from engine.host.ledger import SamplerInputs
from engine.invariance import choose_block_gemm, lm_head_candidates, warn_not_invariant
from engine.ops import BlockGemm, get_logits
from engine.sampling.sampler import TOP_K_MODES, SamplerConfig, sample
from engine.step.engine_config import EngineConfig, EngineStats
from engine.step.body import StepBody
from engine.step.control_state import SamplingControls
from engine.step.prompt_logprobs import PromptRowResults, compute_prompt_logprobs
from engine.step.static_buffers import StepBuffers
from engine.step.validation import type_name


class LMHead(ABC):
    """Where a step's logits come from and how its rows are drawn from them."""

    weight: torch.Tensor  # [V, H] (or the head's part of it), read-only
    vocab_size: int
    hidden_size: int
    dtype: torch.dtype  # the weight's: the default dtype of the hidden-state source
    graph_sets: tuple[str, ...]  # one set of captured graphs each (`StepEngine.replayers`), default first
    # The graph set of steps with a token bitmask (docs/contract.md §2); None: the head cannot apply one.
    masked_graphs: str | None = None
    # The graph set of steps where a request holds a control slot (`attach_controls`).
    controls_graphs: str = "controls"
    # Whether the controls rewrite `buffers.logits` in place (the unprocessed logits then
    # live in `SamplingControls.unprocessed`); False: `buffers.logits` stay unprocessed.
    controls_in_place = True
    logits_kernel: BlockGemm | None = None  # the verified block GEMM, None: get_logits' own blocks
    batch_invariant_verified: bool = False
    stats: object | None = None  # the head's own counters, saved and restored with the engine's
    supports_controls = False  # whether `attach_controls` may be called (penalties, logit bias, allowed tokens)

    def hold_weight(self, lm_head_weight: object, config: EngineConfig) -> torch.device:
        """Check and keep the whole head's weight and the config (weight, config,
        vocab_size, hidden_size, dtype); returns the engine's device. **Raises**
        ValueError naming `lm_head_weight` (`checked_head_weight`)."""
        device = config.resolved_device()
        self.weight = checked_head_weight(lm_head_weight, device, "lm_head_weight")
        self.config = config
        self.vocab_size, self.hidden_size = self.weight.shape
        self.dtype = self.weight.dtype
        return device

    @abstractmethod
    def attach(self, buffers: StepBuffers) -> None:
        """Take the engine's static buffers (once, before any step)."""

    def static_tensors(self) -> dict[str, torch.Tensor]:
        """Static tensors of the head's own that the graphs use, by name."""
        return {}

    def attach_controls(self, controls: SamplingControls) -> None:
        """Take the engine's sampling-control state (before any step): a further
        graph set, `CONTROLLED`, applies it between the logits and the draw."""
        raise NotImplementedError(f"{type(self).__name__} does not apply sampling controls")

    @abstractmethod
    def logits_and_sample(self, bucket: int, graphs: str) -> None:
        """Inside the graph of `graphs`: from `buffers.hidden` to the sampler's `buffers.out`."""

    def step_body(self, graphs: str, buffers: StepBuffers, config: EngineConfig,
                  controls: SamplingControls | None) -> Callable[[int], None]:
        """The captured step of graph set `graphs`, called with the bucket (`GraphReplayer`'s
        step function): gather, drafts, this head's `logits_and_sample`, the hidden check,
        verification, counts (`engine.step.body.StepBody`). `controls`: the engine's
        sampling-control state, or None."""
        applies = controls is not None and graphs in (self.controls_graphs, self.masked_graphs)
        return StepBody(buffers, config, functools.partial(self.logits_and_sample, graphs=graphs),
                        controls=controls if applies else None,
                        token_bitmask=buffers.token_bitmask if graphs == self.masked_graphs else None)

    @abstractmethod
    def graphs_for(self, inputs: SamplerInputs, rows: int, stats: EngineStats) -> str:
        """The graph set of this step; `rows`: the static rows its buckets run over."""

    def scores_after(self, graphs: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After a replay of `graphs`, sample rows `index` [k] int64 as the sampler saw them:
        their scores [k, V] f32 and, when those are the processed scores, the unprocessed
        logits [k, V] f32 (None: the scores are the logits). Rescoring a residual draw reruns
        the sampler on them with the drawn token forced."""
        return self.buffers.logits[index], None

    @abstractmethod
    def prompt_logprobs(self, hidden_states: torch.Tensor, inputs: SamplerInputs) -> PromptRowResults:
        """The step's prompt-logprob rows (eager, outside the graph)."""


def checked_head_weight(weight: object, device: torch.device, name: str) -> torch.Tensor:
    """`weight` as the engine reads it: a floating-point [vocab, hidden] tensor on `device`."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name}: a {type_name(weight)}, expected a torch.Tensor [vocab, hidden]")
    if not weight.is_floating_point():
        raise ValueError(f"{name}: dtype {weight.dtype}, expected a floating-point tensor")
    if weight.dim() != 2:
        raise ValueError(f"{name}: shape {tuple(weight.shape)} is not [vocab, hidden]")
    if weight.device.type != device.type:
        raise ValueError(f"{name} is on {weight.device} but the engine runs on {device}: "
                         "move the weight or set EngineConfig.device")
    # The engine only reads the head: an nn.Parameter's autograd must not
    # record every step (nor refuse `.numpy()` on what comes out).
    return weight.detach()


def filter_graphs(top_k: str, top_p: bool, logprobs: bool = False) -> str:
    """The name of the graph set whose sampler finds the top-k cut by `top_k`
    (`TOP_K_MODES`), runs top-p when `top_p` and computes logprobs when `logprobs`."""
    return f"filters(top-k {top_k}, top-p {'on' if top_p else 'off'}{', logprobs' if logprobs else ''})"


# Rows the CPU sampler takes at a time: [64, V] temporaries stay in the allocator's
# reuse range, while [256, 128256] ones cost fresh pages every step (measured on 2
# AVX-512 cores, B = 256, V = 128256: top-p 1363 -> 864 ms, plain 234 -> 104 ms).
CPU_CHUNK_ROWS = 64
# The graph sets of plain steps (`EngineConfig.sampler_variants`): every stage (any
# top-k), the draw without the filters' passes, the argmax alone.
FILTERED, PLAIN, GREEDY = filter_graphs("radix", True), "plain", "greedy"
# The graph set of steps where some request holds a control slot: plain steps never pay for the controls.
CONTROLLED = LMHead.controls_graphs
# The graph set of steps that restrict a row by the token bitmask; it applies the controls too.
MASKED = "masked"


class LocalHead(LMHead):
    """The whole LM head on this device: `weight` [V, H] -> fp32 logits in the
    engine's static `buffers.logits`, sampled there. Graph sets: the whole
    sampler (`FILTERED`, for any step, and the one for steps where a request
    wants logprobs); with `EngineConfig.sampler_variants`, lighter sets
    without logprobs: one per way of filtering (`filter_graphs`: no top-k,
    or every top-k within `sampler.candidate_cap`; top-p or not), `PLAIN`
    for steps where no sampled request filters, `GREEDY` for steps where
    every request is greedy and none has its EOS suppression on; with `attach_controls`,
    `CONTROLLED` for steps where a request uses controls; with
    `EngineConfig.token_bitmask`, `MASKED` (the controls too when attached)
    for steps that restrict a row by the token bitmask."""

    supports_controls = True

    def __init__(self, lm_head_weight: torch.Tensor, config: EngineConfig) -> None:
        device = self.hold_weight(lm_head_weight, config)
        # The block GEMM, probed here (engine.invariance): the first kernel of
        # BLOCK_KERNELS (oneDNN's, MKL's packed weights, mm) at the configured block that
        # holds, else at a fallback block size.
        if config.batch_invariant:
            self.logits_kernel, self.batch_invariant_verified = choose_block_gemm(lm_head_candidates(self.weight, config.block_rows))
            if not self.batch_invariant_verified:
                warn_not_invariant(f"the LM head {tuple(self.weight.shape)} {self.weight.dtype} on {device}")
        # One sampler variant per graph set: a captured graph fixes the stages it runs.
        # On CPU the sampler takes CPU_CHUNK_ROWS rows at a time; on CUDA, the whole batch.
        chunk = CPU_CHUNK_ROWS if device.type == "cpu" else 0
        full = dataclasses.replace(config.sampler, stages="filters", top_k="radix", top_p=True, chunk_rows=chunk)
        self.samplers: dict[str, SamplerConfig] = {FILTERED: full}
        if config.sampler_variants:
            # The lighter sets serve steps where no request wants logprobs: they compute none.
            light = dataclasses.replace(full, logprobs=False)
            for top_k in TOP_K_MODES:
                for top_p in (True, False):
                    if (top_k, top_p) != ("radix", True):
                        self.samplers[filter_graphs(top_k, top_p)] = dataclasses.replace(light, top_k=top_k, top_p=top_p)
            self.samplers[PLAIN] = dataclasses.replace(light, stages="plain")
            self.samplers[GREEDY] = dataclasses.replace(light, stages="greedy")
            # Steps where a request wants logprobs: the counting radix only where a top-k needs it.
            for top_k in ("topk", "none"):
                self.samplers[filter_graphs(top_k, True, logprobs=True)] = dataclasses.replace(full, top_k=top_k)
        if config.token_bitmask:
            self.samplers[MASKED] = full
            self.masked_graphs = MASKED
        self.graph_sets = tuple(self.samplers)
        self.buffers: StepBuffers | None = None
        self.controls: SamplingControls | None = None

    def attach(self, buffers: StepBuffers) -> None:
        self.buffers = buffers

    def attach_controls(self, controls: SamplingControls) -> None:
        self.controls = controls
        self.samplers[CONTROLLED] = self.samplers[FILTERED]
        self.graph_sets = tuple(self.samplers)

    def logits(self, bucket: int) -> None:
        """The lm head: the fp32 logits of the bucket's gathered hidden rows into `buffers.logits`."""
        b = self.buffers
        rows = b.rows_for(bucket)
        get_logits(
            b.hidden[:rows],
            self.weight,
            out=b.logits[:rows],  # [rows, V] f32
            batch_invariant=self.config.batch_invariant,
            block_rows=self.config.block_rows,
            kernel=self.logits_kernel,
        )

    def logits_and_sample(self, bucket: int, graphs: str) -> None:
        b = self.buffers
        rows = b.rows_for(bucket)
        self.logits(bucket)
        controls = token_bitmask = None
        if graphs in (CONTROLLED, MASKED) and self.controls is not None:
            # In a masked step without controls every staged slot is 0 (neutral).
            controls = self.controls.rows(b, bucket)
        if graphs == MASKED:
            token_bitmask = b.token_bitmask[:rows]
        # Every stage, in vLLM's order (engine.sampling.pipeline); with controls, b.logits
        # hold the processed scores afterwards (what verification reads).
        sample(b.logits[:rows], b.params(bucket), self.samplers[graphs], out=b.outputs(rows),
               controls=controls, token_bitmask=token_bitmask)

    def scores_after(self, graphs: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = self.buffers
        if self.controls is not None and graphs in (CONTROLLED, MASKED):  # processed in place
            return b.logits[index], self.controls.unprocessed[index]
        return b.logits[index], None

    def graphs_for(self, inputs: SamplerInputs, rows: int, stats: EngineStats) -> str:
        """Without lighter sets, `FILTERED`. A step where a request wants
        logprobs: a set with logprobs and top-p, whose top-k cut is a topk
        where every top-k fits `candidate_cap` (`FILTERED`, the counting radix,
        where one does not). Else `GREEDY` when every request is greedy (none
        suppressing EOS), `PLAIN` when no sampled request filters, else the
        filter set that does just what the step's requests ask."""
        if PLAIN not in self.samplers:
            return FILTERED
        greedy = inputs.temperatures == 0
        logprobs = bool((inputs.num_logprobs >= 0).any())
        # A greedy request has no filters (as vLLM): its processed logprobs are over every token.
        k_on = ~greedy & (inputs.top_ks > 0) & (inputs.top_ks < self.vocab_size)
        top_k = "none" if not k_on.any() else "topk" if inputs.top_ks[k_on].max() <= self.config.sampler.candidate_cap else "radix"
        if logprobs:
            return FILTERED if top_k == "radix" else filter_graphs(top_k, True, logprobs=True)
        if greedy.all() and not len(inputs.eos_suppression_rows):  # the greedy set suppresses nothing
            stats.greedy_steps += 1
            return GREEDY
        p_on = ~greedy & (inputs.top_ps < 1)
        if not (k_on | p_on | (~greedy & (inputs.min_ps > 0))).any():
            stats.plain_steps += 1
            return PLAIN
        return FILTERED if (top_k, bool(p_on.any())) == ("radix", True) else filter_graphs(top_k, bool(p_on.any()))

    def prompt_logprobs(self, hidden_states: torch.Tensor, inputs: SamplerInputs) -> PromptRowResults:
        return compute_prompt_logprobs(
            hidden_states,
            self.weight,
            inputs,
            # Top-k-space mode (docs/contract.md §2.1): a target outside the request's top-k reads -inf.
            top_k=inputs.top_ks if self.config.top_k_space_verify else None,
            chunk_rows=self.config.prompt_logprobs_chunk_rows,
            batch_invariant=self.config.batch_invariant,
            kernel=self.logits_kernel,  # the block GEMM the probe verified, as the sampled rows use
        )
