"""Every benchmark's --quick run still works (they are user-facing commands)."""
from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("name", ["ledger", "step", "sample", "logits", "verify"])
def test_quick_benchmark_runs(name, capsys):
    module = importlib.import_module(f"profiling.bench.{name}")
    assert module.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "x" in out  # every benchmark prints a ratio against its in-run reference
