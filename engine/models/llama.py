"""A Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings) with a per-request KV cache.

Two execution modes share every weight and the cache:

- fast (`batch_invariant=False`): one GEMM per projection over all scheduled tokens;
  attention through `scaled_dot_product_attention` (engine/models/attention.py).
- batch-invariant (`batch_invariant=True`, the default, as for the engine): a token's
  hidden state is bit-identical whatever else shares the step and however its prompt
  was chunked. Every linear layer
  runs one GEMM per fixed `[row_block, K]` row block on a kernel probed where it runs
  (engine/models/invariant_kernels.py; the token rows are zero-padded until the last block
  is whole or a call of a size whose bits the probe verified against the whole block's:
  `InvariantKernels.step_rows`); a projection whose kernel fails falls back to another
  kernel or to a block size dividing `row_block`, and `batch_invariant_verified` says
  whether the whole promise (projections and attention tiles) holds. Attention works on
  fixed `[row_block, key_block]` score tiles aligned to absolute cache positions
  (engine/models/attention.py). RMSNorm uses sqrt + divide (correctly rounded in vector
  and scalar code alike) instead of rsqrt.

On CPU the projections run on prepacked copies of their weights: oneDNN's in fast mode
from 2 rows on (one call per projection for any row count; oneDNN follows the CPU's ISA on
any vendor; a one-row step runs `engine.ops.one_row_linear`),
the first of oneDNN's and MKL's that the probe finds invariant in batch-invariant mode.

The KV cache and its slots are engine/models/kv_cache.py; the config and the weights
(Hugging Face layout) engine/models/llama_weights.py.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.models.attention import Attention
from engine.models.invariant_kernels import InvariantKernels
from engine.models.kv_cache import KVCache
from engine.models.llama_weights import LlamaConfig, LlamaWeights, random_weights
from engine.models.protocol import ForwardBatch, check_forward_args
from engine.ops import BlockGemm, one_row_linear, onednn_linear, upload


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
        batch_invariant: bool = True,
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
        self.device = torch.device(device)
        self.attention = Attention(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                                   batch_invariant=batch_invariant, row_block=row_block, key_block=key_block,
                                   device=self.device, dtype=dtype)
        self.cache_len = self.attention.cache_len(max_context)
        # First of the work: a cache past the machine's memory is refused before the weights move.
        self.kv = KVCache(num_layers=config.num_layers, num_slots=num_slots, cache_len=self.cache_len,
                          max_context=max_context, kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                          device=self.device, dtype=dtype)
        self.weights = weights.to(device, dtype)
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

        # Prepacked weights (see `LlamaWeights.packed_layers`; each packing holds one more copy
        # of the projections): the fast mode runs its GEMMs of FAST_PACKED_FROM rows or more on
        # oneDNN's (FAST_PACK_ROWS) where it applies; the batch-invariant mode tries oneDNN's,
        # then MKL's, for its row blocks.
        self.packed_weights = packed_weights and self.device.type == "cpu"
        self._fast_layers = self.weights.layers
        if self.packed_weights and not batch_invariant:
            self._fast_layers = self.weights.packed_layers("onednn", FAST_PACK_ROWS) or self.weights.layers
        # Batch-invariant mode: the projections on the block GEMMs the probe verified.
        self.invariant = None if not batch_invariant else InvariantKernels.probe(
            self.weights, head_dim=config.head_dim, row_block=row_block, key_block=key_block,
            packed_weights=self.packed_weights, dtype=dtype, device=self.device)
        # Each projection's verified block GEMM, e.g. {"qkv": "onednn[16]"} ({} in fast mode).
        self.gemm_kernels = {} if self.invariant is None else self.invariant.gemm_kernels
        self.batch_invariant_verified = self.invariant is not None and self.invariant.verified

        half = config.head_dim // 2
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / config.head_dim))
        angles = torch.arange(self.cache_len, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [cache_len, d/2]
        cos, sin = angles.cos().to(device=self.device, dtype=dtype), angles.sin().to(device=self.device, dtype=dtype)
        self._rope_cos = torch.cat([cos, cos], dim=-1)  # [cache_len, d]
        self._rope_sin = torch.cat([-sin, sin], dim=-1)

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

    # ---- KV-cache slots (`KVCache`) ---------------------------------------------------------

    @property
    def k_cache(self) -> list[torch.Tensor]:
        """Per layer `[num_slots, cache_len, kv_heads, head_dim]` keys."""
        return self.kv.k_cache

    @property
    def v_cache(self) -> list[torch.Tensor]:
        """Per layer `[num_slots, cache_len, kv_heads, head_dim]` values."""
        return self.kv.v_cache

    def allocate_slot(self) -> int:
        return self.kv.allocate()

    def free_slot(self, slot: int) -> None:
        self.kv.free(slot)

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """`KVCache.copy_prefix`: the decode loop's prefix sharing (`PrefixCopy`)."""
        self.kv.copy_prefix(src_slot, dst_slot, length)

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
        i = self.kv.first_unallocated(np.asarray(batch.slots, dtype=np.int64))
        if i is not None:
            raise ValueError(f"request {i}: KV-cache slot {int(batch.slots[i])} is not allocated")
        cfg = self.config
        total = batch.num_tokens
        if self.invariant is not None:
            rows = self.invariant.step_rows(total)
            layers = self.invariant.layers
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
        cache_rows = upload(cache_rows + np.arange(total, dtype=np.int64), self.device)
        layout = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), batch.slots.tolist(), batch.seqlens_k.tolist()))
        # Requests with few new tokens attend together in one set of calls per layer; the
        # others request by request.
        few = self.attention.grouped(batch)
        plan = self.attention.plan(batch, few) if few.any() else None
        self.kv.make_finite(batch.slots, batch.seqlens_k, self.attention.keys_read(batch, plan))
        one_by_one = [entry for entry, grouped in zip(layout, few) if not grouped]

        # RoPE tables per row: cos twice, and (-sin, sin), so a rotation is x * cos + swapped(x) * sin.
        cos, sin = self._rope_cos[positions][:, None, :], self._rope_sin[positions][:, None, :]  # [rows, 1, d]
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        attend = self.attention.group
        # The common decode step (every request in the group, no padding rows): attention
        # returns the layer's whole attention output, so nothing is scattered into a buffer.
        whole = plan is not None and plan.token_rows is None and not one_by_one and rows == total
        attn = None if whole else torch.zeros(rows, heads * d, device=self.device, dtype=self.dtype)
        x = self.weights.embed[token_ids]  # [rows, H]
        for layer, k_cache, v_cache in zip(layers, self.kv.k_cache, self.kv.v_cache):
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
                attn[start:end] = self.attention.request(q[start:end], k_cache[slot], v_cache[slot], seqlen_k)
            x = self._linear(attn, layer.o_proj, residual=x)
            gate, up = self._linear(self._rms_norm(x, layer.mlp_norm), layer.gate_up).chunk(2, dim=-1)
            x = self._linear(F.silu(gate) * up, layer.down, residual=x)
        hidden = self._rms_norm(x, self.weights.final_norm)[:total]
        if out is None:
            return hidden
        out[:total].copy_(hidden)
        return out[:total]

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
