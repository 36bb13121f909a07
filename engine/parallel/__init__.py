"""Beyond one device (torch.distributed: NCCL on GPUs, gloo on CPUs).

cp_broadcast    the driver's ledger, packed once and rebuilt on followers
vocab_parallel  LM-head shards, full-logit gather or candidate exchange
sharded_engine  StepEngine built with a vocab-parallel LM head (VocabParallelHead)
"""
from __future__ import annotations

from engine.parallel.cp_broadcast import LedgerBroadcaster, StepPlan, batch_fingerprint, request_key
from engine.parallel.sharded_engine import ParallelConfig, ParallelStats, ShardedStepEngine, VocabParallelHead
from engine.parallel.vocab_parallel import STRATEGIES, VocabParallelSampler, VocabShards, candidate_count

__all__ = [
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
