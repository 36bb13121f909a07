"""Per-request columns, declared once.

Every per-request field the ledger and the sampler read is declared in
`REQUEST_COLUMNS`: its name, dtype, how to read it from a `SeqMeta`, and its
neutral value for padding requests. Storage is grouped by dtype into one 2-D
array per group, so gathering a batch's columns is one fancy-index per group
(three `take`s, not one per field), and adding a field is one line here.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from engine.host.params import SeqMeta


def derive_seed(request_id: Hashable, seed_base: int = 0) -> int:
    """The seed the engine gives a request that brought none.

    A pure function of (engine seed base, request id): replaying a workload
    with the same ids reproduces every sample, and the output reports it.
    """
    digest = hashlib.blake2b(f"{seed_base}:{request_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class Column:
    name: str
    dtype: type
    read: Callable[[SeqMeta, int], object]  # (seq, seed_base) -> value
    neutral: object  # value for padding requests: no NaN, no inf, no filter


REQUEST_COLUMNS: tuple[Column, ...] = (
    Column("prompt_len", np.int32, lambda s, _: s.prompt_len, 1),
    Column("num_generated", np.int32, lambda s, _: s.num_generated, 0),
    Column("min_tokens", np.int32, lambda s, _: s.params.min_tokens, 0),
    Column("top_k", np.int32, lambda s, _: s.params.top_k, 0),
    Column("num_logprobs", np.int32, lambda s, _: s.params.num_logprobs, -1),
    Column("num_prompt_logprobs", np.int32, lambda s, _: s.params.num_prompt_logprobs, -1),
    Column("mtp_write_slot", np.int32, lambda s, _: s.mtp_write_slot, 0),
    Column("temperature", np.float32, lambda s, _: s.params.temperature, 1.0),
    Column("top_p", np.float32, lambda s, _: s.params.top_p, 1.0),
    Column("min_p", np.float32, lambda s, _: s.params.min_p, 0.0),
    Column(
        "seed",
        np.uint64,
        lambda s, base: s.params.seed if s.params.seed is not None else derive_seed(s.request_id, base),
        0,
    ),
)

_GROUP_DTYPES: tuple[type, ...] = tuple(dict.fromkeys(c.dtype for c in REQUEST_COLUMNS))
# name -> (group index, column index inside the group)
_LOCATION: dict[str, tuple[int, int]] = {}
for _g, _dtype in enumerate(_GROUP_DTYPES):
    for _j, _col in enumerate(c for c in REQUEST_COLUMNS if c.dtype is _dtype):
        _LOCATION[_col.name] = (_g, _j)
_GROUP_WIDTHS = tuple(sum(1 for c in REQUEST_COLUMNS if c.dtype is d) for d in _GROUP_DTYPES)


class Columns:
    """Per-request columns for `n` requests: one [n, width] array per dtype.

    `cols.temperature` is a column view (no copy). `take(index)` gathers rows
    of every group at once.
    """

    __slots__ = ("groups",)

    def __init__(self, groups: tuple[np.ndarray, ...]):
        self.groups = groups

    @classmethod
    def empty(cls, n: int) -> Columns:
        cols = cls(tuple(np.empty((n, w), dtype=d) for d, w in zip(_GROUP_DTYPES, _GROUP_WIDTHS)))
        cols.fill_neutral(slice(None))
        return cols

    @classmethod
    def from_seqs(cls, seqs: Sequence[SeqMeta], seed_base: int = 0) -> Columns:
        cols = cls.empty(len(seqs))
        for i, seq in enumerate(seqs):
            cols.write_row(i, seq, seed_base)
        return cols

    def write_row(self, row: int, seq: SeqMeta, seed_base: int = 0) -> None:
        for col in REQUEST_COLUMNS:
            g, j = _LOCATION[col.name]
            self.groups[g][row, j] = col.read(seq, seed_base)

    def fill_neutral(self, rows: slice | np.ndarray) -> None:
        for col in REQUEST_COLUMNS:
            g, j = _LOCATION[col.name]
            self.groups[g][rows, j] = col.neutral

    def add_at(self, name: str, rows: np.ndarray, values: np.ndarray) -> None:
        g, j = _LOCATION[name]
        np.add.at(self.groups[g], (rows, j), values)

    def take(self, index: np.ndarray) -> Columns:
        return Columns(tuple(g[index] for g in self.groups))

    def __len__(self) -> int:
        return self.groups[0].shape[0]



def _column_view(g: int, j: int) -> property:
    return property(lambda self: self.groups[g][:, j], doc=f"column {j} of dtype group {g} (a view)")


# One read-only property per declared column (`cols.temperature`), made here
# so a new column needs no edit in this class.
for _name, (_g, _j) in _LOCATION.items():
    setattr(Columns, _name, _column_view(_g, _j))

COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in REQUEST_COLUMNS)
