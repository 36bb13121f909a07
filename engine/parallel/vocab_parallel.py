"""Vocab-parallel logits and sampling over torch.distributed (docs/contract.md §2 across ranks).

Each rank holds rows [start, stop) of the LM head. Shard boundaries fall on
the sampler's normaliser blocks (`engine.sampling.normaliser.BLOCK`): a block never spans
two ranks, so every rank computes whole blocks exactly as the unsharded
sampler does, and the gathered raw block masses are the same exact integers
(f64). That is what makes the sharded logprobs bit-identical, not just close.

Two ways to sample a step, chosen per step by the engine:

- "gather": all-gather the full logits row ([rows, V] fp32 on every rank) and
  run the ordinary sampler. Always valid; moves rows * V * 4 bytes.
- "candidates": each rank sends its local top-C raw logits (value bits and
  global id), every rank merges them into the global top C in (raw desc, id
  asc) order and decides each row from them with the sampler's definitions
  (`engine.sampling.candidates`): the kept set over the candidates' exact
  integer masses, the inverse-CDF draw over the kept candidates' weights
  laid out by token id over the whole row (every other weight is 0, so no
  rank needs another's), the greedy pick. The same numbers on every rank:
  no token broadcast. A second all-gather sends each rank's block masses of
  exp(raw - raw max), for the raw logprobs' normaliser and the finiteness
  check.
  Valid when every request is greedy or has 0 < top_k <= k_cap, logprobs are
  "raw": the kept set, the greedy token, the rank of the emitted token and
  the top-N then all lie inside the global top C, with
  C = max(k_cap + max_stop_ids, max_logprobs) + 1 (room for suppressed stop ids
  ahead of the k-th token, and one candidate past everything kept so a tie
  reaching the boundary is seen and sent to the exact path).

Rows the candidate path cannot decide (the top-k cut not strictly above the
boundary, so ties may continue past the candidates; no valid candidate; a
greedy maximum or a top-N value tied with the boundary; a forced token
outside the candidates, whose logprob needs its logit) are flagged in
`needs_exact` and redone by the caller over all-gathered full logits with
`sample_exact`, which gives what the unsharded sampler gives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from engine.host.ledger import SamplerInputs
from engine.ops import gather, get_logits
from engine.sampling.candidates import decide_on_candidates, order_candidates
from engine.sampling.errors import PLACEHOLDER_TOKEN, RowError, fail_rows
from engine.sampling.logprobs import candidate_raw_logprobs
from engine.sampling.normaliser import BLOCK, block_sums, log_block_total
from engine.sampling.row_params import RowParams
from engine.sampling.rows import expand_rows
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import SamplerConfig, sample
from engine.sampling.suppression import suppression_and_shift
from engine.step.prompt_logprobs import PromptRowResults, prompt_rows_of

STRATEGIES = ("gather", "candidates")


@dataclass(frozen=True)
class VocabShards:
    """Which vocabulary rows each of `tp` ranks holds, aligned to `align` tokens (BLOCK
    unless `split` is told otherwise; `blocks` counts BLOCKs): contiguous runs of whole blocks, the last shard possibly shorter (fewer
    blocks, and a partial block at the end of the vocabulary)."""

    vocab: int
    tp: int
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def split(cls, vocab: int, tp: int, align: int = BLOCK) -> VocabShards:
        """Shards of whole blocks of `align` tokens: BLOCK for the candidate exchange's block
        masses; `engine.parallel.shard_heads` needs fewer (`SHARD_ALIGN`)."""
        if tp < 1:
            raise ValueError(f"tp={tp}: must be >= 1")
        blocks = -(-vocab // align)
        if blocks < tp:
            raise ValueError(f"vocab={vocab}: {blocks} blocks of {align} tokens cannot feed tp={tp} ranks")
        # The first blocks % tp ranks take one block more: the last shard is
        # never larger than the others and no rank is left empty.
        counts = [blocks // tp + (r < blocks % tp) for r in range(tp)]
        first_block = np.concatenate([[0], np.cumsum(counts)])
        starts = tuple(int(b) * align for b in first_block[:-1])
        sizes = tuple(min(int(b) * align, vocab) - a for a, b in zip(starts, first_block[1:]))
        return cls(vocab, tp, starts, sizes)

    @property
    def max_size(self) -> int:
        return max(self.sizes)

    def blocks(self, rank: int) -> int:
        return -(-self.sizes[rank] // BLOCK)

    @property
    def max_blocks(self) -> int:
        return max(self.blocks(r) for r in range(self.tp))

    def shard(self, weight: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s rows of a full [V, H] LM head (a view)."""
        if weight.shape[0] != self.vocab:
            raise ValueError(f"weight: {weight.shape[0]} rows, the shards cover vocab={self.vocab}")
        return weight[self.starts[rank] : self.starts[rank] + self.sizes[rank]]


