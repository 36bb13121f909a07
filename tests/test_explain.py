"""`python -m engine explain`: parsing, JSON batches, and the tables it prints."""
from __future__ import annotations

import json

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
    # the last prompt row of a non-last chunk is also its sample row
    assert "7    chat-1   7  7         8         SP" in out
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
    header = next(line for line in out.splitlines() if line.startswith("#  request"))
    legend_terms = {line.split()[0].rstrip(",") for line in LEGEND.splitlines() if line[2:3] != " "}
    for column in ("out rows", "sample rows", "positions", "eos-", "prompt rows", "draft info"):
        assert column in header and column.split()[0] in legend_terms, column


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
