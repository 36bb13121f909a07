"""The kernel head's captured step (`engine.step.kernel_head`): at most a dozen kernels, one graph per bucket.

    lm head       engine::lm_head_logits: gather fused into the GEMM (on CUDA) -> buffers.logits
    stages 1-14   `engine.sampling.sampler.run_stages`, vLLM's order, its groups by `TritonStages`:
      3-7         engine::apply_controls (vLLM's logits processors, the bitmask, stop ids;
                  the sampler's pass 1 of each row it controls)  -> state.scores, row_controlled,
                                                                   state.pass_one
      8-14        engine::sample_rows (one launch; without drafts, 9 at buckets
                  below the SMs: each row split over them)      -> buffers.out (+ kept weights)
    hidden check  engine::fail_non_finite_hidden                -> buffers.out
    verify        engine::verify_residual_chunks (rejection),
                  engine::verify_step (drafts, draft pool, penalty counts)
                                                                -> num_accepted, emitted, pool, counts

Every kernel reads per-row flags on the device (a row without controls is skipped by the
controls kernel and read from the logits by the sampler; a greedy row makes one pass), so
nothing about the step's rows is fixed at capture. The stage order is the one function
the torch path runs too (`run_stages`); `TritonStages` overrides the stage groups of the
torch ops' `TorchStages` (the CPU implementation and the reference these kernels are
tested against) with one kernel each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sampling.kernels.controls import PassOne, apply_controls
from engine.sampling.kernels.hidden_check import fail_non_finite_hidden
from engine.sampling.kernels.sample import KeptWeights, SampleScratch, sample_rows
from engine.sampling.kernels.verify_kernel import split_for, verify_residual_chunks, verify_step
from engine.sampling.sampler import ControlRows, ProcessedScores, TorchStages, run_stages
from engine.sampling.rows import SamplingRows
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler_config import SamplerConfig
from engine.step.engine_config import EngineConfig
from engine.step.control_state import SamplingControls
from engine.step.static_buffers import StepBuffers


class KernelStepHead(Protocol):
    """What the kernel step reads of its head (`engine.step.kernel_head.KernelHead`)."""

    buffers: StepBuffers
    config: EngineConfig
    state: KernelState
    # Whether the sampler may split a row over programs (9 launches, one per phase); False
    # keeps it to one launch where the graph's other kernels leave no room (12 a graph).
    split_sampler: bool
    # Whether `logits` also keys each row's largest logit into `state.raw_max`: raw logprobs
    # by an LM head over the whole vocabulary (a shard's head sees its shard's only).
    raw_max_keyed: bool

    def logits(self, bucket: int) -> None:
        """The bucket's sample rows' fp32 logits into `buffers.logits`."""


@dataclass(frozen=True)
class KernelState:
    """The kernel head's own static buffers, allocated once for the engine's largest bucket."""

    scores: torch.Tensor  # [max_rows, V] f32: the controlled scores of the rows the controls touched
    row_controlled: torch.Tensor  # [max_rows] bool: the row's scores are in `scores` (else its logits)
    nothing_allowed: torch.Tensor  # [max_rows] bool: the token bitmask allows no token of the row
    arrivals: torch.Tensor  # [max_rows] int32: the controls kernel's scratch, zero between launches
    scratch: SampleScratch  # the sampler's histograms, block masses, row state and partials
    pass_one: PassOne  # what the controls kernel finds of each row it controls for the sampler's pass 1
    raw_max: torch.Tensor  # [max_rows] int64: each row's largest logit, keyed by the LM head (0 between steps)
    kept: KeptWeights | None  # rejection mode: the draws as verification reads them
    residual_sums: torch.Tensor | None  # [max_reqs, split, 2] int64: rejection mode's residual chunk sums
    controls: SamplingControls  # the engine's control slots, or a neutral state of slot 0 alone
    counts: bool = False  # whether the step adds its emitted tokens to `controls.counts`

    @classmethod
    def allocate(cls, buffers: StepBuffers, config: EngineConfig, controls: SamplingControls) -> KernelState:
        rows, vocab = buffers.logits.shape
        device = buffers.logits.device
        reqs = buffers.num_accepted.shape[0]
        rejection = config.max_draft_tokens > 0 and config.verify_mode == "rejection"
        return cls(
            scores=torch.zeros(rows, vocab, dtype=torch.float32, device=device),
            row_controlled=torch.zeros(rows, dtype=torch.bool, device=device),
            nothing_allowed=torch.zeros(rows, dtype=torch.bool, device=device),
            arrivals=torch.zeros(rows, dtype=torch.int32, device=device),
            scratch=SampleScratch.allocate(rows, vocab, device, num_top=buffers.out.top_ids.shape[1]),
            pass_one=PassOne.allocate(rows, vocab, device, num_top=buffers.out.top_ids.shape[1]),
            raw_max=torch.zeros(rows, dtype=torch.int64, device=device),
            kept=KeptWeights.allocate(rows, vocab, device) if rejection else None,
            residual_sums=(torch.zeros(reqs, split_for(reqs, vocab), 2, dtype=torch.int64, device=device)
                           if rejection else None),
            controls=controls,
        )

    def static_tensors(self) -> dict[str, torch.Tensor]:
        """By name, every tensor the graph reads or writes that is the head's own."""
        tensors = {"kernels.scores": self.scores, "kernels.row_controlled": self.row_controlled,
                   "kernels.nothing_allowed": self.nothing_allowed, "kernels.arrivals": self.arrivals,
                   "kernels.raw_max": self.raw_max,
                   **{f"kernels.sample_{name}": tensor for name, tensor in vars(self.scratch).items()},
                   **{f"kernels.pass_one_{name}": tensor for name, tensor in vars(self.pass_one).items()}}
        if self.kept is not None:
            tensors.update({"kernels.kept_weights": self.kept.weights, "kernels.mass_total": self.kept.mass_total,
                            "kernels.one_hot_tokens": self.kept.one_hot_tokens,
                            "kernels.residual_sums": self.residual_sums})
        if not self.counts:  # the engine's own control state is among the engine's static tensors
            tensors.update({f"kernels.neutral_{name}": tensor
                            for name, tensor in self.controls.static_tensors().items()})
        return tensors


