"""The ledger of one step as tables a person reads (`python -m engine explain`,
`BatchStep.explain()`, `demo --explain-step N`): per request its rows, sample rows,
positions, prompt-logprob rows and draft-info rows; the flat row map; the per-step
fields the captured step reads. Every table fits in `WIDTH` columns: a cell too
long for its column wraps onto the lines below, inside its column."""
from __future__ import annotations

import textwrap
from typing import Hashable, NamedTuple, Sequence

import numpy as np

from engine.host.ledger import SamplerInputs
from engine.host.step_fields import STEP_FIELDS, StepField

WIDTH = 100  # columns of every table


class LedgerRequest(NamedTuple):
    """What the tables need of one request of the step, beside the ledger's arrays."""

    request_id: Hashable
    is_prompt: bool
    seqlen_q: int
    seqlen_k: int


LEGEND = """\
  q, k         query tokens this step (seqlen_q); context length after them (seqlen_k)
  kind         decode; prefill (the whole prompt in one step); prefill (chunk): a chunk that
               does not finish the prompt; prefill (last chunk): the chunk that finishes it
  out rows     the model-output rows the request owns, in batch order
  sample rows  the rows whose logits are sampled (prefill: one, the last; decode: all of them);
               'discarded': a prefill chunk that does not finish the prompt samples its row
               like any other, and its token is thrown away
  positions    absolute position of the token each sample row produces, one per sample row
               (prefill: k, the first generated token; decode: k - q + 1 onward)
  eos-         sample rows where EOS and the stop ids are masked (fewer than min_tokens
               generated yet), out of the request's sample rows; - = none
  prompt rows  the rows whose logits score prompt tokens (prompt logprobs); below the table,
               row->target: the prompt token each of them scores
  draft info   rows of the draft-info pool read by each sample row (0 = padding), and the
               slot this step writes"""

ROW_MAP_TITLE = textwrap.fill(
    "Row map (S = sample row, D = sample row whose token is discarded, P = prompt-logprob row, "
    ". = context only; a row at position p predicts p + 1; a run of context rows, or of P rows, "
    "of one request is one line):", WIDTH)

FIELDS_LEGEND = """\
  per          one entry per request slot or per sample-row slot of a graph bucket (x stop: one
               column per EngineConfig.max_stop_ids, x draft: per max_draft_tokens)
  padding      what a padding slot holds: 'padding request' = a padding request slot (0 when
               every slot is real), 'past request rows' = 1 + max_draft_tokens (past every
               real row)
  read by      the stage of the captured step that reads the field
  from         ledger; params.X = that SamplingParams field, via the request columns; engine
               or step(arg) = built by the engine from its config or that step() argument
  this step    under each field, after what it means: the values this batch stages (ledger
               fields only; - = not known without an engine)"""


