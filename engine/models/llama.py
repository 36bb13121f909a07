"""A Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings) with a per-request KV cache.

Two execution modes share every weight and the cache:

- fast (default): one GEMM per projection over all scheduled tokens;
  `scaled_dot_product_attention` once for all single-token (decode) requests,
  over their cache slots alone (a view when they sit in slots 0..n-1 in batch order, else
  a copy of just those slots), and per request for prefill chunks.
- batch-invariant (`batch_invariant=True`): a token's hidden state is bit-identical
  whatever else shares the step and however its prompt was chunked. GEMM
  kernels pick their blocking (and so their summation order) from the matrix
  shape, so every linear layer runs one GEMM per fixed `[row_block, K]` row block
  (the token rows are zero-padded until the last block is whole or a call of a size whose
  bits the probe verified against the whole block's: `_step_rows`). That one call shape
  gives every row one summation order is probed when the model is built
  (`engine.invariance`); a projection whose kernel fails falls back to another kernel or
  to a block size dividing `row_block`, and `batch_invariant_verified` says whether the
  whole promise (projections and attention tiles) holds. Attention works on fixed `[row_block, key_block]`
  score tiles aligned to absolute cache positions: the softmax maximum is exact in
  any order, per-tile sums have a fixed length, and tiles are folded in cache
  order, so key tiles past a query's position add exact zeros. Requests with
  at most one query tile of new tokens run those tiles as items of shared calls.
  RMSNorm uses sqrt + divide (correctly rounded in vector and scalar code alike)
  instead of rsqrt.

On CPU the projections run on prepacked copies of their weights: oneDNN's in fast mode
from 2 rows on (one call per projection for any row count; oneDNN follows the CPU's ISA on
any vendor; a one-row step runs `engine.ops.one_row_linear`),
the first of oneDNN's and MKL's that the probe finds invariant in batch-invariant mode.
The KV cache starts uninitialised and is zeroed only where attention reads masked
padding.

The config and the weights (Hugging Face layout) are engine/models/llama_weights.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.nn.functional as F

from engine.invariance import bmm_tiles_invariant, choose_block_gemm, short_calls_from, warn_not_invariant
from engine.models.llama_weights import PROJECTIONS, LayerWeights, LlamaConfig, LlamaWeights, random_weights
from engine.models.protocol import ForwardBatch, check_forward_args
from engine.ops import BlockGemm, block_gemm, one_row_linear, onednn_linear, upload


# The fast mode's GEMMs from FAST_PACKED_FROM rows on: oneDNN's prepacked weights laid out
# for 16-row GEMMs, one call per projection for any row count (oneDNN dispatches on the ISA:
# AVX2, AVX-512, AMX; not on the vendor). A one-row step runs `one_row_linear` (slices of
# the weight as matrix-vector products side by side). SmolLM2's projections, all 30 layers,
# fp32, 2 AMD EPYC cores: 1 row 17 ms that way against 24 ms on oneDNN and 41 ms through
# F.linear; 2 and 3 rows 28 and 23 ms on oneDNN against 74 and 86 ms through F.linear (which
# an earlier rule gave every step under 4 rows: on 2 Xeon cores F.linear had taken 16.7 ms
# for one row against oneDNN's 23.7).
FAST_PACK_ROWS = 16
FAST_PACKED_FROM = 2


@dataclass(frozen=True)
class _DecodePlan:
    """One-call attention for a group of requests with few new tokens (see `LlamaModel._decode_plan`)."""

    members: np.ndarray  # [num_reqs] bool: the batch's requests in the group
    token_rows: torch.Tensor | None  # the group's token rows in the batch; None: every row
    # The group's cache slots in batch order, gathered from the cache for the call; None when
    # they are slots 0..span-1 in batch order, so the keys are a view of the cache.
    gather: torch.Tensor | None
    # Invariant mode, per group token: its row in the [span * rows] queries and attention
    # output (member index * rows + its index among its request's new tokens). None in fast
    # mode, where a member has one query row, the member's own.
    out_rows: torch.Tensor | None
    span: int  # the group's requests (attention's batch)
    rows: int  # most new tokens of a group request
    keys: int  # key positions read per request (fast: the longest context; invariant: whole key tiles)
    visible: torch.Tensor  # mask broadcast against the scores (fast: additive; invariant: boolean)
    query_tiles: int = 1  # invariant mode: query tiles per (request, kv head), for group heads x rows

    def group_cache(self, cache: torch.Tensor) -> torch.Tensor:
        """The group's `[span, keys, kv_heads, d]` cache entries in batch order: a view where
        the group sits in slots 0..span-1 in batch order, else a gathered copy of its slots
        only (a slot outside the group is never read, however high the group's slot numbers)."""
        if self.gather is None:
            return cache[: self.span, : self.keys]
        return cache[:, : self.keys].index_select(0, self.gather)


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class LlamaModel:
    """The decoder plus its KV cache: `[num_slots, cache_len, kv_heads, head_dim]` per layer for K and V.

    Implements `engine.models.protocol.CausalLM`. `max_context` bounds `seqlen_k`
    (defaults to the config's `max_position`).
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: LlamaWeights,
        *,
        num_slots: int = 8,
        max_context: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
        row_block: int = 16,
        key_block: int = 64,
        packed_weights: bool = True,
    ) -> None:
        max_context = config.max_position if max_context is None else max_context
        if not 1 <= max_context <= config.max_position:
            raise ValueError(f"max_context must be in [1, {config.max_position}], got {max_context}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if row_block < 1 or key_block < 1:
            raise ValueError(f"row_block and key_block must be >= 1, got {row_block} and {key_block}")
        self.config = config
        self.weights = weights.to(device, dtype)
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.row_block = row_block
        self.key_block = key_block
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.max_context = max_context
        self.eos_token_id = config.eos_token_id
        self.stop_token_ids = config.stop_token_ids
        self.num_slots = num_slots

        # Batch-invariant attention reads whole key tiles, so the cache is rounded up to a tile.
        self.cache_len = _ceil_to(max_context, key_block) if batch_invariant else max_context
        # Prepacked weights (see `LlamaWeights.packed_layers`; each packing holds one more copy
        # of the projections): the fast mode runs its GEMMs of FAST_PACKED_FROM rows or more on
        # oneDNN's (FAST_PACK_ROWS) where it applies; the batch-invariant mode tries oneDNN's,
        # then MKL's, for its row blocks.
        self.packed_weights = packed_weights and self.device.type == "cpu"
        self._fast_layers = self.weights.layers
        if self.packed_weights and not batch_invariant:
            self._fast_layers = self.weights.packed_layers("onednn", FAST_PACK_ROWS) or self.weights.layers
        # Batch-invariant mode: each projection's verified block GEMM, e.g. {"qkv": "onednn[16]"}.
        self.gemm_kernels: dict[str, str] = {}
        self._invariant_layers: list[LayerWeights] = []
        self._short_calls: list[tuple[int, int]] = []  # batch-invariant mode, see `_step_rows`
        self.batch_invariant_verified = batch_invariant and self._probe_invariant_kernels()
        kv_shape = (num_slots, self.cache_len, config.num_kv_heads, config.head_dim)
        # Uninitialised on purpose: positions are zeroed only as attention comes to read them
        # (`_make_finite`), so cache memory no request reaches is never committed.
        self.k_cache = [torch.empty(kv_shape, device=self.device, dtype=dtype) for _ in range(config.num_layers)]
        self.v_cache = [torch.empty(kv_shape, device=self.device, dtype=dtype) for _ in range(config.num_layers)]
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._slot_in_use = np.zeros(num_slots, dtype=bool)
        # Positions below this hold finite values (written, copied or zeroed); see `_make_finite`.
        self._finite_upto = np.zeros(num_slots, dtype=np.int64)

        half = config.head_dim // 2
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / config.head_dim))
        angles = torch.arange(self.cache_len, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [cache_len, d/2]
        cos, sin = angles.cos().to(device=self.device, dtype=dtype), angles.sin().to(device=self.device, dtype=dtype)
        self._rope_cos = torch.cat([cos, cos], dim=-1)  # [cache_len, d]
        self._rope_sin = torch.cat([-sin, sin], dim=-1)

    def _probe_invariant_kernels(self) -> bool:
        """Pick every projection's block GEMM (`engine.invariance`): the first of oneDNN's
        and MKL's packed GEMMs (when `packed_weights`) and plain `mm`, at `row_block` rows and then at each smaller
        divisor of it (the forward pads to whole `row_block` blocks, which they split
        evenly, or to a last block of verified short calls: `_step_rows`), that is
        batch-invariant here; probe the attention tiles' two bmm shapes.
        Builds `_invariant_layers` and `gemm_kernels`; warns and returns False when a
        projection or a tile shape has nothing that holds."""
        kernels = ("onednn", "mkl_packed", "mm") if self.packed_weights else ("mm",)
        sizes = [rows for rows in range(self.row_block, 0, -1) if self.row_block % rows == 0]

        def gemm_of(layer: int, name: str, kernel: str, rows: int) -> BlockGemm | None:
            if kernel == "mm":
                return block_gemm(getattr(self.weights.layers[layer], name), kernel, rows)
            packed = self.weights.packed_layers(kernel, rows)
            return None if packed is None else getattr(packed[layer], name)

        failed = []
        chosen: dict[str, BlockGemm] = {}
        for name in PROJECTIONS:  # every layer has layer 0's shapes: one probe per projection
            gemm, holds = choose_block_gemm(gemm_of(0, name, kernel, rows) for rows in sizes for kernel in kernels)
            chosen[name] = gemm
            self.gemm_kernels[name] = gemm.name
            if not holds:
                failed.append(f"{name} {tuple(gemm.weight.shape)}")
        # Every layer's projection on the kernel chosen for it, grouping as many whole blocks
        # per call as the probe verified (`long_calls_upto`: a 218-token prefill runs 13 blocks
        # in calls of 8, 4 and 1 where it may).
        self._invariant_layers = [
            LayerWeights(**{f.name: replace(gemm_of(n, f.name, chosen[f.name].kernel, chosen[f.name].block_rows),
                                            long_blocks=chosen[f.name].long_blocks)
                            if f.name in PROJECTIONS else getattr(layer, f.name)
                            for f in fields(LayerWeights)})
            for n, layer in enumerate(self.weights.layers)
        ]
        # Per projection: its block rows and the fewest rows a verified short call may have
        # (`short_calls_from`); `_step_rows` pads a step only as far as they need.
        self._short_calls = [(gemm.block_rows, short_calls_from(gemm)) for gemm in chosen.values()]
        qb, kb, d = self.row_block, self.key_block, self.config.head_dim
        for shape in ((qb, d, kb), (qb, kb, d)):  # scores q k^T, then probabilities x values
            if not bmm_tiles_invariant(*shape, self.dtype, self.device):
                failed.append(f"attention tiles bmm [{shape[0]}, {shape[1]}] x [{shape[1]}, {shape[2]}]")
        if failed:
            warn_not_invariant(f"the Llama model ({self.dtype} on {self.device}): " + ", ".join(failed))
        return not failed

    def _step_rows(self, total: int) -> int:
        """Batch-invariant mode: the rows a step of `total` tokens runs, padding included: the
        fewest at or above `total` whose last partial block (if any) is, for every projection,
        a short call the probe verified (`short_calls_from`: a projection with none verified
        pads to its whole blocks)."""
        rows = total
        while not all(rows % block == 0 or rows % block >= fewest for block, fewest in self._short_calls):
            rows += 1
        return rows

    @classmethod
    def random(cls, config: LlamaConfig, seed: int, **kwargs: object) -> LlamaModel:
        return cls(config, random_weights(config, seed), **kwargs)  # type: ignore[arg-type]

    def with_options(self, **kwargs: object) -> LlamaModel:
        """A new model (fresh, empty cache) on the same weights with other constructor options."""
        options = dict(
            num_slots=self.num_slots, max_context=self.max_context, device=self.device, dtype=self.dtype,
            batch_invariant=self.batch_invariant, row_block=self.row_block, key_block=self.key_block,
            packed_weights=self.packed_weights,
        )
        options.update(kwargs)
        return LlamaModel(self.config, self.weights, **options)  # type: ignore[arg-type]

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [V, H]
        return self.weights.embed

    # ---- KV-cache slots -------------------------------------------------------------------

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} KV-cache slots are in use")
        slot = self._free_slots.pop()
        self._slot_in_use[slot] = True
        return slot

    def _is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and bool(self._slot_in_use[slot])

    def free_slot(self, slot: int) -> None:
        if not self._is_allocated(slot):
            raise ValueError(f"KV-cache slot {slot} is not allocated")
        self._slot_in_use[slot] = False
        self._free_slots.append(slot)

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy the keys and values of cache positions `[0, length)` from one slot to another.

        The decode loop's prefix sharing: a request whose prompt starts like one already
        prefilled takes those positions instead of computing them. A position's keys and
        values depend only on the tokens up to it, so (in batch-invariant mode, bit for bit)
        the copy equals what prefilling the destination would have written.
        """
        for name, slot in (("src_slot", src_slot), ("dst_slot", dst_slot)):
            if not self._is_allocated(slot):
                raise ValueError(f"copy_prefix: {name}={slot} is not an allocated KV-cache slot")
        if src_slot == dst_slot:
            raise ValueError(f"copy_prefix: src_slot and dst_slot are both {src_slot}")
        if not 0 <= length <= self.max_context:
            raise ValueError(f"copy_prefix: length={length} must be in [0, {self.max_context}]")
        for cache in (*self.k_cache, *self.v_cache):
            cache[dst_slot, :length] = cache[src_slot, :length]

    _ZERO_GRAIN = 256  # positions zeroed at a time by `_make_finite`

    def _make_finite(self, batch: ForwardBatch, plan: _DecodePlan | None) -> None:
        """Zero the cache positions this step's attention reads past each request's context.

        Masked padding (up to the longest context of a one-call decode, or to the end of the
        last key tile in batch-invariant mode) gets probability 0, but uninitialised memory
        there could hold NaN, and 0 * NaN is NaN. A slot is zeroed from its finite prefix
        upwards in grains of `_ZERO_GRAIN` positions, so this runs rarely and untouched cache
        memory is never committed. The zeroed range starts at or past `seqlen_k`, clear of
        the positions this step writes."""
        seqlens_k = batch.seqlens_k
        if self.batch_invariant:
            needed = -(-seqlens_k // self.key_block) * self.key_block  # whole key tiles
        else:
            needed = seqlens_k.copy()  # per-request attention reads only the context
        if plan is not None:
            needed[plan.members] = plan.keys  # padded to the group's longest context
        lo = np.maximum(self._finite_upto[batch.slots], seqlens_k)
        hi = np.minimum(-(-needed // self._ZERO_GRAIN) * self._ZERO_GRAIN, self.cache_len)
        for slot, start, end in zip(batch.slots[lo < needed], lo[lo < needed], hi[lo < needed]):
            for cache in (*self.k_cache, *self.v_cache):
                cache[slot, start:end].zero_()
        self._finite_upto[batch.slots] = np.maximum(lo, np.where(lo < needed, hi, lo))

    # ---- forward ------------------------------------------------------------------------------

    # no_grad, not inference_mode: callers may update the returned rows in place afterwards.
    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        batch: ForwardBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H]
        check_forward_args(self, token_ids, positions, batch, out)
        for i, slot in enumerate(batch.slots.tolist()):
            if not self._is_allocated(slot):
                raise ValueError(f"request {i}: KV-cache slot {slot} is not allocated")
        cfg = self.config
        total = batch.num_tokens
        if self.batch_invariant:
            rows = self._step_rows(total)
            layers = self._invariant_layers
        else:
            rows = total
            layers = self._fast_layers if total >= FAST_PACKED_FROM else self.weights.layers
        token_ids = token_ids.to(self.device)
        positions = positions.to(self.device)
        if rows > total:
            # Padding rows run through every layer (their results are dropped) so each GEMM sees
            # whole row blocks; token 0 at position 0 keeps them finite.
            pad = torch.zeros(rows - total, dtype=torch.int64, device=self.device)
            token_ids, positions = torch.cat([token_ids, pad]), torch.cat([positions, pad])

        offsets = batch.token_offsets
        # Flat index into the [num_slots * cache_len] view of a layer's cache for every new token.
        cache_rows = np.repeat(batch.slots * self.cache_len + batch.context_starts - offsets[:-1], batch.seqlens_q)
        cache_rows = self._to_device(cache_rows + np.arange(total, dtype=np.int64))
        layout = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), batch.slots.tolist(), batch.seqlens_k.tolist()))
        # Requests with few new tokens (one in fast mode; up to a query tile in batch-invariant
        # mode: decodes, draft verification, short chunks) attend together in one set of calls
        # per layer (`_decode_plan`); the others request by request.
        few = batch.seqlens_q <= (self.row_block if self.batch_invariant else 1)
        plan = self._decode_plan(batch, few) if few.any() else None
        self._make_finite(batch, plan)
        one_by_one = [entry for entry, grouped in zip(layout, few) if not grouped]

        # RoPE tables per row: cos twice, and (-sin, sin), so a rotation is x * cos + swapped(x) * sin.
        cos, sin = self._rope_cos[positions][:, None, :], self._rope_sin[positions][:, None, :]  # [rows, 1, d]
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        attend = self._tiled_decode_attention if self.batch_invariant else self._decode_attention
        # The common decode step (every request in the group, no padding rows): attention
        # returns the layer's whole attention output, so nothing is scattered into a buffer.
        whole = plan is not None and plan.token_rows is None and not one_by_one and rows == total
        attn = None if whole else torch.zeros(rows, heads * d, device=self.device, dtype=self.dtype)
        x = self.weights.embed[token_ids]  # [rows, H]
        for layer, k_cache, v_cache in zip(layers, self.k_cache, self.v_cache):
            qkv = self._linear(self._rms_norm(x, layer.attn_norm), layer.qkv)  # [rows, (heads + 2 kv) d]
            qk = self._rope(qkv[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            k_cache.view(-1, kv_heads, d).index_copy_(0, cache_rows, k[:total])
            v_cache.view(-1, kv_heads, d).index_copy_(0, cache_rows, qkv[:total, (heads + kv_heads) * d :].view(total, kv_heads, d))
            if whole:
                attn = attend(q, k_cache, v_cache, plan)
            elif plan is not None:
                if plan.token_rows is None:  # every request is in the group
                    attn[:total] = attend(q[:total], k_cache, v_cache, plan)
                else:
                    attn[plan.token_rows] = attend(q[plan.token_rows], k_cache, v_cache, plan)
            for start, end, slot, seqlen_k in one_by_one:
                if self.batch_invariant:
                    attn[start:end] = self._tiled_attention(q[start:end], k_cache[slot], v_cache[slot], seqlen_k)
                else:
                    attn[start:end] = self._sdpa_attention(q[start:end], k_cache[slot, :seqlen_k], v_cache[slot, :seqlen_k])
            x = self._linear(attn, layer.o_proj, residual=x)
            gate, up = self._linear(self._rms_norm(x, layer.mlp_norm), layer.gate_up).chunk(2, dim=-1)
            x = self._linear(F.silu(gate) * up, layer.down, residual=x)
        hidden = self._rms_norm(x, self.weights.final_norm)[:total]
        if out is None:
            return hidden
        out[:total].copy_(hidden)
        return out[:total]

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host index array of this step's plan on the model's device (`engine.ops.upload`:
        on CUDA through pinned memory, once per array and step)."""
        return upload(torch.from_numpy(np.ascontiguousarray(array)), self.device)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:  # one call; in fp32 the bits of Hugging Face's formula
            return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        return x / torch.sqrt(variance + self.config.rms_norm_eps) * weight

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE on x `[rows, heads, d]` (queries and keys together), cos and sin
        `[rows, 1, d]` as `_rope_cos` / `_rope_sin` hold them: x * cos + (x2, x1) * (-sin, sin).
        Each element is one product of each kind and one add (x1 cos - x2 sin rounds the same
        as x1 cos + x2 (-sin)); the fast mode fuses the second product and the add."""
        rows, heads, d = x.shape
        swapped = x.reshape(rows, heads, 2, d // 2).flip(2).view(rows, heads, d)  # (x2, x1)
        if not self.batch_invariant:
            return torch.addcmul(x * cos, swapped, sin)
        # Not addcmul: its vector body and scalar tail may round differently (one FMA or
        # two roundings), and which one an element takes depends on its place in the batch.
        return x * cos + swapped * sin

    def _linear(self, x: torch.Tensor, weight: torch.Tensor | BlockGemm, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T, plus `residual` when given."""
        if isinstance(weight, BlockGemm):
            if not self.batch_invariant:  # oneDNN's packed weight: one call for any row count
                return onednn_linear(x, weight.packed, residual)
            # x has a multiple of weight.block_rows rows, or a last partial block where the
            # short calls were verified. In batch-invariant mode: one GEMM call per block (or
            # per group of blocks, `BlockGemm.long_blocks`) of a shape probed to give every row
            # one summation order, so a row's result cannot depend on how many rows share the
            # step. (An unprobed [rows, K] GEMM, and even a bmm over the blocks, lets MKL
            # change its blocking with the row count.)
            y = weight(x)
        elif x.shape[0] == 1 and not self.batch_invariant:
            return one_row_linear(x, weight, residual)  # a one-row step (FAST_PACKED_FROM)
        else:
            y = F.linear(x, weight)
        return y if residual is None else residual + y

    def _sdpa_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One request: q `[Lq, heads, d]` against its cached `[Lk, kv_heads, d]`; returns `[Lq, heads * d]`."""
        q_len, heads, d = q.shape
        k_len, kv_heads = keys.shape[0], keys.shape[1]
        group = heads // kv_heads
        # Query heads sharing a KV head are stacked along the query axis, so GQA needs no K/V copies.
        q = q.reshape(q_len, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * q_len, d)
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [kv_heads, Lk, d]
        if q_len == 1:
            o = F.scaled_dot_product_attention(q, keys, values)
        elif q_len == k_len:
            o = F.scaled_dot_product_attention(q.view(kv_heads * group, q_len, d), keys.repeat_interleave(group, 0),
                                               values.repeat_interleave(group, 0), is_causal=True)
        else:
            # A later prefill chunk: query i sits at cache position k_len - q_len + i.
            query_pos = torch.arange(k_len - q_len, k_len, device=q.device)
            visible = torch.arange(k_len, device=q.device)[None, :] <= query_pos[:, None]  # [Lq, Lk]
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible.repeat(group, 1))
        return o.reshape(kv_heads, group, q_len, d).permute(2, 0, 1, 3).reshape(q_len, heads * d)

    def _decode_plan(self, batch: ForwardBatch, members: np.ndarray) -> _DecodePlan:
        """Masks and indices for one-call attention of the requests in `members` (each with at
        most `rows` new tokens), shared by every layer.

        Attention's batch is the group in batch order: member i's keys are its own slot's
        (`_DecodePlan.group_cache`), so the call reads the group's slots and nothing else.
        """
        slots, seqlens_q, seqlens_k = batch.slots[members], batch.seqlens_q[members], batch.seqlens_k[members]
        span, rows = len(slots), int(seqlens_q.max())
        longest = int(seqlens_k.max())
        gather = None if np.array_equal(slots, np.arange(span)) else self._to_device(slots)
        # The group's tokens in batch order: their row in the batch and their query index j.
        offsets = batch.token_offsets[:-1][members]
        j = np.arange(int(seqlens_q.sum()), dtype=np.int64) - np.repeat(np.cumsum(seqlens_q) - seqlens_q, seqlens_q)
        token_rows = None if members.all() else self._to_device(np.repeat(offsets, seqlens_q) + j)
        if not self.batch_invariant:  # rows == 1
            keys = longest
            lengths = self._to_device(seqlens_k)
            visible = torch.arange(longest, device=self.device)[None, :] < lengths[:, None]  # [span, longest]
            # As an additive mask (0 or -inf, [span, 1, 1, longest]: over kv heads and stacked query
            # heads): what SDPA would turn a boolean mask into, in every layer.
            visible = torch.zeros(span, 1, 1, longest, device=self.device, dtype=self.dtype).masked_fill_(
                ~visible[:, None, None, :], float("-inf"))
            return _DecodePlan(members, token_rows, gather, None, span, rows, keys, visible)
        # `_tiled_attention`'s masks: query j sits at position seqlen_k - seqlen_q + j; padding rows
        # borrow the last real position. A (request, kv head)'s query tiles hold its group heads x
        # rows pairs, pair p = g * rows + j in row p % row_block of tile p // row_block; rows
        # past the last pair take pair p's query position for j = p % rows (and are dropped).
        qb, kb = self.row_block, self.key_block
        keys, group = _ceil_to(longest, kb), self.config.num_heads // self.config.num_kv_heads
        query_tiles = -(-group * rows // qb)
        query_pos = np.minimum(seqlens_k[:, None] - seqlens_q[:, None] + np.arange(rows), seqlens_k[:, None] - 1)  # [span, rows]
        pair_pos = query_pos[:, np.arange(query_tiles * qb) % rows]  # [span, qt * qb]
        key_pos = torch.arange(keys, device=self.device).view(1, 1, 1, keys // kb, 1, kb)
        visible = key_pos <= self._to_device(pair_pos).view(span, 1, query_tiles, 1, qb, 1)  # [span, 1, qt, kt, qb, kb]
        out_rows = self._to_device(np.repeat(np.arange(span) * rows, seqlens_q) + j)
        return _DecodePlan(members, token_rows, gather, out_rows, span, rows, keys, visible, query_tiles)

    def _decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _DecodePlan
    ) -> torch.Tensor:
        """Fast mode: every request's single query `[n, heads, d]` against its own cache slot,
        keys padded to the longest context and masked; returns `[n, heads * d]`."""
        n, heads, d = q.shape
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        keys = plan.group_cache(k_cache).transpose(1, 2)  # [n, kv_heads, longest, d]
        values = plan.group_cache(v_cache).transpose(1, 2)
        queries = q.reshape(n, kv_heads, group, d)  # query heads sharing a KV head, stacked
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.visible)  # [n, kv_heads, group, d]
        return o.reshape(n, heads * d)

    def _tiled_decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _DecodePlan
    ) -> torch.Tensor:
        """Batch-invariant mode: `_tiled_attention` for requests with at most one query tile
        of new tokens (`q` `[n, heads, d]`, the group's tokens in batch order), all in one set
        of calls; returns `[n, heads * d]`.

        Every query row meets the same `[row_block, d] x [d, key_block]` and `[row_block,
        key_block] x [key_block, d]` bmm items as in `_tiled_attention`, with the same
        elementwise steps and in-order folds over key tiles. Only its row in the item differs:
        the query heads that share a KV head are stacked in one item (a decode step fills 3
        rows of one item instead of 1 row of each of 3), which keeps its bits because the
        probe found the tile bmm invariant to a row's position and neighbours
        (`batch_invariant_verified`). Key tiles past a request's own context, up to the
        longest one, are fully masked: their probabilities are exact zeros, so they add exact
        zeros to the folds and the result is bit-identical to the request alone.
        """
        n, heads, d = q.shape
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        qb, kb, span, r, qt = self.row_block, self.key_block, plan.span, plan.rows, plan.query_tiles
        kt = plan.keys // kb
        padded = q.new_zeros(span * r, heads, d)
        padded[plan.out_rows] = q
        pairs = padded.view(span, r, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(span, kv_heads, group * r, d)
        if qt * qb > group * r:
            pairs = F.pad(pairs, (0, 0, 0, qt * qb - group * r))
        q5 = pairs.view(span, kv_heads, qt, 1, qb, d)
        keys = plan.group_cache(k_cache).view(span, kt, kb, kv_heads, d).permute(0, 3, 1, 4, 2)  # [s, kv, kt, d, kb]
        values = plan.group_cache(v_cache).view(span, kt, kb, kv_heads, d).permute(0, 3, 1, 2, 4)  # [s, kv, kt, kb, d]
        tiles = (span, kv_heads, qt, kt)
        q_pairs = q5.expand(*tiles, qb, d).reshape(-1, qb, d)
        k_pairs = keys[:, :, None].expand(*tiles, d, kb).reshape(-1, d, kb)
        scores = torch.bmm(q_pairs, k_pairs).view(*tiles, qb, kb) * (1.0 / math.sqrt(d))
        scores = scores.masked_fill(~plan.visible, float("-inf"))  # [s, kv, qt, kt, qb, kb]
        probs = torch.exp(scores - scores.amax(dim=(3, 5), keepdim=True))
        v_pairs = values[:, :, None].expand(*tiles, kb, d).reshape(-1, kb, d)
        partial = torch.bmm(probs.view(-1, qb, kb), v_pairs).view(*tiles, qb, d)
        numer = partial.cumsum(dim=3)[:, :, :, -1]  # [s, kv, qt, qb, d]
        denom = probs.sum(dim=-1).cumsum(dim=3)[:, :, :, -1]  # [s, kv, qt, qb]
        o = (numer / denom[..., None]).view(span, kv_heads, qt * qb, d)[:, :, : group * r]
        return o.reshape(span, kv_heads, group, r, d).permute(0, 3, 1, 2, 4).reshape(span * r, heads * d)[plan.out_rows]

    def _tiled_attention(self, q: torch.Tensor, k_slot: torch.Tensor, v_slot: torch.Tensor, k_len: int) -> torch.Tensor:
        """Batch-invariant attention of one request: q `[Lq, heads, d]` against its whole cache slot.

        Scores are computed on `[row_block, key_block]` tiles whose shape never changes;
        tiles are folded in cache order with a sequential cumulative sum, so a query sees
        the same operations in the same order whether it arrived alone, in a crowd, or in
        a prefill chunk of any size.
        """
        q_len, heads, d = q.shape
        kv_heads = k_slot.shape[1]
        group = heads // kv_heads
        qb, kb = self.row_block, self.key_block
        q_tiles, k_tiles = -(-q_len // qb), -(-k_len // kb)
        padded = q.new_zeros(q_tiles * qb, heads, d)
        padded[:q_len] = q
        q5 = padded.view(q_tiles, qb, kv_heads, group, d).permute(2, 3, 0, 1, 4)  # [kv, g, qt, qb, d]
        keys = k_slot[: k_tiles * kb].view(k_tiles, kb, kv_heads, d).permute(2, 0, 3, 1)  # [kv, kt, d, kb]
        values = v_slot[: k_tiles * kb].view(k_tiles, kb, kv_heads, d).permute(2, 0, 1, 3)  # [kv, kt, kb, d]
        tiles = (kv_heads, group, q_tiles, k_tiles)
        # Every (query tile, key tile) pair becomes one item of a bmm batch of equal shapes.
        q_pairs = q5[:, :, :, None].expand(*tiles, qb, d).reshape(-1, qb, d)
        k_pairs = keys[:, None, None].expand(*tiles, d, kb).reshape(-1, d, kb)
        scores = torch.bmm(q_pairs, k_pairs).view(*tiles, qb, kb) * (1.0 / math.sqrt(d))
        # Padding query rows borrow the last real position, so every row sees at least one key.
        query_pos = (torch.arange(q_tiles * qb, device=q.device) + (k_len - q_len)).clamp_max(k_len - 1)
        key_pos = torch.arange(k_tiles * kb, device=q.device)
        visible = key_pos.view(1, k_tiles, 1, kb) <= query_pos.view(q_tiles, 1, qb, 1)  # [qt, kt, qb, kb]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.exp(scores - scores.amax(dim=(3, 5), keepdim=True))  # masked entries are exactly 0
        v_pairs = values[:, None, None].expand(*tiles, kb, d).reshape(-1, kb, d)
        partial = torch.bmm(probs.view(-1, qb, kb), v_pairs).view(*tiles, qb, d)
        # cumsum runs sequentially along the key-tile axis; its last entry is the in-order fold.
        numer = partial.cumsum(dim=3)[:, :, :, -1]  # [kv, g, qt, qb, d]
        denom = probs.sum(dim=-1).cumsum(dim=3)[:, :, :, -1]  # [kv, g, qt, qb]
        o = numer / denom[..., None]
        return o.permute(2, 3, 0, 1, 4).reshape(q_tiles * qb, heads * d)[:q_len]