def logits_and_sample(head: KernelStepHead, bucket: int) -> None:
    """The lm head, then every stage in vLLM's order (`run_stages`), its groups by the
    kernels (`TritonStages`). Logprobs in the configured mode for every row (none where the
    engine's `SamplerConfig.logprobs` is False, as on the torch head): no step-level variant
    drops them."""
    b = head.buffers
    rows = b.rows_for(bucket)
    head.logits(bucket)  # [rows, V] f32 in b.logits: unprocessed, as the finite check and raw logprobs read them
    run_stages(b.logits[:rows], b.params(bucket), head.config.sampler, b.outputs(rows), compute_logprobs=True,
               token_bitmask=None if b.token_bitmask is None else b.token_bitmask[:rows],
               stages=TritonStages(head, bucket))


@dataclass(frozen=True)
class TritonStages(TorchStages):
    """The stage groups as Triton kernels over the kernel head's static buffers, for one
    bucket: `logits_processors` (3-7) and `sample_rows` (8-14) one kernel each, with the
    signatures of `TorchStages`' (engine/sampling/sampler.py), whose torch ops they must
    agree with. The kernel of 8-14 computes the kept set and the logprobs itself: the
    torch groups `kept_set` and `logprobs` are not called."""

    head: KernelStepHead
    bucket: int
    expands_rows = False  # the kernels read each row's controls from `rows.params` themselves

    def logits_processors(self, raw: torch.Tensor, rows: SamplingRows, controls: ControlRows | None,
                          token_bitmask: torch.Tensor | None) -> ProcessedScores:
        """Stages 3-7 in one kernel, engine::apply_controls: allowed tokens, token bitmask,
        EOS/stop suppression, logit bias, penalties (the drafts of a request's earlier rows
        counted). `raw` [rows, V] f32, the head's logits, stays unprocessed: each row with
        controls, active stop ids or a restricting bitmask goes to `KernelState.scores`, the
        others are skipped (`row_controlled`). `controls` must be None: the kernel reads each
        row's control slot (`KernelState.controls`) itself. `token_bitmask` [rows, W] int32
        or None. Capture-safe."""
        if controls is not None:
            raise ValueError("controls: the controls kernel reads the control slots itself, expected None")
        b, s, config = self.head.buffers, self.head.state, self.head.config
        f, c, p = b.inputs, s.controls, s.pass_one
        n, bucket = raw.shape[0], self.bucket
        masked = token_bitmask is not None
        keyed = self.head.raw_max_keyed
        apply_controls(
            raw, s.scores[:n], s.row_controlled[:n], s.nothing_allowed[:n], s.arrivals[:n],
            b.resolved_drafts[:n], f.row_to_req[:n], f.local_step[:n], f.control_slots[:bucket],
            f.row_drafts[:n], f.mtp_info_read_rows[:n], b.pool_tokens,
            c.counts, c.prompt_words, c.penalties, c.bias_ids, c.bias_values, c.allowed_words, c.restricted,
            f.stop_ids[:bucket], f.eos_suppression_rows[:n], token_bitmask, f.masked_rows[:n] if masked else None,
            max_drafts=config.max_draft_tokens, pass_f=p.row_f, pass_i=p.row_i, pass_top=p.row_top,
            part_f=p.part_f, part_i=p.part_i, part_top=p.part_top,
            raw_top=config.sampler.logprobs and config.sampler.logprobs_mode == "raw",
            raw_max=s.raw_max[:n] if keyed else None,
        )
        return ProcessedScores(s.scores[:n], s.nothing_allowed[:n], stops=None, borrowed=False,
                               row_controlled=s.row_controlled[:n])

    def sample_rows(self, processed: ProcessedScores, plain: torch.Tensor, rows: SamplingRows, cfg: SamplerConfig,
                    out: SampleOutput, mode: str | None) -> None:
        """Stages 8-14 in one kernel, engine::sample_rows: greedy, temperature, min-p, top-k,
        top-p, the draw, the rows' errors, logprobs in `mode`; a row the controls skipped
        reads its scores from `plain` [rows, V] f32, the logits. In rejection mode it also
        writes the kept weights verification reads. `cfg`'s variant fields are not read:
        every row branches on its own parameters. Capture-safe."""
        s = self.head.state
        # Without drafts each row spreads over the SMs (9 launches at small buckets: the graph's
        # 12 kernels); a drafts graph (or a shard head's, with its exchange) keeps one launch,
        # one program per row: its other kernels leave no room for 8 more.
        sample_rows(processed.scores, rows.params, out, s.scratch, logits=plain,
                    nothing_allowed=processed.nothing_allowed, logprobs=mode,
                    row_controlled=processed.row_controlled, kept=s.kept,
                    programs=None if self.head.split_sampler else 1, handed=s.pass_one,
                    handed_raw=self.head.raw_max_keyed)