def ranges(rows: np.ndarray) -> str:
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


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, width: int = WIDTH,
          narrow_first: Sequence[int] = (), keep: Sequence[int] = ()) -> str:
    """Left-aligned columns two spaces apart, at most `width` wide. While the table is too
    wide, the widest column gives up a character and its cells (header too) wrap onto more
    lines: first among `narrow_first`, then among the others; never one in `keep`. Each
    group narrows down to the longest word in a column, then, if that is not enough, breaks
    long words (an id) down to the header's longest word."""
    head, rule, body = table_lines(headers, rows, width=width, narrow_first=narrow_first, keep=keep)
    return "\n".join([*head, rule, *(line for row in body for line in row)])


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[object]], *, width: int = WIDTH,
                narrow_first: Sequence[int] = (), keep: Sequence[int] = ()) -> tuple[list[str], str, list[list[str]]]:
    """`table`'s header lines, rule and the lines of each row."""
    cells = [[str(c) for c in row] for row in rows]
    columns = [[h, *(r[i] for r in cells)] for i, h in enumerate(headers)]
    widths = [max(map(len, column)) for column in columns]
    whole_words = [max(len(word) for text in column for word in text.split() or [""]) for column in columns]
    header_words = [max(4, *map(len, h.split())) for h in headers]
    others = [i for i in range(len(headers)) if i not in narrow_first and i not in keep]
    for group in (narrow_first, others):
        for floors in (whole_words, header_words):
            while sum(widths) + 2 * (len(widths) - 1) > width:
                shrinkable = [i for i in group if widths[i] > floors[i]]
                if not shrinkable:
                    break
                widths[max(shrinkable, key=lambda i: widths[i])] -= 1

    def lines(row: Sequence[str]) -> list[str]:
        parts = [textwrap.wrap(c, w, break_on_hyphens=False) or [""] for c, w in zip(row, widths)]
        return ["  ".join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(parts, widths)).rstrip()
                for k in range(max(map(len, parts)))]

    return lines(list(headers)), "  ".join("-" * w for w in widths), [lines(row) for row in cells]


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
    """Every declared per-step field: its layout, padding, reader and source on one line;
    what it means and this step's values on the lines below it (wrapped by row)."""
    headers = ["field", "per", "dtype", "padding", "read by", "from"]
    rows, notes = [], []
    for f in step_fields:
        per = "request" if f.per == "req" else "row"
        rows.append([f.name, per if f.width == 1 else f"{per} x {f.width}", np.dtype(f.dtype).name, f.padding,
                     f.stage, f.source])
        this_step = _preview(getattr(inputs, f.name)) if f.from_ledger else "-"
        notes.append(textwrap.fill(f"{f.meaning}; this step: {this_step}", WIDTH, initial_indent="    ",
                                   subsequent_indent="    "))
    head, rule, body = table_lines(headers, rows)
    return "\n".join([f"Step fields: what the captured step reads, {len(rows)} declared "
                      "(engine/host/step_fields.py)", *head, rule,
                      *(line for row, note in zip(body, notes) for line in [*row, note]), FIELDS_LEGEND])


def _kind(request: LedgerRequest, is_last_chunk: bool) -> str:
    if not request.is_prompt:
        return "decode"
    if not is_last_chunk:
        return "prefill (chunk)"
    return "prefill" if request.seqlen_q == request.seqlen_k else "prefill (last chunk)"


def request_table(requests: Sequence[LedgerRequest], inputs: SamplerInputs) -> str:
    """Per request: its rows, sample rows and positions, masks, prompt rows, draft info; then
    each prompt-logprob row with the prompt token it scores, below the table."""
    prompt_offsets = np.concatenate([[0], np.cumsum(inputs.prompt_row_counts)])
    suppressed = set(inputs.eos_suppression_rows.tolist())
    rows, targets = [], []
    for i, request in enumerate(requests):
        s0, sc = int(inputs.sample_offsets[i]), int(inputs.sample_counts[i])
        last_chunk = bool(inputs.is_last_chunk[i])
        sample_rows = ranges(inputs.selected_token_indices[s0 : s0 + sc])
        if request.is_prompt and not last_chunk:
            sample_rows += " (discarded)"
        pos0 = int(inputs.sample_positions[i])
        positions = f"{pos0}" if sc == 1 else f"{pos0}-{pos0 + sc - 1}"
        if inputs.selected_prompt_indices is None or inputs.prompt_row_counts[i] == 0:
            prompt = "-" if inputs.num_prompt_logprobs[i] < 0 else "(none this chunk)"
        else:
            p0, p1 = int(prompt_offsets[i]), int(prompt_offsets[i + 1])
            prompt = ranges(inputs.selected_prompt_indices[p0:p1])
            pairs = " ".join(f"{r}->{t}" for r, t in zip(inputs.selected_prompt_indices[p0:p1],
                                                          inputs.prompt_token_targets[p0:p1]))
            targets.append(textwrap.fill(f"{request.request_id}: {pairs}", WIDTH, initial_indent="  ",
                                         subsequent_indent="    "))
        draft = "-"
        if inputs.mtp_info_read_rows is not None and not request.is_prompt:
            reads = inputs.mtp_info_read_rows[s0 : s0 + sc]
            draft = f"read {reads.tolist()} write {int(inputs.mtp_info_write_slots[i])}"
        elif inputs.mtp_info_write_slots is not None:
            draft = f"write {int(inputs.mtp_info_write_slots[i])}"
        eos = sum(1 for r in range(s0, s0 + sc) if r in suppressed)
        rows.append([i, request.request_id, _kind(request, last_chunk), request.seqlen_q, request.seqlen_k,
                     ranges(np.arange(inputs.out_offsets[i], inputs.out_offsets[i] + inputs.out_lens[i])),
                     sample_rows, positions, f"{eos}/{sc}" if eos else "-", prompt, draft])
    headers = ["#", "request", "kind", "q", "k", "out rows", "sample rows", "positions", "eos-", "prompt rows",
               "draft info"]
    parts = [table(headers, rows, narrow_first=(1, 2, 5, 6, 9), keep=(0, 3, 4, 7, 8))]
    if targets:
        parts.append("Prompt rows, row->target (the prompt token its logits score):\n" + "\n".join(targets))
    return "\n\n".join(parts)


