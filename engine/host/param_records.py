"""The packed records of a request's parameters (`SamplingParams`) and of its view of one step
(`SeqMeta`), with the small value checks they share: the ledger reads a batch of them as one
numpy record array (engine/host/params.py builds them)."""
from __future__ import annotations

import hashlib
import struct
from typing import Hashable, Sequence

import numpy as np

from engine.host.step_fields import PARAM_FIELDS


def record_layout(fields: Sequence[tuple[str, str]]) -> tuple[np.dtype, struct.Struct]:
    """A numpy record dtype with its fields aligned (so a field of a batch of records is an
    aligned, strided view) and the `struct` that writes one record of it, padding included."""
    codes = {"b1": "?", "i1": "b", "u1": "B", "i2": "h", "u2": "H", "i4": "i", "u4": "I", "i8": "q", "u8": "Q",
             "f4": "f", "f8": "d"}
    dtype = np.dtype([(name, np.dtype(kind).newbyteorder("<")) for name, kind in fields], align=True)
    layout, end = "<", 0
    for name, kind in fields:
        offset = dtype.fields[name][1]
        layout += "x" * (offset - end) + codes[np.dtype(kind).str[1:]]
        end = offset + np.dtype(kind).itemsize
    packer = struct.Struct(layout + "x" * (dtype.itemsize - end))
    assert packer.size == dtype.itemsize
    return dtype, packer


# `prepare_sampler_inputs` reads a batch of SeqMeta as one numpy record array: each
# SamplingParams and each SeqMeta packs its record when it is built (after validation),
# and the batch is the records joined; the request table keeps one record per row. The
# fields are named as the ledger reads them; the sampling parameters are the step-field
# declaration's (`PARAM_FIELDS`: temperatures, top_ks, ...), so a parameter declared there
# is packed with no edit here. `has_seed` says whether `seeds` holds the request's own seed.
PARAMS_RECORD, PARAMS_PACKER = record_layout((
    ("min_tokens", "i4"), ("num_logprobs", "i4"), ("num_prompt_logprobs", "i4"),
    *((f.name, np.dtype(f.dtype).str[1:]) for f in PARAM_FIELDS), ("has_seed", "b1"),
))
SEQ_PART, SEQ_PACKER = record_layout((
    ("is_prompt", "b1"), ("seqlen_q", "i4"), ("seqlen_k", "i4"), ("prompt_len", "i4"), ("num_generated", "i4"),
    ("mtp_read_slot", "i4"), ("mtp_write_slot", "i4"), ("forced_token", "i8"),  # -1: none
))
FLOAT_FIELDS = tuple(name for name in PARAMS_RECORD.names if PARAMS_RECORD.fields[name][0].kind == "f")
# The two parts' records back to back; each part's size is a multiple of its largest field
# (8 bytes), so the params part stays aligned after the request's part.
SEQ_RECORD = np.dtype({
    "names": [*SEQ_PART.names, *PARAMS_RECORD.names],
    "formats": [*(SEQ_PART.fields[n][0] for n in SEQ_PART.names),
                *(PARAMS_RECORD.fields[n][0] for n in PARAMS_RECORD.names)],
    "offsets": [*(SEQ_PART.fields[n][1] for n in SEQ_PART.names),
                *(SEQ_PART.itemsize + PARAMS_RECORD.fields[n][1] for n in PARAMS_RECORD.names)],
    "itemsize": SEQ_PART.itemsize + PARAMS_RECORD.itemsize,
}, align=True)


def neutral_record() -> np.ndarray:
    """A `SEQ_RECORD` of no request (an empty table row): no NaN, no inf, no filter, no logprobs."""
    record = np.zeros((), dtype=SEQ_RECORD)
    record["prompt_len"] = 1
    record["num_logprobs"] = record["num_prompt_logprobs"] = record["forced_token"] = -1
    for f in PARAM_FIELDS:
        record[f.name] = f.padding
    return record


def derive_seed(request_id: Hashable, seed_base: int = 0) -> int:
    """The seed the engine gives a request that brought none (docs/contract.md §2).

    A pure function of (engine seed base, request id): replaying a workload
    with the same ids reproduces every sample, and the output reports it.
    """
    digest = hashlib.blake2b(f"{seed_base}:{request_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def derive_seeds(records: np.ndarray, request_ids: Sequence[Hashable], seed_base: int = 0) -> np.ndarray:
    """`records` (`SEQ_RECORD`, writable) with `derive_seed` written into the `seeds` of every
    record whose request brought no seed (`has_seed` False); returns `records`."""
    unseeded = np.flatnonzero(~records["has_seed"])
    if len(unseeded):
        seeds = records["seeds"]
        for i in unseeded.tolist():
            seeds[i] = derive_seed(request_ids[i], seed_base)
    return records


def set_state(obj: object, state: tuple[dict, dict | None]) -> None:
    """copy / pickle of a frozen dataclass whose record sits in a slot: its fields into the
    instance dict, its slots set past the frozen `__setattr__`."""
    fields_state, slots_state = state
    obj.__dict__.update(fields_state)
    for name, value in (slots_state or {}).items():
        object.__setattr__(obj, name, value)


def is_int(value: object) -> bool:
    # bool is an int subclass; a flag passed where a count belongs is a bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def plain_number(value: object) -> object:
    """A numpy scalar as the Python number it holds (`np.float32(0.9)` is a float to a
    vLLM user, `np.int64(5)` an int); anything else as it is, for the checks to judge."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (np.integer, np.floating)):
        return value
    return value.item()
