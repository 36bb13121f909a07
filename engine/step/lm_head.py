"""The LM head of a step: the strategy a StepEngine is built with.

The engine owns the ledger, the static buffers, the one graph per bucket and
the host side of every step. Its `LMHead` owns what depends on where the
vocabulary lives and how it is sampled: the weight, the device part from the
gathered hidden rows to the sampled tokens, what the host decides before a
step (`plan`), and the prompt logprobs.

- `LocalHead`: the whole head on this device by torch ops (`StepEngine(weight, config)`).
- `engine.step.kernel_head.KernelHead`: the same with the Triton kernels.
- `engine.parallel.shard_heads`: either over one rank's vocabulary shard.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from engine.host.ledger import SamplerInputs
from engine.invariance import choose_block_gemm, lm_head_candidates, warn_not_invariant
from engine.ops import BlockGemm, get_logits
from engine.sampling.sampler import SamplerConfig, sample
from engine.step.engine_config import EngineConfig, EngineStats
from engine.step.body import StepBody, StepKind
from engine.step.control_state import SamplingControls
from engine.step.prompt_logprobs import PromptRowResults, compute_prompt_logprobs
from engine.step.staging import StepArrays
from engine.step.static_buffers import StepBuffers
from engine.step.validation import type_name


class LMHead(ABC):
    """Where a step's logits come from and how its rows are drawn from them."""

    weight: torch.Tensor  # [V, H] (or the head's part of it), read-only
    vocab_size: int
    hidden_size: int
    dtype: torch.dtype  # the weight's: the default dtype of the hidden-state source
    name: str  # the step's name in capture reports and the dry run
    # Whether a step may restrict rows by a token bitmask (docs/contract.md §2).
    applies_token_bitmask = False
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
        """Take the engine's sampling-control state (before any step); the step applies
        it between the logits and the draw."""
        raise NotImplementedError(f"{type(self).__name__} does not apply sampling controls")

    @abstractmethod
    def step_body(self, buffers: StepBuffers, config: EngineConfig,
                  controls: SamplingControls | None) -> Callable[[int], None]:
        """The step of a bucket (`GraphReplayer`'s step function, one graph per bucket):
        gather, drafts, logits, the sampler's stages, the hidden check, verification, counts."""

    def plan(self, inputs: SamplerInputs, arrays: StepArrays, rows: int, stats: EngineStats) -> None:
        """On the host, before the step's replay: what the next step runs, where the head
        decides it per step (the CPU torch head; a captured head runs every stage). `rows`:
        the static rows its buckets run over."""

    @abstractmethod
    def scores_after(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After a step, sample rows `index` [k] int64 as the sampler saw them: their scores
        [k, V] f32 and, when those are the processed scores, the unprocessed logits [k, V]
        f32 (None: the scores are the logits). Rescoring a residual draw reruns the sampler
        on them with the drawn token forced."""

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


# Rows the CPU sampler takes at a time: [64, V] temporaries stay in the allocator's
# reuse range, while [256, 128256] ones cost fresh pages every step (measured on 2
# AVX-512 cores, B = 256, V = 128256: top-p 1363 -> 864 ms, plain 234 -> 104 ms).
CPU_CHUNK_ROWS = 64


class LocalHead(LMHead):
    """The whole LM head on this device by torch ops: `weight` [V, H] -> fp32 logits in the
    engine's static `buffers.logits`, sampled there (engine.sampling.sampler).

    One step function per bucket. On CUDA (the reference the kernels are checked against)
    its graph runs every stage for every row: the full sampler, the controls (a row
    without a control slot reads the neutral slot 0) and the token bitmask (rows outside
    `masked_rows` unrestricted). On the CPU nothing is captured, so `plan` picks on the
    host, per step, what the step's rows need (`EngineConfig.sampler_variants`): the
    argmax alone when every request is greedy, the draw without the threshold passes
    when no sampled request filters, the filters a step's requests ask for, logprobs only
    when one wants them, the controls only when a request holds a slot, the bitmask only
    when a row is restricted. Every choice gives the same bits as the full step."""

    supports_controls = True
    applies_token_bitmask = True
    name = "torch"

    def __init__(self, lm_head_weight: torch.Tensor, config: EngineConfig) -> None:
        device = self.hold_weight(lm_head_weight, config)
        # The block GEMM, probed here (engine.invariance): the first kernel of
        # BLOCK_KERNELS (oneDNN's, MKL's packed weights, mm) at the configured block that
        # holds, else at a fallback block size.
        if config.batch_invariant:
            self.logits_kernel, self.batch_invariant_verified = choose_block_gemm(lm_head_candidates(self.weight, config.block_rows))
            if not self.batch_invariant_verified:
                warn_not_invariant(f"the LM head {tuple(self.weight.shape)} {self.weight.dtype} on {device}")
        self.applies_token_bitmask = config.token_bitmask
        # On CPU the sampler takes CPU_CHUNK_ROWS rows at a time; on CUDA, the whole batch.
        self.per_step = device.type == "cpu"
        self.full = dataclasses.replace(config.sampler, stages="filters", top_k="radix", top_p=True,
                                        chunk_rows=CPU_CHUNK_ROWS if self.per_step else 0)
        self._samplers: dict[tuple[str, str, bool, bool], SamplerConfig] = {}
        self.buffers: StepBuffers | None = None
        self.controls: SamplingControls | None = None
        self.kind = StepKind(self.full, controls=False, masked=self.applies_token_bitmask)

    def attach(self, buffers: StepBuffers) -> None:
        self.buffers = buffers

    def attach_controls(self, controls: SamplingControls) -> None:
        self.controls = controls
        self.kind = dataclasses.replace(self.kind, controls=True)

    def step_body(self, buffers: StepBuffers, config: EngineConfig,
                  controls: SamplingControls | None) -> Callable[[int], None]:
        return StepBody(buffers, config, self, controls)

    def plan(self, inputs: SamplerInputs, arrays: StepArrays, rows: int, stats: EngineStats) -> None:
        if not self.per_step:
            return  # captured: every stage for every row
        masked = arrays.token_bitmask is not None
        controls = self.controls is not None and (arrays.control_slots is not None or masked)
        sampler = self.full if masked or controls or not self.config.sampler_variants else self._variant(inputs, stats)
        self.kind = StepKind(sampler, controls=controls, masked=masked)

    def _variant(self, inputs: SamplerInputs, stats: EngineStats) -> SamplerConfig:
        """The lightest sampler that decides the step's rows as the full one does: logprobs
        only when a request wants them; the argmax alone when every request is greedy and
        none suppresses its EOS; the draw without threshold passes when no sampled request
        has top-k, top-p or min-p; else the cuts the requests ask for, the top-k by a topk
        where every top-k fits `candidate_cap` (the counting radix where one does not)."""
        greedy = inputs.temperatures == 0
        logprobs = bool((inputs.num_logprobs >= 0).any())
        # A greedy request has no filters (as vLLM): its processed logprobs are over every token.
        k_on = ~greedy & (inputs.top_ks > 0) & (inputs.top_ks < self.vocab_size)
        top_k = "none" if not k_on.any() else "topk" if inputs.top_ks[k_on].max() <= self.full.candidate_cap else "radix"
        if logprobs:
            return self._sampler("filters", top_k, True, True)
        if greedy.all() and not len(inputs.eos_suppression_rows):  # the argmax alone suppresses nothing
            stats.greedy_steps += 1
            return self._sampler("greedy", "radix", True, False)
        p_on = ~greedy & (inputs.top_ps < 1)
        if not (k_on | p_on | (~greedy & (inputs.min_ps > 0))).any():
            stats.plain_steps += 1
            return self._sampler("plain", "radix", True, False)
        return self._sampler("filters", top_k, bool(p_on.any()), False)

    def _sampler(self, stages: str, top_k: str, top_p: bool, logprobs: bool) -> SamplerConfig:
        """The full sampler with these stages, made once."""
        key = (stages, top_k, top_p, logprobs)
        if key not in self._samplers:
            self._samplers[key] = dataclasses.replace(self.full, stages=stages, top_k=top_k, top_p=top_p,
                                                      logprobs=logprobs and self.full.logprobs)
        return self._samplers[key]

    def logits(self, bucket: int) -> None:
        """The lm head: the fp32 logits of the bucket's gathered hidden rows into `buffers.logits`."""
        b = self.buffers
        rows = bucket * b.rows_per_req
        get_logits(
            b.hidden[:rows],
            self.weight,
            out=b.logits[:rows],  # [rows, V] f32
            batch_invariant=self.config.batch_invariant,
            block_rows=self.config.block_rows,
            kernel=self.logits_kernel,
        )

    def logits_and_sample(self, bucket: int) -> None:
        """The logits, then every stage in vLLM's order (engine.sampling.sampler) that the
        step's kind runs; with controls, `buffers.logits` hold the processed scores afterwards
        (what verification reads)."""
        b, kind = self.buffers, self.kind
        rows = bucket * b.rows_per_req
        self.logits(bucket)
        sample(b.logits[:rows], b.params(bucket), kind.sampler, out=b.outputs(rows),
               controls=self.controls.rows(b, bucket) if kind.controls else None,
               token_bitmask=b.token_bitmask[:rows] if kind.masked else None)

    def scores_after(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = self.buffers
        if self.kind.controls:  # processed in place
            return b.logits[index], self.controls.unprocessed[index]
        return b.logits[index], None

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