def candidate_count(k_cap: int, max_stop_ids: int, max_logprobs: int) -> int:
    """C, the global candidates per row of the candidate strategy (see module doc)."""
    return max(k_cap + max_stop_ids, max_logprobs) + 1


def candidate_ineligibility(
    temperatures: np.ndarray, top_ks: np.ndarray, k_cap: int, vocab: int
) -> str | None:
    """Why the candidate strategy cannot sample these requests (host arrays,
    real requests only), or None when it can."""
    bounded = (top_ks > 0) & (top_ks <= k_cap) & (top_ks < vocab)
    bad = np.flatnonzero((temperatures != 0) & ~bounded)
    if len(bad):
        i = int(bad[0])
        return f"request {i} samples with top_k={int(top_ks[i])}, outside (0, k_cap={k_cap}]"
    return None


class VocabParallelSampler:
    """The sharded device part of a step over static buffers sized for `max_rows`.

    Every tensor a collective or the sampler touches is allocated here once;
    bucket steps use leading slices, so on CUDA the NCCL collectives can be
    captured with the rest of the step, and on CPU the replayed step issues
    the same gloo collectives over the same buffers."""

    def __init__(
        self,
        shards: VocabShards,
        rank: int,
        *,
        max_rows: int,
        k_cap: int,
        max_stop_ids: int,
        sampler: SamplerConfig,
        full_logits: torch.Tensor,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.shards, self.rank, self.group, self.cfg = shards, rank, group, sampler
        self.start, self.size = shards.starts[rank], shards.sizes[rank]
        self.k_cap = k_cap
        self.num_candidates = candidate_count(k_cap, max_stop_ids, sampler.max_logprobs)
        if self.num_candidates >= shards.vocab:
            raise ValueError(
                f"k_cap={k_cap}: the candidate strategy needs C={self.num_candidates} < vocab={shards.vocab}"
            )
        tp, width = shards.tp, shards.max_size
        c, nb = self.num_candidates, shards.max_blocks
        device = full_logits.device
        if tuple(full_logits.shape) != (max_rows, shards.vocab) or full_logits.dtype != torch.float32:
            raise ValueError(f"full_logits: {tuple(full_logits.shape)} {full_logits.dtype}, expected {(max_rows, shards.vocab)} float32")
        f32 = dict(dtype=torch.float32, device=device)
        # [rows, V_max] fp32: the local logits, padded to the widest shard
        # so every rank sends equal-sized messages.
        self.local_logits = torch.zeros(max_rows, width, **f32)
        self.gathered_logits = torch.zeros(tp * max_rows, width, **f32)  # [tp * rows, V_max]
        self.full_logits = full_logits  # [rows, V] fp32, the engine's static logits
        # Candidate exchange: [rows, 2, C] int32 = (raw value bits, global id).
        self.local_candidates = torch.zeros(max_rows, 2, c, dtype=torch.int32, device=device)
        self.gathered_candidates = torch.zeros(tp * max_rows, 2, c, dtype=torch.int32, device=device)
        # Raw block masses: [rows, blocks_max] fp64, exact sums of the masses of exp(raw - raw max).
        self.local_blocks = torch.zeros(max_rows, nb, dtype=torch.float64, device=device)
        self.gathered_blocks = torch.zeros(tp * max_rows, nb, dtype=torch.float64, device=device)
        # Global block b lives at column b - first block of its rank in rank
        # r's slab [r, :blocks(r)]: a fixed index assembles the blocks in order.
        self.block_index = torch.as_tensor(
            np.concatenate([r * nb + np.arange(shards.blocks(r)) for r in range(tp)]), dtype=torch.int64, device=device
        )
        self.block_scratch = torch.zeros(max_rows, self.size, **f32)  # exp(raw - raw max) of the local row

    def static_tensors(self) -> dict[str, torch.Tensor]:
        names = (
            "local_logits", "gathered_logits", "local_candidates",
            "gathered_candidates", "local_blocks", "gathered_blocks", "block_index", "block_scratch",
        )
        return {f"vocab_parallel.{n}": getattr(self, n) for n in names}

    def exchanged_bytes(self, strategy: str, rows: int) -> int:
        """Bytes every rank receives from the step's collectives for `rows` rows."""
        tp = self.shards.tp
        if strategy == "gather":
            return tp * rows * self.gathered_logits.shape[1] * 4
        per_row = self.gathered_candidates[0].numel() * 4 + self.gathered_blocks[0].numel() * 8
        return tp * rows * per_row

    # -- logits -------------------------------------------------------------------

    def local_logits_of(self, hidden: torch.Tensor, weight: torch.Tensor, *, batch_invariant: bool, block_rows: int) -> torch.Tensor:
        """[rows, V_rank] fp32 LM-head logits of this rank's shard (a view of the static buffer)."""
        rows = hidden.shape[0]
        local = self.local_logits[:rows, : self.size]
        get_logits(hidden, weight, out=local, batch_invariant=batch_invariant, block_rows=block_rows)
        return local

    def all_gather_logits(self, rows: int) -> torch.Tensor:
        """Full [rows, V] logits on every rank from each rank's local logits."""
        gathered = self.gathered_logits[: self.shards.tp * rows]
        dist.all_gather_single(gathered, self.local_logits[:rows], group=self.group)
        full = self.full_logits[:rows]
        for r, (start, size) in enumerate(zip(self.shards.starts, self.shards.sizes)):
            full[:, start : start + size].copy_(gathered[r * rows : (r + 1) * rows, :size])
        return full

    # -- the two strategies -----------------------------------------------------

    def sample_gathered(self, rows: int, params: RowParams, out: SampleOutput) -> None:
        """Strategy "gather": the unsharded sampler over the all-gathered row."""
        sample(self.all_gather_logits(rows), params, self.cfg, out=out)

    def sample_candidates(self, rows_n: int, params: RowParams, out: SampleOutput) -> None:
        """Strategy "candidates": two small all-gathers, then the sampler's
        kept set, draw and greedy pick over the merged global top C.
        Capture-safe.

        The decisions are `engine.sampling.candidates.decide_on_candidates`:
        the sampler's definitions over candidates, which give its bits on
        every row they settle; the others are flagged in `out.needs_exact`."""
        tp, c, vocab = self.shards.tp, self.num_candidates, self.shards.vocab
        raw_local = self.local_logits[:rows_n, : self.size]  # [rows, V_rank] fp32
        rows = expand_rows(params, vocab)

        # Phase 1: local top C (padded with -inf / id V when the shard is smaller).
        local_c = min(c, self.size)
        values, ids = torch.topk(raw_local, local_c)
        send = self.local_candidates[:rows_n]
        send[:, 0].view(torch.float32).fill_(-math.inf)
        send[:, 1].fill_(vocab)
        send[:, 0, :local_c].view(torch.float32).copy_(values)
        send[:, 1, :local_c].copy_(ids + self.start)
        received = self.gathered_candidates[: tp * rows_n]
        dist.all_gather_single(received, send, group=self.group)
        merged = received.view(tp, rows_n, 2, c).permute(1, 2, 0, 3).reshape(rows_n, 2, tp * c)
        merged_raw = merged[:, 0].contiguous().view(torch.float32)  # [rows, tp * C]
        merged_ids = merged[:, 1].to(torch.int64)
        # The global top C in (raw desc, id asc) order.
        cand_raw, cand_ids, boundary_raw = order_candidates(merged_raw, merged_ids, c)  # [rows, C]
        valid, _, shift = suppression_and_shift(cand_raw, cand_ids, boundary_raw, rows)
        raw_max = cand_raw[:, 0]  # the row's largest logit, suppressed or not

        # Phase 2: this rank's raw block masses, then all blocks in order: the
        # raw logprobs' normaliser, summed over the unsharded sampler's blocks.
        blocks_send = self.local_blocks[:rows_n]
        blocks_send.zero_()
        scratch = torch.sub(raw_local, raw_max[:, None], out=self.block_scratch[:rows_n]).exp_()
        # A NaN or inf logit in a shard makes that shard's block mass NaN,
        # so every rank sees the row fail from the gathered masses.
        scratch.masked_fill_(~torch.isfinite(raw_local), math.nan)
        blocks_send[:, : self.shards.blocks(self.rank)].copy_(block_sums(scratch, vocab))
        got = self.gathered_blocks[: tp * rows_n]
        dist.all_gather_single(got, blocks_send, group=self.group)
        block_mass = got.view(tp, rows_n, -1).permute(1, 0, 2).reshape(rows_n, -1).index_select(1, self.block_index)
        log_z_raw = log_block_total(block_mass, vocab)  # [rows] f64

        d = decide_on_candidates(cand_raw, cand_ids, boundary_raw, valid, shift, rows, vocab)
        # Plain rows never reach this path (not eligible) except as bucket
        # padding, whose results are cut off: their draw over the candidates
        # keeps them in the vocabulary.
        # exp(raw - max) sums to >= 1 for a finite row: a non-finite total
        # means a non-finite logit. No unsuppressed candidate is left to the
        # exact path (C < V: a token outside the candidates may be free).
        finite = torch.isfinite(log_z_raw)
        token = torch.where(finite, d.token, PLACEHOLDER_TOKEN)

        # Raw logprobs: every token with a larger logit than a candidate is a
        # candidate, so the rank counts over candidates only. A token outside
        # them (a forced one) has no logit here: the exact path reports it.
        lse = raw_max.to(torch.float64) + log_z_raw
        lp, top_tie_in_tail = candidate_raw_logprobs(
            cand_raw, token, cand_raw, cand_ids, lse, out.top_ids.shape[1], True, ids=cand_ids
        )
        token_outside = ~(cand_ids == token[:, None]).any(-1)
        lp.write(out)
        out.tokens.copy_(token)
        out.needs_exact.copy_(d.unsettled | token_outside | top_tie_in_tail)
        out.error.zero_()
        fail_rows(out, ~finite, RowError.LOGITS_NOT_FINITE)

    # -- prompt logprobs ----------------------------------------------------------

    def prompt_logprobs(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        inputs: SamplerInputs,
        *,
        chunk_rows: int,
        batch_invariant: bool,
        block_rows: int,
    ) -> PromptRowResults:
        """engine.step.prompt_logprobs.compute_prompt_logprobs over a sharded head.

        Eager, outside the graph, in chunks of at most the static row count:
        each chunk's logits are all-gathered (both strategies; prompt rows
        need the whole row for logsumexp and rank, and they are rare), then
        the same arithmetic as the unsharded function gives the same bits."""
        rows_idx, targets, num_top = prompt_rows_of(inputs)
        results = PromptRowResults.allocate(targets, num_top, self.shards.vocab)
        chunk_rows = min(chunk_rows, self.local_logits.shape[0])
        device = weight.device
        for start in range(0, len(rows_idx), chunk_rows):
            stop = min(start + chunk_rows, len(rows_idx))
            hidden = gather(hidden_states, torch.as_tensor(rows_idx[start:stop], dtype=torch.int64).to(device))
            self.local_logits_of(hidden, weight, batch_invariant=batch_invariant, block_rows=block_rows)
            results.score(start, self.all_gather_logits(stop - start))  # [chunk, V] fp32
        return results
