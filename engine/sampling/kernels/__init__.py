"""Fused Triton kernels of the sampling stages: the CUDA implementation.

Each kernel sits beside the torch-op stage it must agree with (that stage is
the CPU implementation and the reference) and is registered as a torch custom
op (`torch.library.triton_op`, namespace `engine`), so the fake-CUDA dry run,
the capture-safety check and the cost model each see one op per kernel.

Triton is imported only here and in the kernel modules, and only when a
kernel is used: the CPU path never needs it. Without a GPU the kernels run
under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is
imported) on CPU tensors; that is how the tests check them.

Every kernel is compiled without floating-point contraction
(`FP_FUSION = False`): a fused multiply-add rounds once where the torch ops
round twice, and the kernels must give the torch path's bits.
"""
from __future__ import annotations

import importlib.util
import os

# Launch option of every kernel (and of the ahead-of-time build): no a*b+c contracted to an FMA.
FP_FUSION = False


def triton_available() -> bool:
    """Whether triton can be imported (it comes with xgrammar; the CPU path never needs it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (`TRITON_INTERPRET=1`), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
