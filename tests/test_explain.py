"""`python -m engine explain`: parsing, JSON batches, and the tables it prints."""
from __future__ import annotations

import json
import re

import pytest

from engine import prepare_sampler_inputs
from engine.__main__ import main
from engine.cli.explain import EXAMPLE_BATCH, parse_request


def test_parse_request_defaults_follow_spec():
    pre = parse_request("prefill:a:len=12,q=8")
    assert (pre.is_prompt, pre.seqlen_q, pre.seqlen_k, pre.prompt_len) == (True, 8, 8, 12)
    dec = parse_request("decode:b:len=5,gen=3,drafts=2,read=1,write=2,top_k=50")
    # seqlen_k == prompt_len + num_generated + drafts (docs/contract.md §6)
    assert (dec.seqlen_q, dec.seqlen_k, dec.mtp_read_slot, dec.mtp_write_slot) == (3, 10, 1, 2)
    assert dec.params.top_k == 50


@pytest.mark.parametrize(
    "spec, match",
    [
        ("prefil:a:len=3", "KIND"),
        ("prefill:a:q=3", "len="),
        ("prefill:a:len=3,bogus=1", "request 'a': unknown item 'bogus=1'"),
        ("prefill:a:len=3,top_p=1.5", "top_p=1.5"),
        ("prefill:a:len=3,q=4", "request 'a'"),
    ],
)
def test_parse_request_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_request(spec)


def test_example_batch_table(capsys):
    assert main(["explain", "--example", "--bucket", "8"]) == 0
    out = capsys.readouterr().out
    seqs = [parse_request(s) for s in EXAMPLE_BATCH]
    inputs = prepare_sampler_inputs(seqs, max_draft_tokens=3)
    assert f"{inputs.num_output_rows} output rows, {inputs.num_sample_rows} sample rows" in out
    # chat-3 verifies 3 drafts from slot 2: rows 6, 7, 8, then the padding row 0.
    assert "read [6, 7, 8, 0] write 2" in out
    # the last prompt row of a non-last chunk is also its sample row, whose token is discarded
    assert "7     chat-1   7    7         8         DP" in out
    assert "0-6   chat-1   0-6  0-6       1-7       P" in out  # a run of prompt-logprob rows is one line
    assert "0  chat-1   prefill  8  8   0-7     7            8" in out
    assert "            (chunk)                 (discarded)" in out
    assert max(map(len, out.splitlines())) <= 100
    assert "Slots 9-31 are padding" in out


