"""Per-request columns, declared once.

Every per-request field the ledger and the sampler read is a column of
`REQUEST_COLUMNS`: its name, dtype, how to read it from a `SeqMeta`, and its
neutral value for padding requests. The sampling parameters come from the
step-field declaration (`engine/host/step_fields.py`: `temperatures`,
`top_ks`, ... under the names the kernel reads, padded as it pads them); the
other columns are what only the ledger reads. Storage is grouped by dtype
into one 2-D array per group, so gathering a batch's columns is one
fancy-index per group (three `take`s, not one per field).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from engine.host.params import SeqMeta
from engine.host.step_fields import PARAM_FIELDS, StepField


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


def _param_reader(f: StepField) -> Callable[[SeqMeta, int], object]:
    """How a sampling-parameter column reads its SeqMeta."""
    attr = f.param
    if attr == "seed":
        # A request without a seed samples with one the engine derives (docs/contract.md §2).
        return lambda s, base: s.params.seed if s.params.seed is not None else derive_seed(s.request_id, base)
    return lambda s, _: getattr(s.params, attr)


REQUEST_COLUMNS: tuple[Column, ...] = (
    Column("prompt_len", np.int32, lambda s, _: s.prompt_len, 1),
    Column("num_generated", np.int32, lambda s, _: s.num_generated, 0),
    Column("min_tokens", np.int32, lambda s, _: s.params.min_tokens, 0),
    Column("num_logprobs", np.int32, lambda s, _: s.params.num_logprobs, -1),
    Column("num_prompt_logprobs", np.int32, lambda s, _: s.params.num_prompt_logprobs, -1),
    Column("mtp_write_slot", np.int32, lambda s, _: s.mtp_write_slot, 0),
    *(Column(f.name, f.dtype, _param_reader(f), f.padding) for f in PARAM_FIELDS),
)

_GROUP_DTYPES: tuple[type, ...] = tuple(dict.fromkeys(c.dtype for c in REQUEST_COLUMNS))
_GROUP_COLUMNS: tuple[tuple[Column, ...], ...] = tuple(
    tuple(c for c in REQUEST_COLUMNS if c.dtype is d) for d in _GROUP_DTYPES
)
# (group index, column index inside the group, column), and the same by name
_PLACED: tuple[tuple[int, int, Column], ...] = tuple(
    (g, j, col) for g, group in enumerate(_GROUP_COLUMNS) for j, col in enumerate(group)
)
_LOCATION: dict[str, tuple[int, int]] = {col.name: (g, j) for g, j, col in _PLACED}


def _column_view(name: str) -> property:
    return property(lambda self: self.column(name), doc=f"the {name} column of every request (a view)")


class ColumnViews:
    """The request columns a ledger reads, one property per declared column: `cols.temperatures`
    is a view, nothing copied. `Columns` keeps them in per-dtype groups (the persistent table);
    `RecordColumns` reads them from a batch's packed SeqMeta records."""

    __slots__ = ()

    # One view per declared column, in REQUEST_COLUMNS' order (tests/test_step_fields.py holds them equal).
    prompt_len = _column_view("prompt_len")
    num_generated = _column_view("num_generated")
    min_tokens = _column_view("min_tokens")
    num_logprobs = _column_view("num_logprobs")
    num_prompt_logprobs = _column_view("num_prompt_logprobs")
    mtp_write_slot = _column_view("mtp_write_slot")
    temperatures = _column_view("temperatures")
    top_ks = _column_view("top_ks")
    top_ps = _column_view("top_ps")
    min_ps = _column_view("min_ps")
    seeds = _column_view("seeds")

    def column(self, name: str) -> np.ndarray:
        """[n] the declared column `name` of every request (a view)."""
        raise NotImplementedError


class Columns(ColumnViews):
    """Per-request columns for `n` requests: one [n, width] array per dtype.

    `cols.temperatures` is a column view (no copy). `take(index)` gathers rows
    of every group at once.
    """

    __slots__ = ("groups",)

    def __init__(self, groups: tuple[np.ndarray, ...]):
        self.groups = groups

    @classmethod
    def empty(cls, n: int) -> Columns:
        cols = cls(tuple(np.empty((n, len(group)), dtype=d) for d, group in zip(_GROUP_DTYPES, _GROUP_COLUMNS)))
        cols.fill_neutral(slice(None))
        return cols

    @classmethod
    def from_seqs(cls, seqs: Sequence[SeqMeta], seed_base: int = 0) -> Columns:
        cols = cls.empty(len(seqs))
        for i, seq in enumerate(seqs):
            cols.write_row(i, seq, seed_base)
        return cols

    def write_row(self, row: int, seq: SeqMeta, seed_base: int = 0) -> None:
        groups = self.groups
        for g, j, col in _PLACED:
            groups[g][row, j] = col.read(seq, seed_base)

    def fill_neutral(self, rows: slice | np.ndarray) -> None:
        groups = self.groups
        for g, j, col in _PLACED:
            groups[g][rows, j] = col.neutral

    def add_at(self, name: str, rows: np.ndarray, values: np.ndarray) -> None:
        g, j = _LOCATION[name]
        np.add.at(self.groups[g], (rows, j), values)

    def take(self, index: np.ndarray) -> Columns:
        return Columns(tuple(g[index] for g in self.groups))

    def column(self, name: str) -> np.ndarray:
        g, j = _LOCATION[name]
        return self.groups[g][:, j]

    def __len__(self) -> int:
        return self.groups[0].shape[0]


class RecordColumns(ColumnViews):
    """The request columns of a batch read straight from its SeqMeta records (`SEQ_RECORD`,
    engine/host/params.py, writable): `cols.temperatures` is the records' field, a strided
    view, nothing copied. A request that brought no seed gets the derived one written into
    its record's copy. Read by `prepare_sampler_inputs`; the persistent table keeps `Columns`."""

    __slots__ = ("records",)

    def __init__(self, records: np.ndarray, request_ids: Sequence[Hashable], seed_base: int = 0):
        self.records = records
        unseeded = np.flatnonzero(~records["has_seed"])
        if len(unseeded):
            seeds = records["seeds"]
            for i in unseeded.tolist():
                seeds[i] = derive_seed(request_ids[i], seed_base)

    def column(self, name: str) -> np.ndarray:
        return self.records[name]

    def __len__(self) -> int:
        return len(self.records)