@dataclass(frozen=True)
class KernelStep:
    """The kernel head's step of one bucket (`GraphReplayer`'s step function)."""

    head: KernelStepHead

    def __call__(self, bucket: int) -> None:
        head = self.head
        b, s, config = head.buffers, head.state, head.config
        f = b.inputs
        rows = b.rows_for(bucket)
        logits_and_sample(head, bucket)
        # After the sampler (whose codes it overrides), before verification (which reads them).
        fail_non_finite_hidden(b.source, f.selected_token_indices[:rows], b.outputs(rows))
        k = config.max_draft_tokens
        if not k and not s.counts:
            return  # no drafts to verify, no tokens to count
        mode = "none" if not k else config.verify_mode
        if mode == "rejection":
            verify_residual_chunks(b.resolved_drafts[:rows], f.row_to_req[:rows], f.local_step[:rows],
                                   s.kept.weights[:rows], s.kept.mass_total[:rows], s.kept.one_hot_tokens[:rows],
                                   b.draft_probs[:rows], f.has_draft_probs[:rows], f.seeds[:bucket],
                                   f.sample_positions[:bucket], s.residual_sums[:bucket])
        rejection = mode == "rejection"
        pool = k > 0 and config.draft_pool
        c = s.controls
        verify_step(
            b.out.tokens[:rows], b.out.error[:rows], b.resolved_drafts[:rows], f.row_to_req[:rows],
            f.local_step[:rows], b.num_accepted[:bucket], b.emitted[:rows] if rejection else None,
            s.kept.weights[:rows] if rejection else None, s.kept.mass_total[:rows] if rejection else None,
            s.kept.one_hot_tokens[:rows] if rejection else None, b.draft_probs[:rows] if rejection else None,
            f.has_draft_probs[:rows] if rejection else None, f.seeds[:bucket] if rejection else None,
            f.sample_positions[:bucket] if rejection else None, s.residual_sums[:bucket] if rejection else None,
            None, None,
            f.mtp_info_write_slots[:bucket] if pool else None, f.next_draft_tokens[:bucket] if pool else None,
            f.next_draft_logprobs[:bucket] if pool else None, b.pool_tokens if pool else None,
            b.pool_logprobs if pool else None,
            f.control_slots[:bucket] if s.counts else None, c.counts if s.counts else None,
            c.counted_index[:rows] if s.counts else None,
            mode, k, b.rows_per_req,
        )
