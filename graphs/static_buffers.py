"""The static buffers of the captured step: one typed object, fixed addresses.

Everything a captured graph reads or writes lives here, sized once for the
largest bucket; a bucket's graph works on leading slices. Per step the host
packs every index and parameter array into ONE staging area (pinned on CUDA)
and ONE copy moves it into the device twin, whose typed views are the step's
inputs. The field list is declared once (`STEP_FIELDS`): the packed layout,
the staging views and the padding values derive from it.

Why padding is safe: a padding sample row gets gather index -1, outside the
hidden-state source, so it reads a zero row (never stray memory or a stale
row of the previous step), and points at a request slot with neutral
parameters, so its logits and draw stay finite and are then cut off.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from graphs.step_fields import STEP_FIELDS, RowParams, SampleOutput, StepInputs

_ALIGN = 8  # bytes; every field starts 8-aligned so any dtype view is legal

_NEUTRAL = {f.name: f.neutral for f in STEP_FIELDS}
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


@dataclass
class StepBuffers:
    """Static tensors of the step, for `max_reqs` request slots and `max_rows` sample-row slots."""

    max_reqs: int
    max_rows: int
    rows_per_req: int  # 1 + max_draft_tokens
    device: torch.device
    source: torch.Tensor  # [max_source_rows, H] model dtype: the hidden-state source
    hidden: torch.Tensor  # [max_rows, H] gathered sample rows
    logits: torch.Tensor  # [max_rows, V] fp32
    out: SampleOutput  # [max_rows] results
    num_accepted: torch.Tensor  # [max_reqs] int64: drafts accepted per request
    emitted: torch.Tensor  # [max_rows] int64: rejection mode's emitted token per row (-1 = none)
    resolved_drafts: torch.Tensor  # [max_rows] int64: the draft each row verified (staged or from the pool)
    pool_tokens: torch.Tensor  # [(pool_slots + 1) * max_draft] int64; the extra slot absorbs "no write"
    pool_logprobs: torch.Tensor  # same shape, f32
    draft_probs: torch.Tensor | None  # [max_rows, V] f32, rejection mode only: q of each row's draft
    packed: torch.Tensor  # [nbytes] uint8 on the device: every per-step field
    staging: torch.Tensor  # [nbytes] uint8 on the host (pinned on CUDA)
    inputs: StepInputs  # typed device views into `packed`, full size, one per STEP_FIELDS entry
    staged: dict[str, np.ndarray]  # numpy views into `staging`, full size
    _copy_done: torch.cuda.Event | None = None
    # Per staged field: leading entries that may hold non-neutral values.
    _high_water: dict[str, int] = field(default_factory=lambda: {f.name: 0 for f in STEP_FIELDS})

    @classmethod
    def allocate(
        cls,
        *,
        max_reqs: int,
        max_draft_tokens: int,
        max_source_rows: int,
        hidden_size: int,
        vocab_size: int,
        max_logprobs: int,
        max_stop_ids: int,
        source_dtype: torch.dtype,
        device: torch.device,
        pool_slots: int = 0,
        draft_probs: bool = False,
    ) -> StepBuffers:
        rows_per_req = 1 + max_draft_tokens
        max_rows = max_reqs * rows_per_req
        widths = {"stop": max_stop_ids, "draft": max(max_draft_tokens, 1)}
        layout, offset = [], 0
        for f in STEP_FIELDS:
            width = widths.get(f.width, f.width) if isinstance(f.width, str) else f.width
            count = (max_rows if f.per == "row" else max_reqs) * width
            nbytes = count * torch.tensor([], dtype=f.dtype).element_size()
            layout.append((f, width, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        pinned = device.type == "cuda"
        staging = torch.zeros(offset, dtype=torch.uint8, pin_memory=pinned)
        packed = torch.zeros(offset, dtype=torch.uint8, device=device)
        fields, staged = {}, {}
        host_bytes = staging.numpy()
        for f, width, start, nbytes in layout:
            shape = (-1, width) if isinstance(f.width, str) else (-1,)
            fields[f.name] = packed[start : start + nbytes].view(f.dtype).view(shape)
            staged[f.name] = host_bytes[start : start + nbytes].view(_NUMPY[f.dtype]).reshape(shape)
            staged[f.name][...] = f.neutral
        packed.copy_(staging)
        # Draft-info pool (docs/contract.md §1.3): slot 0 is padding and never written:
        # token V - 1, logprob 0 in its first entry and -inf after, so reading
        # it biases nothing. Writes aimed at slot 0 land in the extra last slot.
        width = max(max_draft_tokens, 1)
        pool_tokens = torch.full(((pool_slots + 1) * width,), -1, dtype=torch.int64, device=device)
        pool_logprobs = torch.full(((pool_slots + 1) * width,), -float("inf"), device=device)
        pool_tokens[:width] = vocab_size - 1
        pool_logprobs[0] = 0.0
        return cls(
            max_reqs=max_reqs,
            max_rows=max_rows,
            rows_per_req=rows_per_req,
            device=device,
            source=torch.zeros(max_source_rows, hidden_size, dtype=source_dtype, device=device),
            hidden=torch.zeros(max_rows, hidden_size, dtype=source_dtype, device=device),
            logits=torch.zeros(max_rows, vocab_size, dtype=torch.float32, device=device),
            out=SampleOutput.allocate(max_rows, max_logprobs, device),
            num_accepted=torch.zeros(max_reqs, dtype=torch.int64, device=device),
            emitted=torch.full((max_rows,), -1, dtype=torch.int64, device=device),
            resolved_drafts=torch.full((max_rows,), -1, dtype=torch.int64, device=device),
            pool_tokens=pool_tokens,
            pool_logprobs=pool_logprobs,
            draft_probs=torch.zeros(max_rows, vocab_size, device=device) if draft_probs else None,
            packed=packed,
            staging=staging,
            inputs=StepInputs(**fields),
            staged=staged,
            _copy_done=torch.cuda.Event() if pinned else None,
        )

    def rows_for(self, bucket: int) -> int:
        """Sample-row capacity of a bucket: every request may verify max drafts."""
        return bucket * self.rows_per_req

    def static_tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer the captured step touches, by name (for address checks)."""
        named = {
            "source": self.source,
            "hidden": self.hidden,
            "logits": self.logits,
            "packed": self.packed,
            "num_accepted": self.num_accepted,
            "emitted": self.emitted,
            "resolved_drafts": self.resolved_drafts,
            "pool_tokens": self.pool_tokens,
            "pool_logprobs": self.pool_logprobs,
        }
        if self.draft_probs is not None:
            named["draft_probs"] = self.draft_probs
        named.update({f"out.{k}": v for k, v in vars(self.out).items()})
        return named

    def load(
        self,
        *,
        bucket: int,
        selected_token_indices: np.ndarray,
        row_to_req: np.ndarray,
        local_step: np.ndarray,
        eos_suppression_rows: np.ndarray,
        temperatures: np.ndarray,
        top_ks: np.ndarray,
        top_ps: np.ndarray,
        min_ps: np.ndarray,
        seeds: np.ndarray,
        sample_positions: np.ndarray,
        stop_ids: np.ndarray,
        forced_tokens: np.ndarray | None = None,
        row_drafts: np.ndarray | None = None,
        mtp_info_read_rows: np.ndarray | None = None,
        has_draft_probs: np.ndarray | None = None,
        mtp_info_write_slots: np.ndarray | None = None,
        next_draft_tokens: np.ndarray | None = None,
        next_draft_logprobs: np.ndarray | None = None,
    ) -> None:
        """Stage one step's arrays (real entries, then padding up to the
        bucket) and issue the single host-to-device copy."""
        n, rows = len(temperatures), len(selected_token_indices)
        cap_reqs, cap_rows = bucket, self.rows_for(bucket)
        if n > cap_reqs or rows > cap_rows:
            raise ValueError(f"bucket={bucket}: holds {cap_reqs} requests / {cap_rows} rows, step has {n} / {rows}")
        if self._copy_done is not None:
            # The previous step's copy may still read the staging area.
            self._copy_done.synchronize()
        s = self.staged
        # Padding rows point at a padding request slot when there is one
        # (neutral parameters); when every slot is real they reuse slot 0,
        # harmless since their gathered row is zero and their result is cut off.
        pad_req = n if n < cap_reqs else 0
        # A padding row's local_step lies past every real row of its request
        # (>= rows_per_req), so per-request reductions over rows (accepted
        # drafts) never count it even when it shares request slot 0.
        for name, real, pad in (
            ("selected_token_indices", selected_token_indices, -1),
            ("row_to_req", row_to_req, pad_req),
            ("local_step", local_step, self.rows_per_req),
        ):
            s[name][:rows] = real
            s[name][rows:cap_rows] = pad
        # Fields with a fixed neutral value: write the real entries, then reset
        # only what an earlier step left non-neutral past them. Everything
        # beyond a field's high-water mark is neutral already (allocate wrote
        # it, fill_garbage raises the marks), so a steady batch pays nothing
        # for padding.
        hw = self._high_water

        def put(name: str, real: np.ndarray | bool | None, count: int) -> None:
            view = s[name]
            if real is None:
                count = 0
            else:
                view[:count] = real
            if hw[name] > count:
                view[count : hw[name]] = _NEUTRAL[name]
            hw[name] = count

        put("eos_suppression_rows", False, rows)
        s["eos_suppression_rows"][eos_suppression_rows] = True
        put("forced_tokens", forced_tokens, rows)
        put("row_drafts", row_drafts, rows)
        put("mtp_info_read_rows", mtp_info_read_rows, rows)
        put("has_draft_probs", has_draft_probs, rows)
        put("mtp_info_write_slots", mtp_info_write_slots, n)
        put("next_draft_tokens", next_draft_tokens, n)
        put("next_draft_logprobs", next_draft_logprobs, n)
        put("temperatures", temperatures, n)
        put("top_ks", top_ks, n)
        put("top_ps", top_ps, n)
        put("min_ps", min_ps, n)
        put("seeds", seeds.view(np.int64), n)
        put("sample_positions", sample_positions, n)
        put("stop_ids", stop_ids, n)
        non_blocking = self._copy_done is not None
        # Copied as int64 words: torch's CPU byte copy goes through a parallel
        # path that costs milliseconds on a busy 2-core machine.
        self.packed.view(torch.int64).copy_(self.staging.view(torch.int64), non_blocking=non_blocking)
        if self._copy_done is not None:
            self._copy_done.record()

    def params(self, bucket: int) -> RowParams:
        """The sampler's view of a bucket: leading slices of the static fields."""
        reqs, rows = bucket, self.rows_for(bucket)
        f = self.inputs
        return RowParams(
            temperatures=f.temperatures[:reqs],
            top_ks=f.top_ks[:reqs],
            top_ps=f.top_ps[:reqs],
            min_ps=f.min_ps[:reqs],
            seeds=f.seeds[:reqs],
            sample_positions=f.sample_positions[:reqs],
            stop_ids=f.stop_ids[:reqs],
            row_to_req=f.row_to_req[:rows],
            local_step=f.local_step[:rows],
            eos_suppression_rows=f.eos_suppression_rows[:rows],
            forced_tokens=f.forced_tokens[:rows],
        )

    def outputs(self, rows: int) -> SampleOutput:
        """Leading `rows` of the sampler's output buffers (views, no copy)."""
        return SampleOutput(**{k: v[:rows] for k, v in vars(self.out).items()})

    def fill_garbage(self, generator: torch.Generator | None = None) -> None:
        """Test hook: scribble over every staged field and output buffer, as a
        previous step with other requests would have left them."""
        for name, view in self.staged.items():
            view[...] = np.random.default_rng(0).integers(-5, 2**20, view.shape).astype(view.dtype)
            self._high_water[name] = len(view)
        self.packed.copy_(self.staging)
        for tensor in (self.hidden, self.logits, self.num_accepted, self.emitted, *vars(self.out).values()):
            if tensor.dtype == torch.bool:
                tensor.fill_(True)
            elif tensor.is_floating_point():
                tensor.normal_(generator=generator).mul_(1e3)
            else:
                tensor.random_(0, 2**20, generator=generator)

