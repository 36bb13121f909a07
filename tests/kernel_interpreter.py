"""Triton's interpreter, set up for checking kernels against the torch path on the CPU.

Three things the interpreter does its own way:

- Math, changed for the duration of `torch_math()`. It evaluates `tl.exp` and `tl.log` with
  numpy, whose float32 `exp` differs from torch's in the last bit for about a third of
  inputs (AVX2, numpy 2.4). The kernels call libdevice's on a GPU, which torch's CUDA
  kernels call too; here they get torch's CPU functions, so a test compares definitions,
  not two exp implementations. How often one ulp of `exp` moves a decision is measured on
  its own (`profiling/exp_ulp.py`).
- Speed, changed for the duration of `fast_interpreter()` (tests/conftest.py holds it for the
  whole session): the same bits, minutes less.
  - It patches `triton.language` again on every call of a device function (`tl.sum`,
    `tl.max`, `tl.cumsum`, a kernel's helpers: about 10 ms each), although nothing undoes
    those patches until the launch ends. Here each module is patched once per launch.
  - It reduces with `tl.xor_sum` one element at a time in Python, and `tl.sort` (the kept
    list's) calls it once per compare-and-swap stage: about 70 ms each, most of an engine
    step's time. Here numpy's `bitwise_xor.reduce` does it: xor is exact in any order.

All are internals of triton's interpreter (3.9): where they are missing the contexts
change nothing and the tests run slower, or compare numpy's `exp`.
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
def torch_math() -> Iterator[None]:
    """The interpreter with torch's exp and log."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None:
        yield
        return
    saved = builder.create_exp, builder.create_log
    builder.create_exp = lambda self, arg: self.unary_op(arg, _torch_unary(torch.exp))
    builder.create_log = lambda self, arg: self.unary_op(arg, _torch_unary(torch.log))
    try:
        yield
    finally:
        builder.create_exp, builder.create_log = saved


@contextmanager
def fast_interpreter() -> Iterator[None]:
    """The interpreter patching the language once per launch, and `tl.xor_sum` by numpy."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    reduce_ops = getattr(interpreter, "ReduceOps", None)
    xor_combine = getattr(tl.standard, "_xor_combine", None)
    if patch_lang is None or executor is None or reduce_ops is None or xor_combine is None:
        yield
        return
    saved_launch, saved_reduce = executor.__call__, reduce_ops.apply_impl
    patched: set[int] = set()  # the globals (one per module) patched in this launch

    def patch_once(fn):  # noqa: ANN001, ANN202 - the interpreter's own signature
        key = id(fn.__globals__)
        if key in patched:
            return interpreter._LangPatchScope()
        patched.add(key)
        return patch_lang(fn)

    def launch(self, *args, **kwargs):  # noqa: ANN001, ANN202
        patched.clear()  # the launch undoes its own patches when it ends
        return saved_launch(self, *args, **kwargs)

    def reduce(self, input):  # noqa: ANN001, ANN202
        if self.combine_fn is not xor_combine or len(input) != 1:
            return saved_reduce(self, input)
        (operand,) = input
        xored = np.bitwise_xor.reduce(operand.handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(xored, operand.dtype)

    interpreter._patch_lang, executor.__call__, reduce_ops.apply_impl = patch_once, launch, reduce
    try:
        yield
    finally:
        interpreter._patch_lang, executor.__call__, reduce_ops.apply_impl = patch_lang, saved_launch, saved_reduce
