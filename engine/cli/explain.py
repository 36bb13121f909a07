"""`python -m engine explain`: the ledger of one step as tables.

The tool to reach for when a sample looks like it came from the wrong
request: per request, which output rows it owns, which it samples from and
at which positions, which rows feed prompt logprobs and with which target
tokens, which draft-info rows it reads; then the flat row map, row by row,
including the padding rows a graph bucket would add.

Batch syntax, one argument per request (`KIND:ID[:key=value,...]`):

    prefill:a:len=12,q=8            first 8 tokens of a 12-token prompt
    prefill:b:len=5,plp=2           whole prompt, prompt logprobs with top-2
    decode:c:len=5,gen=3,drafts=2,read=1,write=2

Keys: len (prompt_len), q (seqlen_q), k (seqlen_k), gen (num_generated),
drafts (decode: seqlen_q = 1 + drafts), read / write (draft-info slots),
forced (forced_token: the token the request's first sample row emits),
plp (prompt_logprobs: 0 = target only, N = with top-N), and any
SamplingParams field (temperature, top_k, top_p, min_p, seed, min_tokens,
logprobs, stop_token_ids: one id or several joined by '/', as 5/6). Defaults: a prefill covers the whole prompt (q = k = len); a
decode has k = len + gen + drafts. Prompt tokens, when needed, are
synthetic (1000 + position) unless a JSON batch gives them.

JSON batch (`--json FILE`, keys are SeqMeta's field names; docs/examples/batch.json
is one): {"max_draft_tokens": 3, "compaction_keep_tokens": null, "requests":
[{"request_id": "a", "is_prompt": true, "seqlen_q": 8, "seqlen_k": 8,
"prompt_len": 12, "params": {"prompt_logprobs": 2}}, ...]}
"""
from __future__ import annotations

import json
import re
from dataclasses import fields
from typing import Any, Sequence

import numpy as np

from engine.host.ledger import SamplerInputs, prepare_sampler_inputs
from engine.host.params import SamplingParams, SeqMeta
from engine.host.step_fields import STEP_FIELDS, StepField

_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}
_TUPLE_FIELDS = {f.name for f in fields(SamplingParams) if isinstance(f.default, tuple)}  # stop_token_ids
# The command-line key of each SeqMeta field it sets, so that errors speak the user's words.
_KEY_OF_FIELD = {"prompt_len": "len", "seqlen_q": "q", "seqlen_k": "k", "num_generated": "gen",
                 "mtp_read_slot": "read", "mtp_write_slot": "write", "forced_token": "forced"}
_SEQ_KEYS = {*_KEY_OF_FIELD.values(), "drafts", "plp"}

EXAMPLE_BATCH = [
    "prefill:chat-1:len=12,q=8,plp=2",  # first chunk of a long prompt, with prompt logprobs
    "prefill:chat-2:len=5,plp=0,temperature=0",  # a whole short prompt, greedy
    "decode:chat-3:len=7,gen=4,drafts=3,read=2,write=2,min_tokens=6",
    "decode:chat-4:len=3,gen=1,write=3,top_k=50,top_p=0.9",  # just out of prefill: reads slot 0
    "decode:chat-5:len=9,gen=2,drafts=1,read=4,write=4,seed=7",
]
EXAMPLE_MAX_DRAFT_TOKENS = 3


def _number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def parse_request(spec: str) -> SeqMeta:
    """One `KIND:ID[:key=value,...]` argument -> SeqMeta (ValueError names the argument)."""
    parts = spec.split(":", 2)
    if len(parts) < 2 or parts[0] not in ("prefill", "decode"):
        raise ValueError(f"{spec!r}: expected KIND:ID[:key=value,...] with KIND prefill or decode")
    kind, request_id = parts[0], parts[1]
    values: dict[str, Any] = {}
    if len(parts) == 3 and parts[2]:
        for item in parts[2].split(","):
            key, sep, value = item.partition("=")
            if not sep or (key not in _SEQ_KEYS and key not in _PARAM_FIELDS):
                raise ValueError(
                    f"request {request_id!r}: unknown item {item!r}; keys are "
                    f"{sorted(_SEQ_KEYS)} or SamplingParams fields {sorted(_PARAM_FIELDS)}"
                )
            if key in _TUPLE_FIELDS:
                values[key] = tuple(_number(v) for v in value.split("/") if v)
            else:
                values[key] = _number(value)
    if "len" not in values:
        raise ValueError(f"request {request_id!r}: len= (prompt_len) is required")
    prompt_len = values.pop("len")
    if "plp" in values:
        values["prompt_logprobs"] = values.pop("plp")
        if values["prompt_logprobs"] == 0:
            values["prompt_logprobs"] = True
    gen = values.pop("gen", 0)
    if kind == "prefill":
        seqlen_q = values.pop("q", prompt_len)
        seqlen_k = values.pop("k", seqlen_q)
    else:
        drafts = values.pop("drafts", 0)
        seqlen_q = values.pop("q", 1 + drafts)
        seqlen_k = values.pop("k", prompt_len + gen + seqlen_q - 1)
    read, write = values.pop("read", 0), values.pop("write", 0)
    forced = values.pop("forced", None)
    try:
        params = SamplingParams(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"request {request_id!r}: {err}") from None
    tokens = 1000 + np.arange(prompt_len) if isinstance(prompt_len, int) and prompt_len > 0 else None
    return SeqMeta(
        request_id,
        is_prompt=kind == "prefill",
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        prompt_len=prompt_len,
        prompt_tokens=tokens,
        num_generated=gen,
        params=params,
        mtp_read_slot=read,
        mtp_write_slot=write,
        forced_token=forced,
    )


