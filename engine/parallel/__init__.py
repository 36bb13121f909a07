"""Beyond one device (torch.distributed: NCCL on GPUs, gloo on CPUs).

shard_heads     the single-device heads (torch sampler, Triton kernels) over a vocabulary
                shard, the logits exchange as their logits stage (`sharded_head`)
launch          a decode loop on ranks torchrun starts: the group, the seed base, the head
"""
from __future__ import annotations

from engine.parallel.shard_heads import ShardedKernelHead, ShardedLocalHead, VocabShards, sharded_head, vocab_shards

__all__ = ["ShardedKernelHead", "ShardedLocalHead", "VocabShards", "sharded_head", "vocab_shards"]
