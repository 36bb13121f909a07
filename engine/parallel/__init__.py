"""Beyond one device (torch.distributed: NCCL on GPUs, gloo on CPUs).

shard_heads     the single-device heads (torch sampler, Triton kernels) over a vocabulary
                shard, the logits exchange as their logits stage (`sharded_head`)
launch          a decode loop on ranks torchrun starts: the group, the seed base, the head
cp_broadcast    the driver's ledger, packed once and rebuilt on followers
vocab_parallel  LM-head shards, full-logit gather or candidate exchange (torch ops)
sharded_engine  StepEngine built with a vocab-parallel LM head (VocabParallelHead)
"""
from __future__ import annotations

from engine.parallel.shard_heads import ShardedKernelHead, ShardedLocalHead, sharded_head, vocab_shards
from engine.parallel.cp_broadcast import LedgerBroadcaster, StepPlan, batch_fingerprint, request_key
from engine.parallel.sharded_engine import ParallelConfig, ParallelStats, ShardedStepEngine, VocabParallelHead
from engine.parallel.vocab_parallel import STRATEGIES, VocabParallelSampler, VocabShards, candidate_count

__all__ = [
    "ShardedKernelHead",
    "ShardedLocalHead",
    "sharded_head",
    "vocab_shards",
    "LedgerBroadcaster",
    "StepPlan",
    "batch_fingerprint",
    "request_key",
    "ParallelConfig",
    "ParallelStats",
    "ShardedStepEngine",
    "VocabParallelHead",
    "STRATEGIES",
    "VocabParallelSampler",
    "VocabShards",
    "candidate_count",
]
