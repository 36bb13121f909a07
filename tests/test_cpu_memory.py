"""engine.cpu_memory: freed blocks of a step come back without page faults.

Each case runs in a fresh interpreter: the setting is process-wide, and the faults are
counted from the process's own minor-fault counter (getrusage).
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A 40 MiB temporary (a [80, 131072] float32 row block), made and freed 3 times to settle,
# then the minor faults of 20 more. Above 32 MiB, glibc's largest automatic mmap threshold, the
# default allocator maps and unmaps such a block every time, wherever the heap stands.
_FAULTS = """
import resource, sys, torch
from engine.cpu_memory import keep_freed_memory
if sys.argv[1] == "keep":
    print(keep_freed_memory())
def step():
    torch.ones(10 << 20)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(mode: str, **env: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")[:-1]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_kept_blocks_fault_in_once():
    """glibc's default faults every page of each new block in (10240 a block); with freed
    blocks kept, later blocks reuse the pages (the heap may still grow once or twice where
    a small allocation took the freed place)."""
    plain = int(_run("plain")[-1])
    said, kept = _run("keep")
    assert "keeps freed blocks" in said
    if plain < 20 * 10240 / 2:  # e.g. transparent huge pages for every mapping: few faults either way
        pytest.skip(f"glibc's default made {plain} faults here, not a page each")
    assert int(kept) < plain / 4, (plain, kept)


def test_the_users_own_setting_is_left_alone():
    said, _ = _run("keep", MALLOC_MMAP_THRESHOLD_="131072")
    assert said == "glibc malloc as MALLOC_MMAP_THRESHOLD_ sets it"
