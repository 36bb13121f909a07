"""Ahead-of-time builds of the Triton kernels for an H200 (sm_90), on a machine without a GPU.

    python -m profiling.kernel_build            # a table: kernel, registers, spills, shared memory
    python -m profiling.kernel_build --json

Each kernel module of `engine/sampling/kernels/` lists the configurations it
launches with as `AOT_BUILDS` (`KernelBuild`s: the jit function, its
signature and constexprs). `triton.compile` turns each into PTX and a cubin
for `GPUTarget("cuda", 90, 32)` with no driver, and `ptxas -v` on the PTX
reports registers and spills (the `ptxas-blackwell` inside the triton wheel:
the plain `ptxas` there and older CUDA ones reject newer PTX versions).

Must run with `TRITON_INTERPRET` unset or 0: the interpreter's jit functions
cannot be compiled. The tests call it in a subprocess for that reason.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# Shared memory one H100/H200 block may use (227 KiB: the opt-in maximum of sm_90).
SM90_MAX_SHARED = 227 * 1024


@dataclass(frozen=True)
class KernelBuild:
    """One configuration of one kernel to build ahead of time."""

    name: str  # how the table names it: "<kernel> <config>"
    fn: object  # the @triton.jit function
    signature: dict[str, str]  # argument -> Triton type ("*fp32", "i32", "constexpr", ...)
    constexprs: dict[str, object] = field(default_factory=dict)
    num_warps: int = 4  # as launched: registers per thread depend on it


@dataclass(frozen=True)
class BuildReport:
    name: str
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_bytes: int
    shared_bytes: int

    @property
    def ok(self) -> bool:
        return self.spill_stores == 0 and self.spill_loads == 0 and self.shared_bytes <= SM90_MAX_SHARED


def ptxas_path() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"


_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> tuple[int, int, int, int]:
    """(registers, spill store bytes, spill load bytes, stack bytes) from `ptxas -v` output
    for one entry function. Raises ValueError when the output has none of them."""
    props, regs = _PROPS.search(text), _REGS.search(text)
    if props is None or regs is None:
        raise ValueError(f"ptxas -v printed no register or spill report:\n{text}")
    stack, stores, loads = (int(g) for g in props.groups())
    return int(regs.group(1)), stores, loads, stack


def build(spec: KernelBuild) -> BuildReport:
    """Compile `spec` for sm_90 and read its resources from `ptxas -v`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.sampling.kernels import FP_FUSION

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: interpreted kernels cannot be compiled; unset it")
    compiled = triton.compile(
        ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"enable_fp_fusion": FP_FUSION, "num_warps": spec.num_warps},
    )
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        done = subprocess.run([str(ptxas_path()), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    registers, stores, loads, stack = parse_ptxas(done.stderr + done.stdout)
    return BuildReport(spec.name, registers, stores, loads, stack, int(compiled.metadata.shared))


def kernel_builds() -> list[KernelBuild]:
    """Every `AOT_BUILDS` entry of the modules of `engine.sampling.kernels`: a `KernelBuild`,
    or a dict of its fields (the library does not import profiling/)."""
    import engine.sampling.kernels as package

    builds: list[KernelBuild] = []
    for module in pkgutil.iter_modules(package.__path__):
        for entry in getattr(importlib.import_module(f"{package.__name__}.{module.name}"), "AOT_BUILDS", ()):
            builds.append(KernelBuild(**entry) if isinstance(entry, dict) else entry)
    return builds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.kernel_build", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("-k", dest="only", default=None, help="build only kernels whose name contains this")
    args = parser.parse_args(argv)
    builds = [b for b in kernel_builds() if args.only is None or args.only in b.name]
    reports = [build(b) for b in builds]
    if args.json:
        print(json.dumps({"target": "sm_90", "max_shared_bytes": SM90_MAX_SHARED,
                          "kernels": [dict(vars(r), ok=r.ok) for r in reports]}))
    else:
        width = max([len(r.name) for r in reports] + [6])
        print(f"{'kernel':<{width}}  regs  spill st/ld (B)  stack (B)  shared (B)  ok")
        for r in reports:
            print(f"{r.name:<{width}}  {r.registers:>4}  {r.spill_stores:>6} / {r.spill_loads:<6}  {r.stack_bytes:>9}"
                  f"  {r.shared_bytes:>10}  {'yes' if r.ok else 'NO'}")
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
