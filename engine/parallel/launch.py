"""A decode loop over ranks launched by torchrun: the group, the seeds, this rank's head.

    torchrun --nproc-per-node 2 -m engine demo --tp 2             # gloo on CPU, NCCL on GPUs
    torchrun --nnodes 2 --node-rank R --master-addr HOST --master-port PORT \\
             --nproc-per-node 8 -m engine demo --tp 16             # several machines: torchrun's own flags
    LLM("tiny", tensor_parallel_size=2)                            # in a script torchrun runs

Every rank runs the same program over the same requests (SPMD): the whole model on each
rank, the LM head split by vocabulary (`engine.parallel.shard_heads`). Each rank's step
samples the same full logits rows with the same seeds, so every rank emits the same
tokens, its loop schedules the same next step, and the ranks stay in lockstep with no
other message than the step's exchange. What must agree before the first step: the group
(one rank per shard) and the seed base (`LoopConfig.seed_base`: fresh seeds drawn on one
rank would differ on the others, so rank 0 draws the base and every rank takes it).

On GPUs each bucket's graph captures its NCCL all-gather (NCCL 2.9 or later; the head
runs one exchange when it is built, so the communicator exists before any capture).
Across machines that holds where NCCL's transport can be captured (GPUDirect RDMA);
where it cannot, run with `EngineConfig(use_graphs=False)` (the demo's `--no-graphs`).
Not yet run on GPUs.
"""
from __future__ import annotations

import atexit
import os
import secrets

import torch
import torch.distributed as dist

from engine.parallel.shard_heads import ShardHead, sharded_head, vocab_shards
from engine.step.engine_config import EngineConfig

# What torchrun sets for each rank it starts (the group's rendezvous and this rank's place).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def join_group(tp: int, device: torch.device) -> None:
    """The default torch.distributed group of `tp` ranks: the caller's own when one is
    initialised, else the one torchrun's environment describes (NCCL for a CUDA engine,
    each rank on GPU `LOCAL_RANK`, made the current device: join before anything is put on
    "cuda"; gloo on CPU). **Raises** ValueError when there is no group and no torchrun
    environment, or when the group has another size than `tp`."""
    if not dist.is_initialized():
        missing = [name for name in TORCHRUN_ENV if name not in os.environ]
        if missing:
            raise ValueError(f"tensor_parallel_size={tp}: no torch.distributed group, and {', '.join(missing)} "
                             f"unset: launch every rank with torchrun --nproc-per-node {tp} ...")
        if device.type == "cuda":
            if device.index is not None:
                raise ValueError(f"device={str(device)!r} with tensor_parallel_size={tp}: give 'cuda' without an "
                                 "index; each rank takes GPU LOCAL_RANK")
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        # The group this made is left at exit: a process that exits holding it may abort in its
        # communication threads' teardown ("terminate called without an active exception").
        atexit.register(_leave_group)
    world = dist.get_world_size()
    if world != tp:
        raise ValueError(f"tensor_parallel_size={tp}: the torch.distributed group has {world} ranks; "
                         f"start {tp} ranks (torchrun --nproc-per-node {tp}) or set tensor_parallel_size={world}")


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agreed_seed_base(seed_base: int | None, device: torch.device) -> int:
    """The seed base every rank uses (`LoopConfig.seed_base`): `seed_base` when set, else one
    rank 0 draws from the OS's entropy and broadcasts (each request's seed is then derived
    from it and the request id, the same on every rank). A collective: every rank calls it
    together."""
    if seed_base is not None:
        return seed_base
    # NCCL moves only device tensors; gloo only host ones.
    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    base = torch.tensor([secrets.randbits(63) if dist.get_rank() == 0 else 0], dtype=torch.int64, device=where)
    dist.broadcast(base, 0)
    return int(base.item())


def rank_head(lm_head_weight: torch.Tensor, config: EngineConfig) -> ShardHead:
    """This rank's head of the whole `lm_head_weight` [V, H]: its shard's rows
    (`vocab_shards(V, world)`), the single-device stages after the exchange."""
    vocab = lm_head_weight.shape[0]
    shards = vocab_shards(vocab, dist.get_world_size())
    return sharded_head(shards.shard(lm_head_weight, dist.get_rank()), vocab, config)
