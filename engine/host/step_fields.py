"""Every per-step field, declared once.

A per-step field is an array the host stages for the captured step each step:
one entry per request slot or per sample-row slot of a graph bucket. Its
declaration says what it is called (the contract's name, docs/contract.md §1,
from the ledger to the kernel), its dtype, whether it is per request or per
row, how wide it is, what a padding slot holds, which stage of the step reads
it, what it means, and where its host value comes from.

Everything else derives from `STEP_FIELDS`: the request columns of the
sampling parameters in the records the ledger reads (`engine/host/param_records.py`), the
ledger's parameter arrays
(`SamplerInputs.temperatures`, ...), the staged host arrays (`StepArrays`),
the packed staging layout, the padding and the typed device views
(`StepBuffers`, which gets the declaration at allocate time: `graphs/` knows
nothing of `engine/`), the sampler's view (`StepBuffers.params`) and what
`python -m engine explain` prints.

Numpy only: the host side (the ledger, `explain`) does not import torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Per = Literal["req", "row"]
# Which stage of the captured step reads the field first (docs/contract.md §2-§4).
Stage = Literal["gather", "controls", "sample", "verify", "draft pool"]
# Padding that depends on the step; `StepBuffers.load` resolves it per step:
# "padding request": a padding request slot (slot 0 when every slot is real);
# "past request rows": 1 + max_draft_tokens, past every real row of a request.
PaddingRule = Literal["padding request", "past request rows"]
HostForm = Literal["slots", "row numbers"]


@dataclass(frozen=True)
class StepField:
    """One per-step field. See the module docstring."""

    name: str
    dtype: type  # numpy dtype staged on the device (uint64 travels as its int64 bits)
    per: Per  # one entry per request slot or per sample-row slot
    padding: int | float | bool | PaddingRule  # what a padding slot of a bucket holds
    stage: Stage
    # Where the host value comes from: "ledger" (the row ledger computes it),
    # "params.<attribute>" (a SamplingParams attribute, via the request
    # columns and the ledger), "engine" or "step(<argument>)" (the engine
    # builds it, from its config or from that `StepEngine.step` argument).
    source: str
    meaning: str  # one line, printed by `python -m engine explain`
    width: int | Literal["stop", "draft"] = 1  # columns: 1, EngineConfig.max_stop_ids, max_draft_tokens
    # "req": the values are request slots of the step (renumbered when a step is split).
    index_of: Literal["req"] | None = None
    # "row numbers": the host hands the numbers of the rows where this bool field is True.
    host_form: HostForm = "slots"

    def __post_init__(self) -> None:
        if self.per not in ("req", "row"):
            raise ValueError(f"StepField {self.name!r}: per={self.per!r}: must be 'req' or 'row'")
        if self.host_form == "row numbers" and (self.per != "row" or self.dtype is not np.bool_):
            raise ValueError(f"StepField {self.name!r}: host_form='row numbers' needs a per-row bool field")

    @property
    def param(self) -> str | None:
        """The SamplingParams attribute the field stages, or None."""
        return self.source.removeprefix("params.") if self.source.startswith("params.") else None

    @property
    def from_ledger(self) -> bool:
        """True when `SamplerInputs` carries the host value under the field's name."""
        return self.source == "ledger" or self.param is not None


STEP_FIELDS: tuple[StepField, ...] = (
    StepField("selected_token_indices", np.int64, "row", -1, "gather", "ledger",
              "model-output row each sample row gathers (padding: out of range, a zero row)"),
    StepField("row_to_req", np.int64, "row", "padding request", "sample", "ledger",
              "request slot owning each sample row", index_of="req"),
    StepField("local_step", np.int64, "row", "past request rows", "sample", "ledger",
              "index of the row inside its request: row j verifies drafts 0..j-1"),
    StepField("sample_positions", np.int64, "req", 0, "sample", "ledger",
              "absolute position of the token the request's first sample row produces"),
    StepField("control_slots", np.int64, "req", 0, "controls", "engine",
              "sampling-control slot (penalties, logit bias, allowed tokens) of the request, 0 = none"),
    StepField("masked_rows", np.bool_, "row", False, "controls", "step(token_bitmask)",
              "rows whose token bitmask restricts them this step (the kernel head's controls skip the others)"),
    StepField("temperatures", np.float32, "req", 1.0, "sample", "params.temperature", "temperature, 0 = greedy"),
    StepField("top_ks", np.int32, "req", 0, "sample", "params.top_k", "top-k, 0 = off"),
    StepField("top_ps", np.float32, "req", 1.0, "sample", "params.top_p", "top-p, 1 = off"),
    StepField("min_ps", np.float32, "req", 0.0, "sample", "params.min_p", "min-p, 0 = off"),
    StepField("seeds", np.uint64, "req", 0, "sample", "params.seed",
              "RNG seed of the request (derived from its id when params.seed is None)"),
    StepField("stop_ids", np.int64, "req", -1, "sample", "engine",
              "EOS (also under ignore_eos) and params.stop_token_ids, -1 = no id", width="stop"),
    StepField("eos_suppression_rows", np.bool_, "row", False, "sample", "ledger",
              "rows whose EOS and stop ids are masked: fewer than min_tokens generated", host_form="row numbers"),
    StepField("forced_tokens", np.int64, "row", -1, "sample", "ledger",
              "forced token of the row (SeqMeta.forced_token on a request's first sample row), -1 = none"),
    StepField("draw_uniforms", np.float64, "row", 0.5, "sample", "engine",
              "uniform of the row's inverse-CDF draw, hashed on the host from its seed and position"),
    StepField("row_drafts", np.int64, "row", -1, "verify", "step(draft_tokens)",
              "draft the row verifies: a token, -1 none (a request's last row), -2 from the draft-info pool"),
    StepField("has_draft_probs", np.bool_, "row", False, "verify", "step(draft_logprobs)",
              "rejection mode: the q of the row's draft is staged"),
    StepField("mtp_info_read_rows", np.int64, "row", 0, "draft pool", "ledger",
              "draft-info pool row each sample row reads (0 = padding)"),
    StepField("mtp_info_write_slots", np.int64, "req", 0, "draft pool", "ledger",
              "pool slot the request's next drafts are written to, 0 = no write"),
    StepField("next_draft_tokens", np.int64, "req", -1, "draft pool", "step(next_drafts)",
              "a draft head's proposals for the request's next step", width="draft"),
    StepField("next_draft_logprobs", np.float32, "req", 0.0, "draft pool", "step(next_draft_logprobs)",
              "log-probabilities of those proposals", width="draft"),
)

# The sampling parameters: one request column each, passed through by the ledger.
PARAM_FIELDS: tuple[StepField, ...] = tuple(f for f in STEP_FIELDS if f.param is not None)
# What `SamplerInputs` hands straight to the staging (`StepArrays.from_inputs`).
FROM_LEDGER_FIELDS: tuple[StepField, ...] = tuple(f for f in STEP_FIELDS if f.from_ledger)
# A `row_drafts` value: the row's draft is read from the draft-info pool inside the graph.
READ_FROM_POOL = -2
