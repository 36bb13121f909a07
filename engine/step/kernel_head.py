"""The LM head as fused Triton kernels: one captured graph per bucket (`KernelHead`).

Every row takes its own branch inside the kernels, on flags read on the device, so one
graph per bucket serves every step at the cost of each row's own work (the torch head's
CUDA graph runs every stage for every row):

    lm head      the gathered hidden rows x the weight        -> buffers.logits (unprocessed)
    controls     engine::apply_controls: allowed tokens, token bitmask, EOS/stop suppression,
                 logit bias, penalties (drafts counted); rows without any skip  -> scores
    sample       engine::sample_rows: greedy, temperature, min-p, top-k, top-p, the draw,
                 logprobs; a skipped row reads its logits                       -> buffers.out
    hidden check engine::fail_non_finite_hidden                                 -> buffers.out
    verify       engine::verify_residual_chunks (rejection), engine::verify_step: drafts,
                 the draft pool's writes, the emitted tokens into the penalty counts

The stages run in vLLM's order through the torch path's own function
(`engine.sampling.sampler.run_stages`), its stage groups by the kernels
(`engine.step.kernel_step.TritonStages`) where the torch path's are torch ops (the CPU path
and the reference). Logprobs are computed for every row in the configured mode
(`SamplerConfig.logprobs_mode`): no step-level variant drops them. The controls' copy of
the unprocessed logits (`SamplingControls.unprocessed`, [rows, V] f32) is not allocated:
`buffers.logits` stay unprocessed.

`EngineConfig(kernels="triton")` picks this head for a local weight ("auto": on CUDA). Off
CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1): slow, for tests.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine.host.ledger import SamplerInputs
from engine.invariance import warn_not_invariant
from engine.step.engine_config import EngineConfig
from engine.step.control_state import SamplingControls
from engine.step.lm_head import LMHead, LocalHead
from engine.step.lm_head_choice import RowLogits, choose_row_logits
from engine.step.prompt_logprobs import PromptRowResults, compute_prompt_logprobs
from engine.step.static_buffers import StepBuffers
from graphs.replay import BucketTable

if TYPE_CHECKING:
    from engine.step.kernel_step import KernelState

# The kernel head's step, by name.
KERNELS = "kernels"


def local_head(lm_head_weight: torch.Tensor, config: EngineConfig) -> LMHead:
    """The head of a local weight [V, H]: `KernelHead` where `config.resolved_kernels()` is
    "triton", else `LocalHead`."""
    if config.resolved_kernels() == "triton":
        return KernelHead(lm_head_weight, config)
    return LocalHead(lm_head_weight, config)


class KernelHead(LMHead):
    """The whole LM head on this device, its captured step as fused Triton kernels: one
    graph per bucket for plain, greedy, filtered, logprob, controlled and masked steps
    alike (see the module docstring)."""

    supports_controls = True
    controls_in_place = False  # the controlled scores go to `scores`; `buffers.logits` stay unprocessed
    applies_token_bitmask = True
    name = KERNELS

    def __init__(self, lm_head_weight: torch.Tensor, config: EngineConfig) -> None:
        if config.top_k_space_verify:
            raise ValueError("EngineConfig.top_k_space_verify=True: not served by the Triton kernels "
                             "(EngineConfig.kernels='triton'); use kernels='torch'")
        device = self.hold_weight(lm_head_weight, config)
        # The sample rows' logits: on CUDA the fused gather + GEMM the probe verifies
        # (engine::lm_head_logits, one call per bucket: the weight read once), elsewhere the
        # probed block GEMM; without batch invariance one GEMM call.
        if config.batch_invariant:
            rows_per_req = 1 + config.max_draft_tokens
            calls = tuple(sorted({b * rows_per_req for b in BucketTable(config.max_num_reqs, config.buckets).buckets}))
            self.row_logits, self.batch_invariant_verified = choose_row_logits(self.weight, config.block_rows,
                                                                               call_rows=calls)
            self.logits_kernel = self.row_logits.block_gemm
            if not self.batch_invariant_verified:
                warn_not_invariant(f"the LM head {tuple(self.weight.shape)} {self.weight.dtype} on {device}")
        else:
            self.row_logits = RowLogits("cublas", self.weight)
        self.buffers: StepBuffers | None = None
        self.controls: SamplingControls | None = None
        self.state: KernelState | None = None

    def attach(self, buffers: StepBuffers) -> None:
        # Imported here: triton is imported only where a kernel runs, never by the torch path.
        from engine.step.kernel_step import KernelState

        self.buffers = buffers
        # The control kernel always runs (the bitmask, the stop ids); without control slots
        # it reads the neutral slot 0 of a state of its own (no rows of it: nothing is counted).
        neutral = SamplingControls(replace(self.config, max_control_slots=0), self.vocab_size, 0, buffers.logits.device,
                                   keep_unprocessed=False)
        self.state = KernelState.allocate(buffers, self.config, neutral)

    def attach_controls(self, controls: SamplingControls) -> None:
        self.controls = controls
        self.state = replace(self.state, controls=controls, counts=True)

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return self.state.static_tensors()

    def step_body(self, buffers: StepBuffers, config: EngineConfig,
                  controls: SamplingControls | None) -> Callable[[int], None]:
        from engine.step.kernel_step import KernelStep

        return KernelStep(self)

    def logits_and_sample(self, bucket: int) -> None:
        """The lm head and every stage of `bucket` (`run_stages` by the kernels; `KernelStep`
        runs the rest)."""
        from engine.step.kernel_step import logits_and_sample

        logits_and_sample(self, bucket)

    def logits(self, bucket: int) -> None:
        """The lm head: the fp32 logits of the bucket's sample rows, gathered from the source
        (a padding row's out-of-range index reads a zero row), into `buffers.logits`."""
        b = self.buffers
        rows = b.rows_for(bucket)
        self.row_logits(b.source, b.inputs.selected_token_indices[:rows], b.logits[:rows],  # [rows, V] f32
                        row_max=self.state.raw_max[:rows] if self.raw_max_keyed else None)

    @property
    def raw_max_keyed(self) -> bool:
        """In raw logprobs mode the LM head keys each row's largest logit (`KernelState.raw_max`):
        the controls kernel sums a controlled row's raw masses as it passes, so the sampler
        makes no logprob pass over it where the token is on the row's raw top-N."""
        return self.config.sampler.logprobs and self.config.sampler.logprobs_mode == "raw"

    @property
    def split_sampler(self) -> bool:
        """The sampler splits rows over the SMs in graphs without drafts (their verification
        kernels leave no room for its 8 more launches within 12 a graph)."""
        return not self.config.max_draft_tokens

    def scores_after(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The controls kernel wrote the processed scores of the rows it did not skip to
        `KernelState.scores`; `buffers.logits` stay unprocessed."""
        logits, s = self.buffers.logits[index], self.state
        return torch.where(s.row_controlled[index, None], s.scores[index], logits), logits

    def prompt_logprobs(self, hidden_states: torch.Tensor, inputs: SamplerInputs) -> PromptRowResults:
        return compute_prompt_logprobs(hidden_states, self.weight, inputs,
                                       chunk_rows=self.config.prompt_logprobs_chunk_rows,
                                       batch_invariant=self.config.batch_invariant, kernel=self.logits_kernel)

