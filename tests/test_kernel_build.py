"""The ahead-of-time build for sm_90 (profiling/kernel_build.py): every kernel compiles
with no spills and shared memory within an H200 block's, on this machine without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from profiling.kernel_build import SM90_MAX_SHARED, BuildReport, parse_ptxas

ROOT = Path(__file__).resolve().parents[1]

PTXAS_OUTPUT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
"""


def test_parse_ptxas_reads_registers_and_spills():
    assert parse_ptxas(PTXAS_OUTPUT) == (168, 8, 4, 16)
    with pytest.raises(ValueError, match="no register"):
        parse_ptxas("ptxas info    : 0 bytes gmem\n")


def test_report_fails_on_spills_or_too_much_shared_memory():
    assert BuildReport("k", 40, 0, 0, 0, SM90_MAX_SHARED).ok
    assert not BuildReport("k", 40, 8, 0, 0, 0).ok
    assert not BuildReport("k", 40, 0, 0, 0, SM90_MAX_SHARED + 1).ok


def test_every_kernel_builds_for_sm90_without_spills():
    pytest.importorskip("triton")
    # The interpreter's jit functions cannot be compiled: a fresh process without it.
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "profiling.kernel_build", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(done.stdout)
    bad = [k for k in report["kernels"] if not k["ok"]]
    assert not bad, f"kernels with spills or too much shared memory: {bad}"
