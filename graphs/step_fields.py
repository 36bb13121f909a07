"""What the static buffers read of a declared per-step field, and the typed device views they make.

The per-step fields themselves are declared once, on the host side
(`engine/host/step_fields.py`, numpy only), and handed to
`StepBuffers.allocate`.
"""
from __future__ import annotations

import functools
from dataclasses import make_dataclass
from typing import Protocol

import torch


class FieldSpec(Protocol):
    """What graphs/ reads of a declared per-step field (engine/host/step_fields.py)."""

    name: str
    dtype: type  # numpy dtype; uint64 is staged as its int64 bits
    per: str  # "req": one entry per request slot; "row": one per sample-row slot
    padding: int | float | bool | str  # a value, or a rule resolved per step ("padding request", "past request rows")
    stage: str  # "sample": part of the sampler's view, `RowParams`
    width: int | str  # columns: an int, or "stop" / "draft" (max stop ids / max draft tokens)
    host_form: str  # "slots", or "row numbers": the host hands the rows where the bool field is True


# The stage whose fields make up `RowParams`, the sampler's view.
SAMPLE_STAGE = "sample"


@functools.lru_cache(maxsize=None)
def step_inputs_class(names: tuple[str, ...]) -> type:
    """The typed device views of a declaration: one tensor attribute per field
    (`buffers.inputs.row_drafts`, never a string key), in declaration order."""
    return make_dataclass(
        "StepInputs",
        [(name, torch.Tensor) for name in names],
        namespace={"__doc__": "Device views of the per-step fields (declaration order), full size."},
    )