def in_spec_words(err: ValueError) -> ValueError:
    """The same error with SeqMeta's field names replaced by the `KIND:ID:key=value` keys that set them
    (`mtp_write_slot=0` -> `write=0`)."""
    message = str(err)
    for name, key in _KEY_OF_FIELD.items():
        message = re.sub(rf"\b{name}=", f"{key}=", message)
    return ValueError(message)


def load_json_batch(path: str) -> tuple[list[SeqMeta], int, int | None]:
    """A JSON batch file -> (seqs, max_draft_tokens, compaction_keep_tokens); ValueError names the
    request (its id, or #index) and what is wrong with it."""
    with open(path) as f:
        doc = json.load(f)
    seqs = []
    for i, req in enumerate(doc.get("requests", [])):
        req = dict(req)
        req.setdefault("request_id", f"#{i}")
        try:
            params = SamplingParams(**req.pop("params", {}))
            if req.get("prompt_tokens") is None and params.num_prompt_logprobs >= 0 and "prompt_len" in req:
                req["prompt_tokens"] = 1000 + np.arange(req["prompt_len"])
            seqs.append(SeqMeta(params=params, **req))
        except TypeError as err:  # a missing or unknown key
            raise ValueError(f"{path}: request {req['request_id']!r}: {err}") from None
    return seqs, int(doc.get("max_draft_tokens", 0)), doc.get("compaction_keep_tokens")


def _ranges(rows: np.ndarray) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    if len(rows) == 0:
        return "-"
    out, start, prev = [], int(rows[0]), int(rows[0])
    for r in map(int, rows[1:]):
        if r != prev + 1:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = r
        prev = r
    out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out)


LEGEND = """\
  q, k         query tokens this step (seqlen_q); context length after them (seqlen_k)
  out rows     the model-output rows the request owns, in batch order
  sample rows  the rows whose logits are sampled (prefill: one, the last; decode: all of them)
  positions    absolute position of the token each sample row produces, one per sample row
               (prefill: k, the first generated token; decode: k - q + 1 onward)
  eos-         sample rows where EOS and the stop ids are masked (fewer than min_tokens
               generated yet), out of the request's sample rows; - = none
  prompt rows  row->target: the row whose logits score that prompt token (prompt logprobs)
  draft info   rows of the draft-info pool read by each sample row (0 = padding), and the
               slot this step writes"""


FIELDS_LEGEND = """\
  per          one entry per request slot or per sample-row slot of a graph bucket (x stop: one
               column per EngineConfig.max_stop_ids, x draft: per max_draft_tokens)
  padding      what a padding slot holds: 'padding request' = a padding request slot (0 when every
               slot is real), 'past request rows' = 1 + max_draft_tokens (past every real row)
  read by      the stage of the captured step that reads the field
  from         ledger; params.X = that SamplingParams field, via the request columns; engine or
               step(arg) = built by the engine from its config or that step() argument
  this step    the values this batch stages (ledger fields only; - = not known without an engine)"""


def _preview(values: np.ndarray | None, width: int = 24) -> str:
    """The leading values that fit in about `width` characters: [1.0, 0.7, 1.0, ...] ->
    '1 0.7 1 ... (12)'; None -> 'none' (the field stages padding only)."""
    if values is None:
        return "none"
    shown: list[str] = []
    for v in values.tolist():
        text = f"{v:g}" if isinstance(v, float) else str(v)
        if shown and len(" ".join(shown)) + 1 + len(text) > width:
            return " ".join(shown) + f" ... ({len(values)})"
        shown.append(text)
    return " ".join(shown) or "-"


