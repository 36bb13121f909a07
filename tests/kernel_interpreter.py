"""Triton's interpreter, set up for checking kernels against the torch path on the CPU.

Two things the interpreter does its own way, changed for the duration of `torch_math()`:

- Math. It evaluates `tl.exp` and `tl.log` with numpy, whose float32 `exp` differs from
  torch's in the last bit for about a third of inputs (AVX2, numpy 2.4). The kernels call
  libdevice's on a GPU, which torch's CUDA kernels call too; here they get torch's CPU
  functions, so a test compares definitions, not two exp implementations. How often one
  ulp of `exp` moves a decision is measured on its own (`profiling/exp_ulp.py`).
- Speed. It patches `triton.language` again on every call of a device function
  (`tl.sum`, `tl.max`, `tl.cumsum`, a kernel's helpers: about 10 ms each), although nothing
  undoes those patches until the launch ends. Here each module is patched once per launch.

Both are internals of triton's interpreter (3.9): where they are missing the context
changes nothing and the tests run slower, or compare numpy's `exp`.

One more, for every test (`numpy_xor_sum()`, which tests/conftest.py holds for the session):
the interpreter reduces with `tl.xor_sum` one element at a time in Python, and `tl.sort`
(the kept list's) calls it once per compare-and-swap stage: about 70 ms each, most of an
engine step's time under the interpreter. numpy's `bitwise_xor.reduce` gives the same bits,
since xor is exact whatever the order.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch


def _torch_unary(op: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[np.ndarray], np.ndarray]:
    def apply(array: np.ndarray) -> np.ndarray:
        return op(torch.from_numpy(np.ascontiguousarray(array))).numpy()

    return apply


@contextmanager
def numpy_xor_sum() -> Iterator[None]:
    """The interpreter's reductions with `tl.xor_sum`'s combine function done by numpy."""
    import triton.language as tl
    from triton.runtime import interpreter

    reduce_ops = getattr(interpreter, "ReduceOps", None)
    xor_combine = getattr(tl.standard, "_xor_combine", None)
    if reduce_ops is None or xor_combine is None:
        yield
        return
    saved = reduce_ops.apply_impl

    def apply_impl(self, input):  # noqa: ANN001, ANN202 - the interpreter's own signature
        if self.combine_fn is not xor_combine or len(input) != 1:
            return saved(self, input)
        (operand,) = input
        xored = np.bitwise_xor.reduce(operand.handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(xored, operand.dtype)

    reduce_ops.apply_impl = apply_impl
    try:
        yield
    finally:
        reduce_ops.apply_impl = saved


@contextmanager
def torch_math() -> Iterator[None]:
    """The interpreter with torch's exp and log, patching the language once per launch."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if builder is None or patch_lang is None or executor is None:
        yield
        return
    saved = builder.create_exp, builder.create_log, executor.__call__
    patched: set[int] = set()  # the globals (one per module) patched in this launch

    def patch_once(fn):  # noqa: ANN001, ANN202 - the interpreter's own signature
        key = id(fn.__globals__)
        if key in patched:
            return interpreter._LangPatchScope()
        patched.add(key)
        return patch_lang(fn)

    def launch(self, *args, **kwargs):  # noqa: ANN001, ANN202
        patched.clear()  # the launch undoes its own patches when it ends
        return saved[2](self, *args, **kwargs)

    builder.create_exp = lambda self, arg: self.unary_op(arg, _torch_unary(torch.exp))
    builder.create_log = lambda self, arg: self.unary_op(arg, _torch_unary(torch.log))
    interpreter._patch_lang = patch_once
    executor.__call__ = launch
    try:
        yield
    finally:
        builder.create_exp, builder.create_log, executor.__call__ = saved
        interpreter._patch_lang = patch_lang
