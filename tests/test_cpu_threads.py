"""The default thread count (engine.cpu_threads): the cores other processes leave idle."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from engine import cpu_threads
from engine.cpu_threads import ThreadChoice, check_threads, choose_threads, use_threads


@pytest.fixture(autouse=True)
def _keep_thread_count():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_count_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"threads="):
        check_threads(bad)
    with pytest.raises(ValueError, match=r"^threads="):
        choose_threads(bad)


def test_llm_refuses_a_bad_count_before_loading():
    from engine import LLM

    with pytest.raises(ValueError, match=r"^threads=0"):
        LLM("tiny", threads=0)


def test_a_given_count_is_used():
    assert use_threads(1) == ThreadChoice(1, "as asked")
    assert torch.get_num_threads() == 1


def test_omp_num_threads_is_the_users_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads() == ThreadChoice(3, "OMP_NUM_THREADS")


@pytest.mark.parametrize("cores, busy, expected", [(2, 0, 2), (2, 1, 1), (2, 9, 1), (16, 3, 13), (1, 0, 1)])
def test_the_default_leaves_the_busy_cores(monkeypatch, cores, busy, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
    monkeypatch.setattr(cpu_threads, "busy_elsewhere", lambda: (float(busy), "planted"))
    choice = choose_threads()
    assert choice.count == expected
    assert f"{busy:g} busy" in choice.reason and f"{cores} core" in choice.reason


def test_a_busy_process_is_seen():
    """A busy loop beside this process is runnable at every sample: it counts as one busy core
    at least (more where other work runs too)."""
    if sys.platform != "linux":
        pytest.skip("/proc/loadavg is Linux's")
    busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        time.sleep(0.2)
        seen, source = cpu_threads.busy_elsewhere()
    finally:
        busy.kill()
        busy.wait()
    assert source == "runnable tasks of other processes"
    assert seen >= 1



def test_llm_takes_the_default_and_says_why(monkeypatch):
    from engine import LLM
    from engine.step.engine_config import EngineConfig

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "busy_elsewhere", lambda: (0.0, "planted"))
    llm = LLM("tiny", max_num_reqs=1, device="cpu", engine_config=EngineConfig(device="cpu", use_graphs=False))
    assert llm.threads == ThreadChoice(cpu_threads.usable_cores(), llm.threads.reason)
    assert torch.get_num_threads() == llm.threads.count and "0 busy" in llm.threads.reason
    assert LLM("tiny", max_num_reqs=1, threads=1, engine_config=EngineConfig(device="cpu", use_graphs=False)).threads \
        == ThreadChoice(1, "as asked")
