"""Fixtures shared by the test files, and the guards that keep every test's result independent
of what ran before it: compiler caches, test order, the thread count, the environment."""
from __future__ import annotations

import os
import random
import zlib

import numpy as np
import pytest
import torch
from hypothesis import settings

# Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors
# (engine/sampling/kernels); it must be chosen before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No example database: a run replays no failures saved by an earlier run on this machine, so a
# developer's run and CI's clean clone draw from the same distribution.
settings.register_profile("engine", database=None)
settings.load_profile("engine")

IN_PROCESS_BUILD = ("triton.compile in the test process: interpreted kernels that ran earlier leave Triton's "
                    "patched builtins behind, and a build that misses the cache then fails; build in a "
                    "subprocess with TRITON_INTERPRET=0 (tests/test_kernel_build.py shows how)")


def _refuse_in_process_build(*args, **kwargs):
    raise RuntimeError(IN_PROCESS_BUILD)


def pytest_configure(config: pytest.Config) -> None:
    """Under the interpreter, an ahead-of-time build in this process passes or fails by what the
    Triton cache holds (a warm cache never runs the code generator). Refuse it every time, so a
    leak fails on every machine, not only on a new one."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        import triton
        import triton.compiler
        import triton.compiler.compiler
    except ImportError:
        return
    for module in (triton, triton.compiler, triton.compiler.compiler):
        module.compile = _refuse_in_process_build


@pytest.fixture(autouse=True, scope="session")
def _fast_interpreter():
    """Under the interpreter, its two slow habits changed for the session: the same bits,
    minutes less (tests/kernel_interpreter.py says which)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        yield
        return
    try:
        from tests.kernel_interpreter import fast_interpreter
        import triton.runtime.interpreter  # noqa: F401
    except ImportError:
        yield
        return
    with fast_interpreter():
        yield


@pytest.fixture(autouse=True)
def _leave_the_process_as_found(request: pytest.FixtureRequest):
    """Each test starts from the thread count and the environment the session started with,
    whatever an earlier test set (the demo's --threads, a library's setdefault), and from
    global random states seeded by its own name: a test that draws from torch's, numpy's or
    Python's global generator gets the same values whichever tests ran before it."""
    threads, environ = torch.get_num_threads(), dict(os.environ)
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> int:
    """Runs the test at 1 and at 2 torch threads: invariance claims must hold at both."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)
