"""Every benchmark's --quick run still works (they are user-facing commands),
and every ratio it prints against its in-run reference parses as a finite,
positive number."""
from __future__ import annotations

import importlib
import math
import re

import pytest

# Per benchmark: the smallest run that still prints every table, and the
# columns of those tables that hold a ratio.
BENCHES = {
    "ledger": (["--quick", "--repeats", "2"], ["speed-up"]),
    "step": (["--quick", "--repeats", "1", "--vocab", "4096", "--hidden", "64"], ["speed-up"]),
    "sample": (["--quick", "--repeats", "1", "--batch", "1"], ["x sort", "x warp"]),
    "logits": (["--quick", "--repeats", "1"], ["invariant/plain"]),
    "verify": (["--quick", "--repeats", "1"], ["verify/plain", "strict/plain", "rejection/plain"]),
    "forward": (["--quick", "--repeats", "1", "--batches", "1", "2", "--prompt-len", "16"], ["vs fast"]),
    "controls": (["--quick", "--repeats", "1", "--batch", "2", "--vocab", "1024"], ["controls/plain"]),
    "llm": (["--quick"], ["vs invariant"]),
}
RATIO = re.compile(r"^(\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)x$")


def parse_tables(text: str) -> list[list[dict[str, str]]]:
    """The tables `print_table` wrote: a header line, a line of dashes, rows up
    to the first line that does not split into as many cells. Cells are
    separated by two or more spaces."""
    lines = text.splitlines()
    tables = []
    for i in range(1, len(lines)):
        if not re.fullmatch(r"-+(\s{2,}-+)*", lines[i].strip()):
            continue
        headers = re.split(r"\s{2,}", lines[i - 1].strip())
        rows = []
        for line in lines[i + 1 :]:
            cells = re.split(r"\s{2,}", line.strip())
            if len(cells) != len(headers):
                break
            rows.append(dict(zip(headers, cells)))
        tables.append(rows)
    return tables


def parse_ratio(cell: str) -> float:
    match = RATIO.match(cell)
    assert match, f"ratio {cell!r} does not parse as '<number>x'"
    return float(match.group(1).replace(",", ""))


def test_parse_tables_and_ratios():
    text = "title\n   a  b c  speed-up\n---  ---  --------\n  1  x y     0.0067x\n  2  z w  1,234.50x\n\nafter\n"
    assert parse_tables(text) == [[{"a": "1", "b c": "x y", "speed-up": "0.0067x"},
                                   {"a": "2", "b c": "z w", "speed-up": "1,234.50x"}]]
    assert parse_ratio("1,234.50x") == 1234.5 and parse_ratio("6.7e-05x") == 6.7e-05
    for bad in ("0.0", "x", "1.2", "nan x", "-1.00x"):
        with pytest.raises(AssertionError):
            parse_ratio(bad)


@pytest.mark.parametrize("name", BENCHES)
def test_quick_benchmark_prints_positive_ratios(name, capsys):
    argv, ratio_columns = BENCHES[name]
    module = importlib.import_module(f"profiling.bench.{name}")
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    tables = parse_tables(out)
    seen = {column: 0 for column in ratio_columns}
    for rows in tables:
        for row in rows:
            for column in ratio_columns:
                if column in row:
                    value = parse_ratio(row[column])
                    assert math.isfinite(value) and value > 0, (name, column, row[column])
                    seen[column] += 1
    assert all(seen.values()), f"{name}: no rows for ratio columns {[c for c, k in seen.items() if not k]}\n{out}"
