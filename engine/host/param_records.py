"""The packed records of a request's parameters (`SamplingParams`) and of its view of one step
(`SeqMeta`), with the small value checks they share: the ledger reads a batch of them as one
numpy record array (engine/host/params.py builds them)."""
from __future__ import annotations

import struct
from typing import Sequence

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
# and the batch is the records joined. The fields are named as the ledger and the request
# columns (engine/host/columns.py) name them; the sampling parameters are the step-field
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
