"""The batch-invariant model's kernels, probed where it runs (`engine.invariance`).

GEMM kernels pick their blocking (and so their summation order) from the matrix shape, so
in batch-invariant mode every projection runs one GEMM per fixed `[row_block, K]` row
block. That one call shape gives every row one summation order is probed when the model is
built: each projection gets the first of oneDNN's and MKL's packed GEMMs (when the weights
are packed) and plain `mm`, at `row_block` rows and then at each smaller divisor of it,
that holds here; the attention tiles' two bmm shapes are probed too.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from engine.invariance import bmm_tiles_invariant, choose_block_gemm, short_calls_from, warn_not_invariant
from engine.models.llama_weights import PROJECTIONS, LayerWeights, LlamaWeights
from engine.ops import BlockGemm, block_gemm


@dataclass
class InvariantKernels:
    """Every layer with its projections on the block GEMM the probe chose, and what a step pads to."""

    layers: list[LayerWeights]
    gemm_kernels: dict[str, str]  # each projection's verified block GEMM, e.g. {"qkv": "onednn[16]"}
    # Per projection: its block rows and the fewest rows a verified short call may have
    # (`short_calls_from`); `step_rows` pads a step only as far as they need.
    short_calls: list[tuple[int, int]]
    verified: bool  # every projection and both attention tile shapes hold

    @classmethod
    def probe(cls, weights: LlamaWeights, *, head_dim: int, row_block: int, key_block: int, packed_weights: bool,
              dtype: torch.dtype, device: torch.device) -> InvariantKernels:
        """Pick every projection's block GEMM and probe the attention tiles (`[row_block,
        head_dim] x [head_dim, key_block]` scores, then `[row_block, key_block] x [key_block,
        head_dim]`); warns (and says `verified=False`) when a projection or a tile shape has
        nothing that holds. The forward pads a step to whole `row_block` blocks, which the
        smaller divisors split evenly, or to a last block of verified short calls (`step_rows`)."""
        kernels = ("onednn", "mkl_packed", "mm") if packed_weights else ("mm",)
        sizes = [rows for rows in range(row_block, 0, -1) if row_block % rows == 0]

        def gemm_of(layer: int, name: str, kernel: str, rows: int) -> BlockGemm | None:
            if kernel == "mm":
                return block_gemm(getattr(weights.layers[layer], name), kernel, rows)
            packed = weights.packed_layers(kernel, rows)
            return None if packed is None else getattr(packed[layer], name)

        failed = []
        chosen: dict[str, BlockGemm] = {}
        for name in PROJECTIONS:  # every layer has layer 0's shapes: one probe per projection
            gemm, holds = choose_block_gemm(gemm_of(0, name, kernel, rows) for rows in sizes for kernel in kernels)
            chosen[name] = gemm
            if not holds:
                failed.append(f"{name} {tuple(gemm.weight.shape)}")
        # Every layer's projection on the kernel chosen for it, grouping as many whole blocks
        # per call as the probe verified (`long_calls_upto`: a 218-token prefill runs 13 blocks
        # in calls of 8, 4 and 1 where it may).
        layers = [
            LayerWeights(**{f.name: replace(gemm_of(n, f.name, chosen[f.name].kernel, chosen[f.name].block_rows),
                                            long_blocks=chosen[f.name].long_blocks)
                            if f.name in PROJECTIONS else getattr(layer, f.name)
                            for f in fields(LayerWeights)})
            for n, layer in enumerate(weights.layers)
        ]
        for shape in ((row_block, head_dim, key_block), (row_block, key_block, head_dim)):
            if not bmm_tiles_invariant(*shape, dtype, device):
                failed.append(f"attention tiles bmm [{shape[0]}, {shape[1]}] x [{shape[1]}, {shape[2]}]")
        if failed:
            warn_not_invariant(f"the Llama model ({dtype} on {device}): " + ", ".join(failed))
        return cls(layers=layers, gemm_kernels={name: gemm.name for name, gemm in chosen.items()},
                   short_calls=[(gemm.block_rows, short_calls_from(gemm)) for gemm in chosen.values()],
                   verified=not failed)

    def step_rows(self, total: int) -> int:
        """The rows a step of `total` tokens runs, padding included: the fewest at or above
        `total` whose last partial block (if any) is, for every projection, a short call the
        probe verified (`short_calls_from`: a projection with none verified pads to its
        whole blocks)."""
        rows = total
        while not all(rows % block == 0 or rows % block >= fewest for block, fewest in self.short_calls):
            rows += 1
        return rows