def test_json_batch_and_cli_error(tmp_path, capsys):
    batch = {
        "max_draft_tokens": 2,
        "requests": [
            {"request_id": "x", "is_prompt": True, "seqlen_q": 4, "seqlen_k": 4, "prompt_len": 4,
             "prompt_tokens": [5, 6, 7, 8], "params": {"prompt_logprobs": True}},
            {"request_id": "y", "is_prompt": False, "seqlen_q": 3, "seqlen_k": 9, "prompt_len": 4,
             "num_generated": 3, "mtp_read_slot": 1, "mtp_write_slot": 1},
        ],
    }
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(batch))
    assert main(["explain", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "0->6 1->7 2->8" in out
    assert "read [2, 3, 0] write 1" in out
    assert main(["explain", "decode:z:len=4,gen=1,drafts=3,write=1"]) == 0  # max drafts inferred
    assert main(["explain", "prefill:z:len=4,q=9"]) == 2
    assert "request 'z'" in capsys.readouterr().err


def test_stop_token_ids_take_one_id_or_several(capsys):
    assert parse_request("prefill:a:len=3,stop_token_ids=5").params.stop_token_ids == (5,)
    assert parse_request("decode:a:len=3,gen=1,stop_token_ids=5/6").params.stop_token_ids == (5, 6)
    assert main(["explain", "decode:a:len=3,gen=1,min_tokens=3,stop_token_ids=5"]) == 0
    assert "1/1" in capsys.readouterr().out  # its one sample row has EOS and id 5 masked


def test_errors_speak_the_command_line_keys(capsys):
    assert main(["explain", "decode:c:len=5,gen=3,drafts=2"]) == 2
    err = capsys.readouterr().err
    assert "request 'c': write=0" in err and "mtp_write_slot" not in err
    assert main(["explain", "prefill:a:len=5,q=6"]) == 2
    err = capsys.readouterr().err
    assert "k=6" in err and "seqlen_k" not in err
    assert main(["explain", "prefill:a:len=3,stop_token_ids=x"]) == 2
    assert "request 'a': stop_token_ids=" in capsys.readouterr().err


def test_every_column_is_explained(capsys):
    from engine.cli.explain import LEGEND

    assert main(["explain", "--example"]) == 0
    out = capsys.readouterr().out
    assert LEGEND in out
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("#  request"))
    rule = next(i for i in range(top, len(lines)) if lines[i].startswith("-  ---"))
    header = " ".join(lines[top:rule]).split()  # a header may wrap onto a second line
    legend_terms = {line.split()[0].rstrip(",") for line in LEGEND.splitlines() if line[2:3] != " "}
    for column in ("kind", "out rows", "sample rows", "positions", "eos-", "prompt rows", "draft info"):
        assert set(column.split()) <= set(header) and column.split()[0] in legend_terms, column


def test_the_readme_batch_file_exists_and_explains(capsys):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert "explain --json docs/examples/batch.json" in (root / "README.md").read_text()
    assert main(["explain", "--json", str(root / "docs" / "examples" / "batch.json"), "--bucket", "8"]) == 0
    out = capsys.readouterr().out
    assert "4 requests, 11 output rows, 6 sample rows, 6 prompt rows" in out
    assert "read [2, 3, 0] write 1" in out


def test_bad_json_batches_are_one_line_errors(tmp_path, capsys):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"requests": [{"request_id": "x", "is_prompt": True, "seqlen_q": 2}]}))
    assert main(["explain", "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "request 'x'" in err
    assert main(["explain", "--json", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


# ---- every bad input one line, exit 2, before any work (issue 27) ------------------------------

def _one_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("doc, match", [
    ([{"request_id": "x"}], "the top level is a list; it must be an object"),
    ({"requests": None}, "requests=None: must be a list of request objects"),
    ({"requests": [5]}, r"requests\[0\]=5: must be an object"),
    ({"requests": [], "max_draft_tokens": None}, "max_draft_tokens=None: must be an int >= 0"),
    ({"requests": [], "max_draft_tokens": "2"}, "max_draft_tokens='2': must be an int >= 0"),
    ({"requests": [], "compaction_keep_tokens": "x"}, "compaction_keep_tokens='x'"),
    ({"requests": [{"request_id": "a", "is_prompt": True, "seqlen_q": 1, "seqlen_k": 1, "prompt_len": 1,
                    "params": None}]}, "request 'a': params=None: must be an object"),
    ({"requests": [{"request_id": "a", "is_prompt": True, "seqlen_q": "4", "seqlen_k": 4, "prompt_len": 4}]},
     "request 'a'"),
    ({"requests": [{"request_id": "a", "is_prompt": True, "seqlen_q": 4, "seqlen_k": 4, "prompt_len": 10**11}]},
     "prompt_len=100000000000: explain shows at most 65536 tokens"),
    ({"requests": [], "extra": 1}, "unknown key 'extra'"),
])
def test_bad_json_batches_of_every_shape_are_one_line(tmp_path, capsys, doc, match):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(doc))
    assert re.search(match, _one_line(capsys, ["explain", "--json", str(path)]))


def test_deeply_nested_and_broken_json_are_one_line(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert "deep.json: nested deeper" in _one_line(capsys, ["explain", "--json", str(path)])
    path.write_text('{"requests": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}')
    assert "nested more than 32 levels" in _one_line(capsys, ["explain", "--json", str(path)])
    path.write_text("{not json")
    assert "not JSON" in _one_line(capsys, ["explain", "--json", str(path)])


@pytest.mark.parametrize("spec, match", [
    ("prefill:a:len=1e11", "len=1e+11: explain shows at most 65536 tokens per request"),
    ("prefill:a:len=100000000000", "len=1e+11: explain shows at most 65536"),
    ("prefill:a:len=2000000000,q=8", "len=2e+09: explain shows at most"),
    ("decode:a:len=5,gen=1,drafts=100000,write=1", "drafts=100000: explain shows at most"),
])
def test_huge_sizes_are_refused_before_anything_is_allocated(capsys, spec, match):
    assert match in _one_line(capsys, ["explain", spec])


def test_an_unknown_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["explain", "--bogus"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "unrecognized arguments: --bogus" in err


def test_a_closed_pipe_ends_explain_quietly():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(f"{sys.executable} -m engine explain --example --bucket 8 | head -1", shell=True,
                          capture_output=True, text=True, cwd=root, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert proc.stdout.startswith("Example batch:") and proc.stderr == ""


def test_tables_fit_in_100_columns_for_long_chunks_and_ids(capsys):
    specs = ["prefill:a-request-with-a-rather-long-id:len=300,q=200,plp=5",
             "decode:b:len=40,gen=7,drafts=3,read=1,write=1,min_tokens=9", "prefill:c:len=90,plp=0"]
    assert main(["explain", *specs, "--bucket", "8"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100
    assert "0-198" in out  # a run of context-only rows is one row-map line


def _ledger_table(out: str) -> list[dict[str, str]]:
    """The tool's per-request table: columns from the rule line, a wrapped cell joined back."""
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("#  request"))
    rule = next(i for i in range(top, len(lines)) if lines[i].startswith("-  ---"))
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", lines[rule])]

    def cells(line: str) -> list[str]:
        return [line[a : b + 2 if k + 1 < len(spans) else None].strip() for k, (a, b) in enumerate(spans)]

    headers = [" ".join(parts).strip() for parts in zip(*(cells(line) for line in lines[top:rule]))]
    rows: list[list[str]] = []
    for line in lines[rule + 1 :]:
        if not line.strip():
            break
        values = cells(line)
        if values[0]:
            rows.append(values)
        else:  # a continuation line of a wrapped row
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], values)]
    return [dict(zip(headers, row)) for row in rows]


def test_the_contracts_worked_examples_are_what_the_tool_prints(capsys):
    import shlex
    from pathlib import Path

    contract = (Path(__file__).resolve().parents[1] / "docs" / "contract.md").read_text()
    examples = re.findall(r"^    python -m engine explain ([^\n]+)\n(.*?)(?=^#)", contract, re.M | re.S)
    assert len(examples) >= 3
    for args, section in examples:
        assert main(["explain", *shlex.split(args)]) == 0, args
        out = capsys.readouterr().out
        tool = _ledger_table(out)
        table = [line for line in section.splitlines() if line.startswith("|")]
        headers = [h.strip() for h in table[0].strip("|").split("|")]
        documented = [dict(zip(headers, (c.strip() for c in line.strip("|").split("|")))) for line in table[2:]]
        assert len(documented) == len(tool), args
        for doc_row, tool_row in zip(documented, tool):
            for column, value in doc_row.items():
                assert tool_row[column] == value, (args, column, value, tool_row[column])
        for pair in re.findall(r"\b\d+->\d+\b", section):  # row->target pairs quoted in the prose
            assert pair in out, (args, pair)


def test_a_live_batch_step_explains_itself():
    import torch

    from engine import EngineConfig, PersistentBatch, SamplingParams, StepEngine

    engine = StepEngine(torch.zeros(64, 8), EngineConfig(max_num_reqs=4, device="cpu", use_graphs=False))
    batch = PersistentBatch(engine)
    batch.add("long", prompt_tokens=list(range(10)), params=SamplingParams(prompt_logprobs=1))
    batch.add("short", prompt_tokens=[1, 2, 3], params=SamplingParams(temperature=0))
    step = batch.prepare(["long", "short"], seqlen_q=[6, 3], seqlen_k=[6, 3])  # a first chunk of 6 of 10
    text = step.explain(bucket=4)
    assert "Ledger: 2 requests, 9 output rows, 2 sample rows, 6 prompt rows" in text
    table = _ledger_table(text)
    assert (table[0]["kind"], table[0]["sample rows"]) == ("prefill (chunk)", "5 (discarded)")
    assert (table[1]["kind"], table[1]["sample rows"]) == ("prefill", "8")
    assert "long: 0->1 1->2 2->3 3->4 4->5 5->6" in text and "Graph bucket 4" in text
    assert max(map(len, text.splitlines())) <= 100