def row_map(requests: Sequence[LedgerRequest], inputs: SamplerInputs) -> str:
    """Each model-output row: its request, its place in the request, its position, its role."""
    n = inputs.num_reqs
    role = np.full(inputs.num_output_rows, "", dtype=object)
    discards = ~inputs.is_last_chunk & inputs.is_prompt
    for r, i in zip(inputs.selected_token_indices.tolist(), inputs.row_to_req.tolist()):
        role[r] += "D" if discards[i] else "S"
    if inputs.selected_prompt_indices is not None:
        for r in inputs.selected_prompt_indices:
            role[r] += "P"
    owner = np.repeat(np.arange(n), inputs.out_lens)
    lines: list[list[object]] = []
    for r in range(inputs.num_output_rows):
        i = int(owner[r])
        j = r - int(inputs.out_offsets[i])
        request = requests[i]
        clipped = int(request.seqlen_q - inputs.out_lens[i])
        position = request.seqlen_k - request.seqlen_q + clipped + j
        this = [r, request.request_id, j, position, position + 1, role[r] or "."]
        last = lines[-1] if lines else None
        if last is not None and this[5] in (".", "P") and last[5] == this[5] and last[1] == this[1]:
            # A run of context rows (or of prompt-logprob rows) of one request: one line, its columns as ranges.
            last[0], last[2], last[3], last[4] = (f"{str(last[0]).split('-')[0]}-{r}",
                                                  f"{str(last[2]).split('-')[0]}-{j}",
                                                  f"{str(last[3]).split('-')[0]}-{position}",
                                                  f"{str(last[4]).split('-')[0]}-{position + 1}")
            continue
        lines.append(this)
    return table(["row", "request", "j", "position", "predicts", "role"], lines)


def render(
    requests: Sequence[LedgerRequest],
    inputs: SamplerInputs,
    *,
    max_draft_tokens: int,
    bucket: int | None,
    step_fields: Sequence[StepField] = STEP_FIELDS,
) -> str:
    """The per-request ledger table, the flat row map, the bucket's padding and the staged step fields."""
    n = inputs.num_reqs
    parts = [f"Ledger: {n} requests, {inputs.num_output_rows} output rows, "
             f"{inputs.num_sample_rows} sample rows, {inputs.num_prompt_rows} prompt rows",
             request_table(requests, inputs), LEGEND, ROW_MAP_TITLE, row_map(requests, inputs)]
    if bucket:
        capacity = bucket * (1 + max_draft_tokens)
        parts.append(textwrap.fill(
            f"Graph bucket {bucket}: {capacity} sample-row slots, {inputs.num_sample_rows} used. "
            f"Slots {ranges(np.arange(inputs.num_sample_rows, capacity))} are padding: their gather "
            f"index is out of range on purpose (they read a zero row) and request slots "
            f"{ranges(np.arange(n, bucket))} carry neutral parameters.", WIDTH))
    parts.append(field_table(inputs, step_fields))
    return "\n\n".join(parts)
