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

from engine.host.ledger import prepare_sampler_inputs
from engine.host.ledger_tables import LEGEND, LedgerRequest, render
from engine.host.params import SamplingParams, SeqMeta
from engine.host.step_fields import STEP_FIELDS, StepField

__all__ = ["LEGEND", "EXAMPLE_BATCH", "explain", "load_json_batch", "parse_request", "in_spec_words"]

# explain prints a line per output row and makes up a prompt token per position: a batch
# past these sizes is a typo, not something to allocate for.
MAX_TOKENS = 1 << 16  # per request: len, q
MAX_ROWS = 1 << 16  # output rows of the whole batch
MAX_DEPTH = 32  # JSON nesting

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
    for key in ("len", "q", "drafts"):
        value = values.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_TOKENS:
            raise ValueError(f"request {request_id!r}: {key}={value:g}: explain shows at most {MAX_TOKENS} tokens "
                             "per request")
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
    file, the request (its id, or #index) or the key, and what is wrong with it."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError(f"{path}: nested deeper than Python's JSON reader goes") from None
    except ValueError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: the top level is a {type(doc).__name__}; it must be an object "
                         '{"requests": [...], "max_draft_tokens": N}')
    if _depth(doc) > MAX_DEPTH:
        raise ValueError(f"{path}: nested more than {MAX_DEPTH} levels deep; a batch is an object of requests")
    unknown = sorted(set(doc) - {"requests", "max_draft_tokens", "compaction_keep_tokens"})
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; keys are requests, max_draft_tokens, "
                         "compaction_keep_tokens")
    requests = doc.get("requests")
    if not isinstance(requests, list):
        raise ValueError(f"{path}: requests={requests!r}: must be a list of request objects")
    max_draft = doc.get("max_draft_tokens", 0)
    if isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 0:
        raise ValueError(f"{path}: max_draft_tokens={max_draft!r}: must be an int >= 0")
    keep = doc.get("compaction_keep_tokens")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"{path}: compaction_keep_tokens={keep!r}: must be null or an int >= 1")
    seqs = []
    for i, req in enumerate(requests):
        if not isinstance(req, dict):
            raise ValueError(f"{path}: requests[{i}]={req!r}: must be an object with SeqMeta's fields")
        req = dict(req)
        req.setdefault("request_id", f"#{i}")
        where = f"{path}: request {req['request_id']!r}"
        params = req.pop("params", {})
        if not isinstance(params, dict):
            raise ValueError(f"{where}: params={params!r}: must be an object of SamplingParams fields")
        for key in ("prompt_len", "seqlen_q"):
            value = req.get(key)
            if isinstance(value, int) and value > MAX_TOKENS:
                raise ValueError(f"{where}: {key}={value}: explain shows at most {MAX_TOKENS} tokens per request")
        try:
            params = SamplingParams(**params)
            if req.get("prompt_tokens") is None and params.num_prompt_logprobs >= 0 \
                    and isinstance(req.get("prompt_len"), int) and req["prompt_len"] > 0:
                req["prompt_tokens"] = 1000 + np.arange(req["prompt_len"])
            seqs.append(SeqMeta(params=params, **req))
        except TypeError as err:  # a missing or unknown key
            raise ValueError(f"{where}: {err}") from None
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    return seqs, max_draft, keep


def _depth(value: object) -> int:
    """How deeply lists and objects nest in a parsed JSON value (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def explain(
    seqs: Sequence[SeqMeta],
    *,
    max_draft_tokens: int = 0,
    compaction_keep_tokens: int | None = None,
    bucket: int | None = None,
    step_fields: Sequence[StepField] = STEP_FIELDS,
) -> str:
    """The ledger of one step as tables (see the module docstring)."""
    rows = sum(seq.seqlen_q for seq in seqs if isinstance(seq, SeqMeta))
    if rows > MAX_ROWS:
        raise ValueError(f"the batch schedules {rows} query tokens: explain shows at most {MAX_ROWS} rows")
    inputs = prepare_sampler_inputs(
        seqs, max_draft_tokens=max_draft_tokens, compaction_keep_tokens=compaction_keep_tokens
    )
    if bucket is not None and bucket < len(seqs):
        raise ValueError(f"bucket={bucket}: smaller than the batch ({len(seqs)} requests)")
    requests = [LedgerRequest(s.request_id, s.is_prompt, s.seqlen_q, s.seqlen_k) for s in seqs]
    return render(requests, inputs, max_draft_tokens=max_draft_tokens, bucket=bucket, step_fields=step_fields)
