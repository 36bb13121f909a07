"""The single-device heads over one rank's vocabulary shard: the exchange as one stage.

    lm head    this rank's [V_rank, H] shard x the gathered hidden rows -> exchange.local
    exchange   all-gather of every rank's local logits, then one copy per rank
               into its columns of `buffers.logits`                     -> [rows, V] f32
    stages     the unsharded head's own stages over the full rows: the Triton kernels
               of `KernelHead` (controls, sample, hidden check, verify) or the torch
               sampler of `LocalHead`, every control, both logprob modes and drafts

Each rank then samples the same full rows with the same code as one device, so its tokens
and logprobs are the unsharded engine's bit for bit, provided the shard's GEMM gives each
logit the bits the whole head's GEMM gives it (a dot product of one hidden row and one
weight row, whose summation order does not depend on which weight rows sit beside it:
`tests/test_shard_heads.py` checks it where the tests run; on CUDA the fused
`engine::lm_head_logits` keeps one tile configuration whatever V, while a cuBLAS choice
picks its kernel by shape and is not checked against the whole head). Every rank ends the step with
the same tokens, so ranks that schedule alike stay in lockstep without a broadcast.

What moves per step is the logits: (tp - 1) x rows x V_rank x 4 bytes received per rank
(`LogitsExchange.received_bytes`; 16.5 MB at 64 rows of V = 129280, tp = 2); in exchange
the stages are the single-device ones, with nothing of their own to keep exact, and a graph is 7 kernels (9 with drafts).

Not built yet: an exact exchange of per-shard summaries on the kernels. docs/contract.md
makes it possible: every cut is a threshold on z, and every sum (top-p's, the draw's, the
raw normaliser) is of integer masses, exact in any order, so shards may add theirs up.
Each rank would run the controls and sampling kernels over its own columns (the control
state's per-token columns from its shard start; `SHARD_ALIGN` keeps that on bitmask words)
and exchange per row, by row kind: greedy, each shard's maximum and its first index
(8 bytes); a plain draw, the maximum M, then each shard's kept mass (the draw lands in
the shard whose running mass passes u x total, shards in token-id order; 8 bytes); the
raw normaliser, each shard's integer mass sum (8 bytes); top-k within a cap C and the
top-N logprobs, each shard's top C as candidates (8C bytes), the cut then exact on them;
top-p without a bounded top-k, the radix passes' histograms (one all-reduce per pass).
A few hundred bytes per row for most rows instead of V_rank x 4, exact by construction.
The cost is the split of `engine::sample_rows` into a kernel per phase with a collective
between phases: the shape of the split sampler built for small buckets (issue 35, item 2),
its per-program partials merged across ranks instead of across programs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from engine.host.ledger import SamplerInputs
from engine.ops import gather, get_logits
from engine.step.engine_config import EngineConfig, EngineStats
from engine.step.kernel_head import KernelHead
from engine.step.lm_head import LocalHead, checked_head_weight
from engine.step.prompt_logprobs import PromptRowResults, prompt_rows_of
from engine.step.staging import StepArrays
from engine.step.static_buffers import StepBuffers


# Each shard starts on a 128-byte boundary of a logits row (32 fp32 columns): the exchange's
# copies into `buffers.logits` stay aligned. Nothing in the stages needs more.
SHARD_ALIGN = 32


@dataclass(frozen=True)
class VocabShards:
    """Which vocabulary rows each of `tp` ranks holds: contiguous runs of whole SHARD_ALIGN
    blocks, the first ranks one block more where they do not divide evenly (the last shard is
    never larger than the others and no rank is left empty)."""

    vocab: int
    tp: int
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def max_size(self) -> int:
        return max(self.sizes)

    def shard(self, weight: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s rows of a full [V, H] LM head (a view)."""
        if weight.shape[0] != self.vocab:
            raise ValueError(f"weight: {weight.shape[0]} rows, the shards cover vocab={self.vocab}")
        return weight[self.starts[rank] : self.starts[rank] + self.sizes[rank]]


