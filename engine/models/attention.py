"""How a step's queries attend to the KV cache, in the model's two modes.

- fast: `scaled_dot_product_attention` once for all single-token (decode) requests, over
  their cache slots alone (a view when they sit in slots 0..n-1 in batch order, else a
  copy of just those slots: `Attention.group`), and per request for prefill chunks
  (`Attention.request`).
- batch-invariant: fixed `[row_block, key_block]` score tiles aligned to absolute cache
  positions (`tile_attention`, one algorithm for both layouts): the softmax maximum is
  exact in any order, per-tile sums have a fixed length, and tiles are folded in cache
  order, so key tiles past a query's position add exact zeros. A request's queries fill
  its own tiles (`request`); requests with at most one query tile of new tokens run theirs
  as items of shared calls (`group`), the query heads that share a KV head stacked in
  one tile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.models.protocol import ForwardBatch
from engine.ops import upload


@dataclass(frozen=True)
class DecodePlan:
    """One-call attention for a group of requests with few new tokens (`Attention.plan`),
    shared by every layer of a step."""

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


def ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tile_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   visible: torch.Tensor) -> torch.Tensor:
    """Batch-invariant attention over fixed-shape tiles; returns `[A, B, qt, qb, d]`.

    `queries` `[A, B, qt, qb, d]`: query tiles of `qb` rows; `keys` `[A or 1, B or 1, kt, d,
    kb]` and `values` `[A or 1, B or 1, kt, kb, d]`: key tiles of `kb` positions, broadcast
    over the leading axes; `visible` a boolean mask broadcast against `[A, B, qt, kt, qb,
    kb]`. Every (query tile, key tile) pair becomes one item of a bmm batch of equal
    shapes, `[qb, d] x [d, kb]` then `[qb, kb] x [kb, d]`, so a query row sees the same
    operations in the same order whatever else shares the call; tiles are folded in key
    order with a sequential cumulative sum. Every query row must see at least one key."""
    lead, (q_tiles, qb, d), (k_tiles, kb) = queries.shape[:2], queries.shape[2:], (keys.shape[-3], keys.shape[-1])
    tiles = (*lead, q_tiles, k_tiles)
    q_pairs = queries.unsqueeze(3).expand(*tiles, qb, d).reshape(-1, qb, d)
    k_pairs = keys.unsqueeze(2).expand(*tiles, d, kb).reshape(-1, d, kb)
    scores = torch.bmm(q_pairs, k_pairs).view(*tiles, qb, kb) * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.exp(scores - scores.amax(dim=(3, 5), keepdim=True))  # masked entries are exactly 0
    v_pairs = values.unsqueeze(2).expand(*tiles, kb, d).reshape(-1, kb, d)
    partial = torch.bmm(probs.view(-1, qb, kb), v_pairs).view(*tiles, qb, d)
    # cumsum runs sequentially along the key-tile axis; its last entry is the in-order fold.
    numer = partial.cumsum(dim=3)[:, :, :, -1]  # [A, B, qt, qb, d]
    denom = probs.sum(dim=-1).cumsum(dim=3)[:, :, :, -1]  # [A, B, qt, qb]
    return numer / denom[..., None]


class Attention:
    """Attention of a model with `num_heads` query heads over `num_kv_heads` KV heads of
    `head_dim`, in fast or batch-invariant mode (see the module docstring)."""

    def __init__(self, *, num_heads: int, num_kv_heads: int, batch_invariant: bool, row_block: int, key_block: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.group_size = num_heads // num_kv_heads  # query heads per KV head
        self.batch_invariant = batch_invariant
        self.row_block = row_block
        self.key_block = key_block
        self.device = device
        self.dtype = dtype

    def cache_len(self, max_context: int) -> int:
        """Positions per cache slot: batch-invariant attention reads whole key tiles."""
        return ceil_to(max_context, self.key_block) if self.batch_invariant else max_context

    def grouped(self, batch: ForwardBatch) -> np.ndarray:
        """[num_reqs] bool: the requests with few new tokens (one in fast mode; up to a query
        tile in batch-invariant mode: decodes, draft verification, short chunks), which
        attend together in one set of calls per layer (`plan`, `group`)."""
        return batch.seqlens_q <= (self.row_block if self.batch_invariant else 1)

    def keys_read(self, batch: ForwardBatch, plan: DecodePlan | None) -> np.ndarray:
        """[num_reqs] the cache positions each request's attention reads this step, its masked
        padding included (`KVCache.make_finite` zeroes what lies past its context)."""
        if self.batch_invariant:
            needed = -(-batch.seqlens_k // self.key_block) * self.key_block  # whole key tiles
        else:
            needed = batch.seqlens_k.copy()  # per-request attention reads only the context
        if plan is not None:
            needed[plan.members] = plan.keys  # padded to the group's longest context
        return needed

    def plan(self, batch: ForwardBatch, members: np.ndarray) -> DecodePlan:
        """Masks and indices for one-call attention of the requests in `members` (each with at
        most `rows` new tokens), shared by every layer.

        Attention's batch is the group in batch order: member i's keys are its own slot's
        (`DecodePlan.group_cache`), so the call reads the group's slots and nothing else.
        """
        slots, seqlens_q, seqlens_k = batch.slots[members], batch.seqlens_q[members], batch.seqlens_k[members]
        span, rows = len(slots), int(seqlens_q.max())
        longest = int(seqlens_k.max())
        gather = None if np.array_equal(slots, np.arange(span)) else upload(slots, self.device)
        # The group's tokens in batch order: their row in the batch and their query index j.
        offsets = batch.token_offsets[:-1][members]
        j = np.arange(int(seqlens_q.sum()), dtype=np.int64) - np.repeat(np.cumsum(seqlens_q) - seqlens_q, seqlens_q)
        token_rows = None if members.all() else upload(np.repeat(offsets, seqlens_q) + j, self.device)
        if not self.batch_invariant:  # rows == 1
            keys = longest
            lengths = upload(seqlens_k, self.device)
            visible = torch.arange(longest, device=self.device)[None, :] < lengths[:, None]  # [span, longest]
            # As an additive mask (0 or -inf, [span, 1, 1, longest]: over kv heads and stacked query
            # heads): what SDPA would turn a boolean mask into, in every layer.
            visible = torch.zeros(span, 1, 1, longest, device=self.device, dtype=self.dtype).masked_fill_(
                ~visible[:, None, None, :], float("-inf"))
            return DecodePlan(members, token_rows, gather, None, span, rows, keys, visible)
        # `tile_attention`'s masks: query j sits at position seqlen_k - seqlen_q + j; padding rows
        # borrow the last real position. A (request, kv head)'s query tiles hold its group heads x
        # rows pairs, pair p = g * rows + j in row p % row_block of tile p // row_block; rows
        # past the last pair take pair p's query position for j = p % rows (and are dropped).
        qb, kb = self.row_block, self.key_block
        keys = ceil_to(longest, kb)
        query_tiles = -(-self.group_size * rows // qb)
        query_pos = np.minimum(seqlens_k[:, None] - seqlens_q[:, None] + np.arange(rows), seqlens_k[:, None] - 1)  # [span, rows]
        pair_pos = query_pos[:, np.arange(query_tiles * qb) % rows]  # [span, qt * qb]
        key_pos = torch.arange(keys, device=self.device).view(1, 1, 1, keys // kb, 1, kb)
        visible = key_pos <= upload(pair_pos, self.device).view(span, 1, query_tiles, 1, qb, 1)  # [span, 1, qt, kt, qb, kb]
        out_rows = upload(np.repeat(np.arange(span) * rows, seqlens_q) + j, self.device)
        return DecodePlan(members, token_rows, gather, out_rows, span, rows, keys, visible, query_tiles)

    def group(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """The group's tokens `q` `[n, heads, d]` (batch order) against their own cache slots,
        all in one set of calls; returns `[n, heads * d]`."""
        if self.batch_invariant:
            return self._tiled_group(q, k_cache, v_cache, plan)
        n, heads, d = q.shape
        kv_heads = k_cache.shape[2]
        keys = plan.group_cache(k_cache).transpose(1, 2)  # [n, kv_heads, longest, d]
        values = plan.group_cache(v_cache).transpose(1, 2)
        queries = q.reshape(n, kv_heads, self.group_size, d)  # query heads sharing a KV head, stacked
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.visible)  # [n, kv_heads, group, d]
        return o.reshape(n, heads * d)

    def request(self, q: torch.Tensor, k_slot: torch.Tensor, v_slot: torch.Tensor, k_len: int) -> torch.Tensor:
        """One request: q `[Lq, heads, d]` against the first `k_len` positions of its cache
        slot (`[cache_len, kv_heads, d]`); returns `[Lq, heads * d]`."""
        if self.batch_invariant:
            return self._tiled_request(q, k_slot, v_slot, k_len)
        q_len, heads, d = q.shape
        keys, values = k_slot[:k_len], v_slot[:k_len]
        kv_heads, group = keys.shape[1], self.group_size
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

    def _tiled_request(self, q: torch.Tensor, k_slot: torch.Tensor, v_slot: torch.Tensor, k_len: int) -> torch.Tensor:
        """Batch-invariant `request`: the request's queries in tiles of `row_block` rows, per
        (kv head, query head of its group), against its whole key tiles; a query sees the same
        operations in the same order whether it arrived alone, in a crowd, or in a prefill
        chunk of any size."""
        q_len, heads, d = q.shape
        kv_heads, group = k_slot.shape[1], self.group_size
        qb, kb = self.row_block, self.key_block
        q_tiles, k_tiles = -(-q_len // qb), -(-k_len // kb)
        padded = q.new_zeros(q_tiles * qb, heads, d)
        padded[:q_len] = q
        queries = padded.view(q_tiles, qb, kv_heads, group, d).permute(2, 3, 0, 1, 4)  # [kv, g, qt, qb, d]
        keys = k_slot[: k_tiles * kb].view(k_tiles, kb, kv_heads, d).permute(2, 0, 3, 1)[:, None]  # [kv, 1, kt, d, kb]
        values = v_slot[: k_tiles * kb].view(k_tiles, kb, kv_heads, d).permute(2, 0, 1, 3)[:, None]  # [kv, 1, kt, kb, d]
        # Padding query rows borrow the last real position, so every row sees at least one key.
        query_pos = (torch.arange(q_tiles * qb, device=q.device) + (k_len - q_len)).clamp_max(k_len - 1)
        key_pos = torch.arange(k_tiles * kb, device=q.device)
        visible = key_pos.view(1, k_tiles, 1, kb) <= query_pos.view(q_tiles, 1, qb, 1)  # [qt, kt, qb, kb]
        o = tile_attention(queries, keys, values, visible)  # [kv, g, qt, qb, d]
        return o.permute(2, 3, 0, 1, 4).reshape(q_tiles * qb, heads * d)[:q_len]

    def _tiled_group(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: DecodePlan) -> torch.Tensor:
        """Batch-invariant `group`: per (request, kv head) one set of query tiles holding its
        group heads x new tokens.

        Every query row meets the same `[row_block, d] x [d, key_block]` and `[row_block,
        key_block] x [key_block, d]` bmm items as in `_tiled_request`, with the same
        elementwise steps and in-order folds over key tiles. Only its row in the item differs:
        the query heads that share a KV head are stacked in one item (a decode step fills 3
        rows of one item instead of 1 row of each of 3), which keeps its bits because the
        probe found the tile bmm invariant to a row's position and neighbours
        (`batch_invariant_verified`). Key tiles past a request's own context, up to the
        longest one, are fully masked: their probabilities are exact zeros, so they add exact
        zeros to the folds and the result is bit-identical to the request alone.
        """
        n, heads, d = q.shape
        kv_heads, group = k_cache.shape[2], self.group_size
        qb, kb, span, r, qt = self.row_block, self.key_block, plan.span, plan.rows, plan.query_tiles
        kt = plan.keys // kb
        padded = q.new_zeros(span * r, heads, d)
        padded[plan.out_rows] = q
        pairs = padded.view(span, r, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(span, kv_heads, group * r, d)
        if qt * qb > group * r:
            pairs = F.pad(pairs, (0, 0, 0, qt * qb - group * r))
        queries = pairs.view(span, kv_heads, qt, qb, d)
        keys = plan.group_cache(k_cache).view(span, kt, kb, kv_heads, d).permute(0, 3, 1, 4, 2)  # [s, kv, kt, d, kb]
        values = plan.group_cache(v_cache).view(span, kt, kb, kv_heads, d).permute(0, 3, 1, 2, 4)  # [s, kv, kt, kb, d]
        o = tile_attention(queries, keys, values, plan.visible).view(span, kv_heads, qt * qb, d)[:, :, : group * r]
        return o.reshape(span, kv_heads, group, r, d).permute(0, 3, 1, 2, 4).reshape(span * r, heads * d)[plan.out_rows]
