"""Triton helpers for top-N lists: a running list of a row's N best tokens, kept while the
sampling kernel streams over the row (`engine.sampling.kernels.sample`).

A token's place is one int64 *rank key*: the order bits of its float32 value (larger
value, larger key; -0 counts as +0) above its id's complement, so keys order by (value
desc, id asc), as `engine.sampling.logprobs.top_n_ids` orders them, and no two tokens
share one. Tokens that take no part get `ABSENT`, below every real key.
"""
from __future__ import annotations

import triton
import triton.language as tl

ABSENT: tl.constexpr = tl.constexpr(-(1 << 62))  # below every rank key (|key| < 2**50)


@triton.jit
def rank_keys(values, offs, take, ID_BITS: tl.constexpr, ID_MASK: tl.constexpr):
    """[CHUNK] int64 rank keys of `values` [CHUNK] f32 at token ids `offs`; ABSENT where
    `take` is False. ID_MASK = 2**ID_BITS - 1 > every id."""
    bits = (values + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (ordered.to(tl.int64) << ID_BITS) | (ID_MASK - offs.to(tl.int64))
    return tl.where(take, key, ABSENT)


@triton.jit
def key_ids(keys, ID_MASK: tl.constexpr):
    """Token ids of rank keys [N] int64; -1 for ABSENT."""
    ids = ID_MASK - (keys & ID_MASK)
    return tl.where(keys == ABSENT, -1, ids)


@triton.jit
def key_values(keys, ID_BITS: tl.constexpr):
    """The float32 values of rank keys [N] int64 (what `rank_keys` was given, -0 read as +0)."""
    ordered = (keys >> ID_BITS).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def merge_top(best, candidates, TOP_PAD: tl.constexpr):
    """The TOP_PAD largest of `best` [TOP_PAD] and `candidates` [CHUNK] int64 rank keys,
    largest first. A chunk with nothing above the list's smallest entry costs one
    reduction; otherwise the merged list is taken one key at a time from the larger of the
    two heads (rank keys are distinct, so a key leaves the one list that holds it)."""
    if tl.max(candidates, 0) > tl.min(best, 0):
        lane = tl.arange(0, TOP_PAD)
        merged = tl.full((TOP_PAD,), ABSENT, dtype=tl.int64)
        for j in tl.static_range(TOP_PAD):
            largest = tl.maximum(tl.max(best, 0), tl.max(candidates, 0))
            merged = tl.where(lane == j, largest, merged)
            best = tl.where(best == largest, ABSENT, best)
            candidates = tl.where(candidates == largest, ABSENT, candidates)
        best = merged
    return best




@triton.jit
def top_of_lists(lists, TOP_PAD: tl.constexpr):
    """The TOP_PAD largest rank keys of several programs' top-N lists [parts, TOP_PAD] (over
    disjoint tokens: no key twice but ABSENT), largest first: one pass over the tile per
    place, no round trip to memory per list."""
    lane = tl.arange(0, TOP_PAD)
    merged = tl.full((TOP_PAD,), ABSENT, dtype=tl.int64)
    for j in tl.static_range(TOP_PAD):
        largest = tl.max(tl.max(lists, 1), 0)
        merged = tl.where(lane == j, largest, merged)
        lists = tl.where(lists == largest, ABSENT, lists)
    return merged


@triton.jit
def token_key(value, token, ID_BITS: tl.constexpr, ID_MASK: tl.constexpr):
    """The rank key of one token's value: a scalar int64 (`rank_keys` of one lane)."""
    one = tl.zeros((1,), dtype=tl.int64)
    return tl.sum(rank_keys(value + one.to(tl.float32), token + one, one == 0, ID_BITS, ID_MASK), 0)


@triton.jit
def on_list(key, keys):
    """Whether the token of rank key `key` is on the top-N list `keys` [N] (its key at or above
    the list's last; ABSENT, below every key, where the list holds the whole row): every
    larger value is then on it too."""
    return key >= tl.min(keys, 0)