def vocab_shards(vocab: int, tp: int) -> VocabShards:
    """The `VocabShards` of `vocab` tokens over `tp` ranks. **Raises** ValueError when there
    are fewer SHARD_ALIGN blocks than ranks."""
    if tp < 1:
        raise ValueError(f"tp={tp}: must be >= 1")
    blocks = -(-vocab // SHARD_ALIGN)
    if blocks < tp:
        raise ValueError(f"vocab={vocab}: {blocks} blocks of {SHARD_ALIGN} tokens cannot feed tp={tp} ranks")
    counts = [blocks // tp + (r < blocks % tp) for r in range(tp)]
    ends = np.cumsum(counts) * SHARD_ALIGN
    starts = tuple(int(e) for e in np.concatenate([[0], ends[:-1]]))
    sizes = tuple(min(int(e), vocab) - a for a, e in zip(starts, ends))
    return VocabShards(vocab, tp, starts, sizes)


@dataclass
class ExchangeStats:
    steps: int = 0  # steps whose graph ran the exchange
    received_bytes: int = 0  # logits bytes this rank received from the others, summed (prompt rows included)


class LogitsExchange:
    """Rank `rank`'s local logits [rows, V_max] f32 to every rank's [rows, V] f32.

    Every shard is padded to the widest one (`VocabShards.max_size`), so each rank sends
    messages of one size and the local logits are one contiguous buffer. The buffers are
    allocated once for `max_rows`; a step uses their leading rows, so on CUDA the NCCL
    all-gather is captured with the rest of the bucket's graph."""

    def __init__(self, shards: VocabShards, rank: int, max_rows: int, device: torch.device,
                 group: dist.ProcessGroup | None) -> None:
        self.shards, self.rank, self.group = shards, rank, group
        width = shards.max_size
        self.local = torch.zeros(max_rows, width, dtype=torch.float32, device=device)  # [max_rows, V_max]
        self.gathered = torch.zeros(shards.tp * max_rows, width, dtype=torch.float32, device=device)  # [tp * max_rows, V_max]

    @property
    def max_rows(self) -> int:
        return self.local.shape[0]

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return {"exchange.local": self.local, "exchange.gathered": self.gathered}

    def received_bytes(self, rows: int) -> int:
        """What one exchange of `rows` rows brings this rank from the others."""
        return (self.shards.tp - 1) * rows * self.shards.max_size * 4

    def all_gather(self, rows: int, out: torch.Tensor) -> torch.Tensor:
        """Every rank's `local[:rows]` into `out` [rows, V] f32, shard r at its columns
        `starts[r] : starts[r] + sizes[r]`. A collective: every rank calls it together."""
        tp, width = self.shards.tp, self.shards.max_size
        gathered = self.gathered[: tp * rows]
        dist.all_gather_single(gathered, self.local[:rows], group=self.group)
        slabs = gathered.view(tp, rows, width)
        for r, (start, size) in enumerate(zip(self.shards.starts, self.shards.sizes)):
            out[:, start : start + size].copy_(slabs[r, :, :size])
        return out


def padded_shard(lm_head_shard: object, shards: VocabShards, rank: int, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s shard [V_rank, H] checked, padded with zero rows to [V_max, H] (the
    padding's logits are never copied out). **Raises** ValueError naming `lm_head_shard`."""
    weight = checked_head_weight(lm_head_shard, device, "lm_head_shard")
    if weight.shape[0] != shards.sizes[rank]:
        raise ValueError(
            f"lm_head_shard: shape {tuple(weight.shape)}, rank {rank} of tp={shards.tp} holds "
            f"{shards.sizes[rank]} vocabulary rows (vocab_shards({shards.vocab}, {shards.tp}))"
        )
    if weight.shape[0] == shards.max_size:
        return weight
    padding = weight.new_zeros(shards.max_size - weight.shape[0], weight.shape[1])
    return torch.cat([weight, padding])


class ShardOfHead:
    """What a shard head adds to its single-device head (the class after this one in its
    bases): the shard padded to the widest one as its weight, the whole vocabulary as its
    `vocab_size` (the engine's buffers, controls and checks span it), the exchange, its
    counters, the prompt logprobs over exchanged rows. The heads' `logits` stage is their own."""

    def __init__(self, lm_head_shard: torch.Tensor, vocab_size: int, config: EngineConfig,
                 group: dist.ProcessGroup | None) -> None:
        self.rank, self.tp, self.group = dist.get_rank(group), dist.get_world_size(group), group
        self.shards = vocab_shards(vocab_size, self.tp)
        super().__init__(padded_shard(lm_head_shard, self.shards, self.rank, config.resolved_device()), config)
        self.vocab_size = vocab_size
        self.stats = ExchangeStats()
        self.exchange: LogitsExchange | None = None

    def attach(self, buffers: StepBuffers) -> None:
        super().attach(buffers)
        self.exchange = LogitsExchange(self.shards, self.rank, buffers.max_rows, buffers.logits.device, self.group)
        # NCCL builds its communicator on a group's first collective, which must not be
        # inside a graph capture: one exchange of a row now, on every rank (they build
        # their engines together), into the scratch the steps overwrite.
        self.exchange.all_gather(1, buffers.logits[:1])

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return {**super().static_tensors(), **self.exchange.static_tensors()}

    def plan(self, inputs: SamplerInputs, arrays: StepArrays, rows: int, stats: EngineStats) -> None:
        self.stats.steps += 1
        self.stats.received_bytes += self.exchange.received_bytes(rows)
        super().plan(inputs, arrays, rows, stats)

    def prompt_logprobs(self, hidden_states: torch.Tensor, inputs: SamplerInputs) -> PromptRowResults:
        # Top-k-space mode (docs/contract.md §2.1; the torch head only): a target outside the top-k reads -inf.
        top_k = inputs.top_ks if self.config.top_k_space_verify else None
        return sharded_prompt_logprobs(self, hidden_states, inputs, top_k)


class ShardedLocalHead(ShardOfHead, LocalHead):
    """`LocalHead` (the torch sampler) over this rank's shard: its logits stage is the
    shard's GEMM and the exchange; every stage and control is `LocalHead`'s."""

    def logits(self, bucket: int) -> None:
        """The shard's logits of the gathered hidden rows, then the exchange into `buffers.logits`."""
        b = self.buffers
        rows = b.rows_for(bucket)
        get_logits(b.hidden[:rows], self.weight, out=self.exchange.local[:rows], batch_invariant=self.config.batch_invariant,
                   block_rows=self.config.block_rows, kernel=self.logits_kernel)
        self.exchange.all_gather(rows, b.logits[:rows])


class ShardedKernelHead(ShardOfHead, KernelHead):
    """`KernelHead` (the fused Triton kernels, one graph per bucket) over this rank's
    shard: its logits stage is the shard's GEMM (the gather fused in on CUDA) and the
    exchange; the controls, sample, hidden-check and verify kernels are `KernelHead`'s. The
    sampler keeps one launch: the exchange's kernels leave no room for a split one's 9. Its
    LM head sees one shard: no row maxima for the controls kernel (the sampler's logprob
    pass sums the raw masses)."""

    split_sampler = False
    raw_max_keyed = False

    def logits(self, bucket: int) -> None:
        """The shard's logits of the bucket's sample rows, gathered from the source, then the
        exchange into `buffers.logits`."""
        b = self.buffers
        rows = b.rows_for(bucket)
        self.row_logits(b.source, b.inputs.selected_token_indices[:rows], self.exchange.local[:rows])
        self.exchange.all_gather(rows, b.logits[:rows])


ShardHead = ShardedLocalHead | ShardedKernelHead


def sharded_head(lm_head_shard: torch.Tensor, vocab_size: int, config: EngineConfig,
                 group: dist.ProcessGroup | None = None) -> ShardHead:
    """The head of this rank's shard (`vocab_shards(vocab_size, tp).shard(weight, rank)`):
    `ShardedKernelHead` where `config.resolved_kernels()` is "triton", else `ShardedLocalHead`;
    `StepEngine(sharded_head(...), config)` is then the engine of this rank."""
    if config.resolved_kernels() == "triton":
        return ShardedKernelHead(lm_head_shard, vocab_size, config, group)
    return ShardedLocalHead(lm_head_shard, vocab_size, config, group)


def sharded_prompt_logprobs(head: ShardHead, hidden_states: torch.Tensor, inputs: SamplerInputs,
                            top_k: np.ndarray | None) -> PromptRowResults:
    """`engine.step.prompt_logprobs.compute_prompt_logprobs` over a sharded head: eager, in
    chunks of at most the exchange's rows, each chunk's shard logits exchanged into full rows
    and scored by the same arithmetic. Every rank runs the same chunks (the inputs are the
    same on every rank). `top_k` [reqs] int or None: top-k-space mode per request."""
    rows_idx, targets, num_top = prompt_rows_of(inputs)
    if len(targets) and targets.max() >= head.vocab_size:
        bad = int(np.flatnonzero(targets >= head.vocab_size)[0])
        raise ValueError(f"prompt token {int(targets[bad])} is outside the vocabulary ({head.vocab_size})")
    row_top_k = None if top_k is None else np.repeat(np.asarray(top_k), inputs.prompt_row_counts)
    results = PromptRowResults.allocate(targets, num_top, head.vocab_size)
    exchange, device = head.exchange, head.weight.device
    chunk_rows = min(head.config.prompt_logprobs_chunk_rows, exchange.max_rows)
    full = torch.empty(chunk_rows, head.vocab_size, dtype=torch.float32, device=device)  # [chunk, V]
    for start in range(0, len(rows_idx), chunk_rows):
        stop = min(start + chunk_rows, len(rows_idx))
        n = stop - start
        hidden = gather(hidden_states, torch.as_tensor(rows_idx[start:stop], dtype=torch.int64).to(device))
        get_logits(hidden, head.weight, out=exchange.local[:n], batch_invariant=head.config.batch_invariant,
                   kernel=head.logits_kernel)
        exchange.all_gather(n, full[:n])
        head.stats.received_bytes += exchange.received_bytes(n)
        k = None if row_top_k is None else torch.as_tensor(row_top_k[start:stop], dtype=torch.int64).to(device)
        results.score(start, full[:n], k)
    return results
