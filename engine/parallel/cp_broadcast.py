"""Context-parallel ledger broadcast: the driver walks the batch once.

Rank `src` (the driver) builds the step's `SamplerInputs`, stop-id matrix and
per-row drafts; every other rank (a follower) receives exactly what it needs
to run the same step in one packed message and rebuilds its inputs with a
few vectorised numpy calls (a cumsum, a repeat), never walking requests.

Protocol, two collectives per step:
1. all-gather of a fixed int64 header from every rank: the driver's sizes and
   status, each rank's own facts (hidden-state rows and width, a fingerprint
   of its engine configuration, and of its own view of the batch when it has
   one). Every rank checks the same gathered table, so a mismatch raises the
   same ValueError on every rank instead of leaving one blocked in a
   collective that the others never join.
2. broadcast of the payload (its size is in the header): every field of
   `LEDGER_FIELDS`, 8-byte aligned, in declaration order; or, when the driver
   rejected the batch, its error message, which followers raise.

The field list is declared once; packing, unpacking and sizes derive from it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from engine.host.ledger import SamplerInputs, exclusive_cumsum
from engine.host.params import SeqMeta

_ALIGN = 8


@dataclass(frozen=True)
class LedgerField:
    name: str
    dtype: type
    per: str  # "req", "sample_row", "prompt_row", "suppress_row": which count sizes it
    only_with: str | None = None  # "mtp" / "prompt": present only when the header says so
    columns: bool = False  # [n, stop_width] (the stop-id matrix)


# Per request: what the sampler and the output assembly read; per sample row:
# the gather index, the row's draft and draft-info read row; the prompt rows
# and their targets; the rows whose EOS is suppressed. Derived on followers:
# row_to_req, local_step and every offset (exclusive cumsums of the counts).
LEDGER_FIELDS: tuple[LedgerField, ...] = (
    LedgerField("request_keys", np.int64, "req"),
    LedgerField("is_prompt", np.bool_, "req"),
    LedgerField("is_last_chunk", np.bool_, "req"),
    LedgerField("query_offsets", np.int32, "req"),
    LedgerField("out_lens", np.int32, "req"),
    LedgerField("sample_counts", np.int32, "req"),
    LedgerField("prompt_row_counts", np.int32, "req"),
    LedgerField("sample_positions", np.int64, "req"),
    LedgerField("temperatures", np.float32, "req"),
    LedgerField("top_ks", np.int32, "req"),
    LedgerField("top_ps", np.float32, "req"),
    LedgerField("min_ps", np.float32, "req"),
    LedgerField("seeds", np.uint64, "req"),
    LedgerField("num_logprobs", np.int32, "req"),
    LedgerField("num_prompt_logprobs", np.int32, "req"),
    LedgerField("stop_ids", np.int64, "req", columns=True),
    LedgerField("mtp_first_token_positions", np.int32, "req", "mtp"),
    LedgerField("mtp_seqlens_q", np.int32, "req", "mtp"),
    LedgerField("mtp_info_write_slots", np.int32, "req", "mtp"),
    LedgerField("selected_token_indices", np.int32, "sample_row"),
    LedgerField("row_drafts", np.int64, "sample_row"),
    LedgerField("forced_tokens", np.int64, "sample_row"),  # -1 on rows without a forced token
    LedgerField("mtp_info_read_rows", np.int32, "sample_row", "mtp"),
    LedgerField("eos_suppression_rows", np.int32, "suppress_row"),
    LedgerField("selected_prompt_indices", np.int32, "prompt_row", "prompt"),
    LedgerField("prompt_token_targets", np.int32, "prompt_row", "prompt"),
)
# Broadcast fields that are not a SamplerInputs field of the same name: rebuilt or kept beside it.
_NOT_VERBATIM = {"request_keys", "sample_counts", "out_lens", "forced_tokens", "stop_ids", "row_drafts"}

HEADER = (
    "status",  # driver: 0 ok, 1 the payload is an error message
    "num_reqs",
    "num_sample_rows",
    "num_prompt_rows",
    "num_suppress_rows",
    "stop_width",
    "has_mtp",
    "has_prompt",
    "payload_bytes",
    "batch_fingerprint",  # 0: this rank has no view of the batch
    "hidden_rows",
    "hidden_size",
    "config_fingerprint",
)
_SLOT = {name: i for i, name in enumerate(HEADER)}


@dataclass
class StepPlan:
    """Everything a rank needs to run one step: the ledger, the stop-id
    matrix [n, S] int64 and the draft each sample row verifies [rows] int64
    (-1 none). On a follower `inputs.request_ids` are the request keys."""

    inputs: SamplerInputs
    stop_ids: np.ndarray
    row_drafts: np.ndarray


def request_key(request_id: Hashable) -> int:
    """A stable int64 for a request id, the same on every rank: the id itself
    when it is an int that fits, else 8 bytes of a hash of its repr."""
    if isinstance(request_id, (int, np.integer)) and not isinstance(request_id, bool) and -(2**63) <= request_id < 2**63:
        return int(request_id)
    digest = hashlib.blake2b(repr(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _digest(*arrays: np.ndarray) -> int:
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True) | 1  # never 0 ("no view")


def batch_fingerprint(seqs: Sequence[SeqMeta]) -> int:
    """What every rank must agree on about a batch: its requests, kinds and lengths."""
    keys = np.fromiter((request_key(s.request_id) for s in seqs), dtype=np.int64, count=len(seqs))
    shape = np.array([(s.is_prompt, s.seqlen_q, s.seqlen_k) for s in seqs], dtype=np.int64).reshape(-1, 3)
    return _digest(np.array([len(seqs)], dtype=np.int64), keys, shape)


def config_fingerprint(*values: object) -> int:
    """Fingerprint of the engine settings that must match across ranks."""
    return _digest(np.frombuffer(repr(values).encode(), dtype=np.uint8))


class LedgerBroadcaster:
    """Shares each step's plan from rank `src` to the group (see module doc).

    `device` is where the collective buffers live: CPU for gloo, the rank's
    GPU for NCCL (which only moves device tensors)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, src: int = 0, device: torch.device | str | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.src = src
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self._header = torch.zeros(len(HEADER), dtype=torch.int64)
        self._gathered = torch.zeros(self.world * len(HEADER), dtype=torch.int64, device=self.device)
        self._payload = torch.zeros(4096, dtype=torch.uint8)  # grown on demand, reused
        self.bytes_sent = 0  # header + payload bytes each rank received, summed over steps

    @property
    def is_driver(self) -> bool:
        return self.rank == self.src

    def share(
        self,
        build: Callable[[], StepPlan] | None,
        *,
        hidden_rows: int,
        hidden_size: int,
        config: int,
        batch: int = 0,
    ) -> StepPlan:
        """Run `build` on the driver (None on followers) and give every rank the plan.

        When the driver's `build` raises, the driver re-raises it and every
        follower raises ValueError with its message. Raises ValueError on every rank when
        ranks disagree on the configuration, the hidden-state shape or the
        batch (`batch`: a rank's own `batch_fingerprint`, 0 when it has none)."""
        header = self._header
        header.zero_()
        header[_SLOT["batch_fingerprint"]] = batch
        header[_SLOT["hidden_rows"]] = hidden_rows
        header[_SLOT["hidden_size"]] = hidden_size
        header[_SLOT["config_fingerprint"]] = config
        plan, error = None, None
        if self.is_driver:
            try:
                plan = build()
            except Exception as err:  # shared with the followers, then re-raised here
                error = err
            payload = self._pack(plan, header) if error is None else self._pack_error(error, header)
        gathered = self._gathered
        dist.all_gather_single(gathered, header.to(self.device), group=self.group)
        table = gathered.view(self.world, len(HEADER)).cpu().numpy()
        driver = table[self.src]
        nbytes = int(driver[_SLOT["payload_bytes"]])
        self.bytes_sent += gathered.numel() * 8 + nbytes
        if not driver[_SLOT["status"]]:
            self._check_agreement(table)
        if self.is_driver:
            message = payload[:nbytes]
        else:
            message = self._buffer(nbytes)
        wire = message.to(self.device)
        dist.broadcast(wire, self.src, group=self.group)
        if driver[_SLOT["status"]]:
            if error is not None:
                raise error
            raise ValueError(f"rank {self.src} (driver) rejected the batch: {bytes(wire.cpu().numpy()).decode()}")
        if self.is_driver:
            return plan
        return self._unpack(driver, wire.cpu().numpy())

    # -- checks ---------------------------------------------------------------------

    def _check_agreement(self, table: np.ndarray) -> None:
        driver = table[self.src]
        for rank, row in enumerate(table):
            if row[_SLOT["config_fingerprint"]] != driver[_SLOT["config_fingerprint"]]:
                raise ValueError(
                    f"rank {rank}: engine configuration differs from rank {self.src}'s "
                    "(vocabulary, tp, strategy, buckets or sampler settings)"
                )
            if row[_SLOT["hidden_size"]] != driver[_SLOT["hidden_size"]]:
                raise ValueError(
                    f"rank {rank}: hidden_states width {row[_SLOT['hidden_size']]}, "
                    f"rank {self.src} has {driver[_SLOT['hidden_size']]}"
                )
            if row[_SLOT["hidden_rows"]] != driver[_SLOT["hidden_rows"]]:
                raise ValueError(
                    f"rank {rank}: hidden_states has {row[_SLOT['hidden_rows']]} rows, "
                    f"rank {self.src} has {driver[_SLOT['hidden_rows']]} (ranks must hold the same batch)"
                )
            own, reference = row[_SLOT["batch_fingerprint"]], driver[_SLOT["batch_fingerprint"]]
            if own and reference and own != reference:
                raise ValueError(
                    f"rank {rank}: its batch differs from rank {self.src}'s "
                    f"(requests, kinds or lengths; fingerprint {int(own):#x} != {int(reference):#x})"
                )

    # -- packing ------------------------------------------------------------------

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if nbytes > self._payload.numel():
            self._payload = torch.zeros(max(nbytes, 2 * self._payload.numel()), dtype=torch.uint8)
        return self._payload[:nbytes]

    @staticmethod
    def _counts(header: np.ndarray | torch.Tensor) -> dict[str, int]:
        return {
            "req": int(header[_SLOT["num_reqs"]]),
            "sample_row": int(header[_SLOT["num_sample_rows"]]),
            "prompt_row": int(header[_SLOT["num_prompt_rows"]]),
            "suppress_row": int(header[_SLOT["num_suppress_rows"]]),
        }

    @staticmethod
    def _layout(header: np.ndarray | torch.Tensor) -> list[tuple[LedgerField, int, int, tuple[int, ...]]]:
        """(field, byte offset, byte count, shape) of every field present."""
        counts = LedgerBroadcaster._counts(header)
        present = {"mtp": bool(header[_SLOT["has_mtp"]]), "prompt": bool(header[_SLOT["has_prompt"]])}
        width = int(header[_SLOT["stop_width"]])
        layout, offset = [], 0
        for f in LEDGER_FIELDS:
            if f.only_with is not None and not present[f.only_with]:
                continue
            shape = (counts[f.per], width) if f.columns else (counts[f.per],)
            nbytes = int(np.prod(shape)) * np.dtype(f.dtype).itemsize
            layout.append((f, offset, nbytes, shape))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        return layout

    def _pack(self, plan: StepPlan, header: torch.Tensor) -> torch.Tensor:
        inputs = plan.inputs
        header[_SLOT["num_reqs"]] = inputs.num_reqs
        header[_SLOT["num_sample_rows"]] = inputs.num_sample_rows
        header[_SLOT["num_prompt_rows"]] = inputs.num_prompt_rows
        header[_SLOT["num_suppress_rows"]] = len(inputs.eos_suppression_rows)
        header[_SLOT["stop_width"]] = plan.stop_ids.shape[1]
        header[_SLOT["has_mtp"]] = inputs.mtp_info_read_rows is not None
        header[_SLOT["has_prompt"]] = inputs.selected_prompt_indices is not None
        layout = self._layout(header)
        total = layout[-1][1] + layout[-1][2] if layout else 0
        header[_SLOT["payload_bytes"]] = total
        buffer = self._buffer(total)
        raw = buffer.numpy()
        for f, offset, nbytes, shape in layout:
            raw[offset : offset + nbytes].view(f.dtype).reshape(shape)[...] = self._source(plan, f.name)
        return buffer

    def _pack_error(self, error: Exception, header: torch.Tensor) -> torch.Tensor:
        text = str(error).encode()
        header[_SLOT["status"]] = 1
        header[_SLOT["payload_bytes"]] = len(text)
        buffer = self._buffer(len(text))
        buffer.numpy()[:] = np.frombuffer(text, dtype=np.uint8)
        return buffer

    @staticmethod
    def _source(plan: StepPlan, name: str) -> np.ndarray:
        if name == "request_keys":
            return np.fromiter((request_key(r) for r in plan.inputs.request_ids), dtype=np.int64, count=plan.inputs.num_reqs)
        if name == "stop_ids":
            return plan.stop_ids
        if name == "row_drafts":
            return plan.row_drafts
        if name == "forced_tokens" and plan.inputs.forced_tokens is None:
            return np.full(plan.inputs.num_sample_rows, -1, dtype=np.int64)
        return getattr(plan.inputs, name)

    def _unpack(self, header: np.ndarray, raw: np.ndarray) -> StepPlan:
        arrays = {}
        for f, offset, nbytes, shape in self._layout(header):
            arrays[f.name] = raw[offset : offset + nbytes].view(f.dtype).reshape(shape).copy()
        n = int(header[_SLOT["num_reqs"]])
        sample_counts, out_lens = arrays.pop("sample_counts"), arrays.pop("out_lens")
        sample_offsets = exclusive_cumsum(sample_counts)[0]
        row_to_req = np.repeat(np.arange(n, dtype=np.int32), sample_counts)
        local_step = np.arange(len(row_to_req), dtype=np.int32) - sample_offsets[row_to_req]
        forced_tokens = arrays.pop("forced_tokens")
        request_keys, stop_ids, row_drafts = arrays.pop("request_keys"), arrays.pop("stop_ids"), arrays.pop("row_drafts")
        # Every other broadcast field is the SamplerInputs field of its name (None when the header left it out).
        verbatim = {f.name: arrays.pop(f.name, None) for f in LEDGER_FIELDS if f.name not in _NOT_VERBATIM}
        inputs = SamplerInputs(
            **verbatim,
            row_to_req=row_to_req,
            local_step=local_step,
            request_ids=tuple(request_keys.tolist()),
            num_output_rows=int(out_lens.sum()),
            out_offsets=exclusive_cumsum(out_lens)[0],
            out_lens=out_lens,
            sample_offsets=sample_offsets,
            sample_counts=sample_counts,
            forced_tokens=forced_tokens if (forced_tokens >= 0).any() else None,
        )
        plan = StepPlan(inputs, stop_ids, row_drafts)
        if arrays:
            raise RuntimeError(f"ledger fields {sorted(arrays)} are broadcast but never used")
        return plan