def field_table(inputs: SamplerInputs, step_fields: Sequence[StepField] = STEP_FIELDS) -> str:
    """Every declared per-step field: its layout, padding, reader, source and this step's values."""
    rows = []
    for f in step_fields:
        per = "request" if f.per == "req" else "row"
        rows.append([
            f.name,
            per if f.width == 1 else f"{per} x {f.width}",
            np.dtype(f.dtype).name,
            f.padding,
            f.stage,
            f.source,
            _preview(getattr(inputs, f.name)) if f.from_ledger else "-",
            f.meaning,
        ])
    headers = ["field", "per", "dtype", "padding", "read by", "from", "this step", "meaning"]
    return "\n".join([f"Step fields: what the captured step reads, {len(rows)} declared "
                      "(engine/host/step_fields.py)", _table(headers, rows), FIELDS_LEGEND])


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def render(
    seqs: Sequence[SeqMeta],
    inputs: SamplerInputs,
    *,
    max_draft_tokens: int,
    bucket: int | None,
    step_fields: Sequence[StepField] = STEP_FIELDS,
) -> str:
    """The per-request ledger table, the flat row map and the staged step fields."""
    n = inputs.num_reqs
    prompt_offsets = np.concatenate([[0], np.cumsum(inputs.prompt_row_counts)])
    suppressed = set(inputs.eos_suppression_rows.tolist())
    per_request = []
    for i, seq in enumerate(seqs):
        s0, sc = int(inputs.sample_offsets[i]), int(inputs.sample_counts[i])
        sample_rows = inputs.selected_token_indices[s0 : s0 + sc]
        pos0 = int(inputs.sample_positions[i])
        positions = f"{pos0}" if sc == 1 else f"{pos0}-{pos0 + sc - 1}"
        if inputs.selected_prompt_indices is None or inputs.prompt_row_counts[i] == 0:
            prompt = "-" if inputs.num_prompt_logprobs[i] < 0 else "(none this chunk)"
        else:
            p0, p1 = int(prompt_offsets[i]), int(prompt_offsets[i + 1])
            prompt = " ".join(
                f"{r}->{t}"
                for r, t in zip(inputs.selected_prompt_indices[p0:p1], inputs.prompt_token_targets[p0:p1])
            )
        draft = "-"
        if inputs.mtp_info_read_rows is not None and not seq.is_prompt:
            reads = inputs.mtp_info_read_rows[s0 : s0 + sc]
            draft = f"read {reads.tolist()} write {int(inputs.mtp_info_write_slots[i])}"
        elif inputs.mtp_info_write_slots is not None:
            draft = f"write {int(inputs.mtp_info_write_slots[i])}"
        kind = "decode" if not seq.is_prompt else ("prefill" if inputs.is_last_chunk[i] else "prefill (chunk)")
        eos = sum(1 for r in range(s0, s0 + sc) if r in suppressed)
        per_request.append(
            [
                i,
                seq.request_id,
                kind,
                seq.seqlen_q,
                seq.seqlen_k,
                _ranges(np.arange(inputs.out_offsets[i], inputs.out_offsets[i] + inputs.out_lens[i])),
                _ranges(sample_rows),
                positions,
                f"{eos}/{sc}" if eos else "-",
                prompt,
                draft,
            ]
        )
    headers = ["#", "request", "kind", "q", "k", "out rows", "sample rows", "positions", "eos-", "prompt rows->target", "draft info"]
    parts = [f"Ledger: {n} requests, {inputs.num_output_rows} output rows, "
             f"{inputs.num_sample_rows} sample rows, {inputs.num_prompt_rows} prompt rows",
             _table(headers, per_request), LEGEND]

    # Flat row map: owner of each output row and what it feeds.
    role = np.full(inputs.num_output_rows, "", dtype=object)
    for r in inputs.selected_token_indices:
        role[r] += "S"
    if inputs.selected_prompt_indices is not None:
        for r in inputs.selected_prompt_indices:
            role[r] += "P"
    owner = np.repeat(np.arange(n), inputs.out_lens)
    row_map = []
    for r in range(inputs.num_output_rows):
        i = int(owner[r])
        j = r - int(inputs.out_offsets[i])
        clipped = int(seqs[i].seqlen_q - inputs.out_lens[i])
        query_pos = seqs[i].seqlen_k - seqs[i].seqlen_q + clipped + j
        row_map.append([r, seqs[i].request_id, j, query_pos, query_pos + 1, role[r] or "."])
    parts.append(
        "Row map (S = sample row, P = prompt-logprob row, . = context only; "
        "a row at position p predicts p + 1):"
    )
    parts.append(_table(["row", "request", "j", "position", "predicts", "role"], row_map))
    if bucket:
        capacity = bucket * (1 + max_draft_tokens)
        parts.append(
            f"Graph bucket {bucket}: {capacity} sample-row slots, {inputs.num_sample_rows} used. "
            f"Slots {_ranges(np.arange(inputs.num_sample_rows, capacity))} are padding: their gather "
            f"index is out of range on purpose (they read a zero row) and request slots "
            f"{_ranges(np.arange(n, bucket))} carry neutral parameters."
        )
    parts.append(field_table(inputs, step_fields))
    return "\n\n".join(parts)


def explain(
    seqs: Sequence[SeqMeta],
    *,
    max_draft_tokens: int = 0,
    compaction_keep_tokens: int | None = None,
    bucket: int | None = None,
    step_fields: Sequence[StepField] = STEP_FIELDS,
) -> str:
    """The ledger of one step as tables (see the module docstring)."""
    inputs = prepare_sampler_inputs(
        seqs, max_draft_tokens=max_draft_tokens, compaction_keep_tokens=compaction_keep_tokens
    )
    if bucket is not None and bucket < len(seqs):
        raise ValueError(f"bucket={bucket}: smaller than the batch ({len(seqs)} requests)")
    return render(seqs, inputs, max_draft_tokens=max_draft_tokens, bucket=bucket, step_fields=step_fields)
