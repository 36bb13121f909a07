"""The fused LM head (`engine.step.lm_head_kernel`) checked for the H200 without one.

    python -m profiling.lm_head_build            # build for sm_90 + the cost of one step's op
    python -m profiling.lm_head_build --json
    python -m profiling.lm_head_build --gpu      # on a GPU: also time it beside today's path

- **Build** (`build_sm90`): the kernel compiled ahead of time for sm_90 with its one tile
  config (`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`), bf16 hidden
  rows and weight, int32 or int64 row index, fp32 logits; the PTX assembled by the triton
  wheel's `ptxas-blackwell -v` for sm_90a, which reports registers, spills and stack. The
  shared memory is the compiler's (`metadata.shared`). Integer arguments that the engine
  keeps at multiples of 16 (H, V, the row strides) and the pointers are declared 16-divisible,
  as Triton's JIT specializes them at run time; the row counts are never specialized.
- **Cost** (`op_cost`): one call of the op on the fake CUDA device under the cost model's
  `KernelCounter`: one kernel, the weight read once, the sample rows of `hidden` read, the
  logits written, modelled at the cost model's node time and bandwidth, beside the floor of
  reading the weight once and today's path (`block_path_cost`: a gather, then 64-row `mm`
  blocks, each reading the weight).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import warnings
from dataclasses import asdict, dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.ops import gather, get_logits
from engine.step import lm_head_kernel
from profiling.cost_model import BANDWIDTH_TBS, NODE_US, Kernel, KernelCounter
from profiling.fake_cuda import FakeCuda

# The H200's shared memory per block (227 KiB) and the default shapes (DeepSeek-V3's LM head).
SHARED_LIMIT = 227 * 1024
HIDDEN, VOCAB = 7168, 129280
# Arguments the engine keeps 16-divisible (Triton's JIT specializes them so at run time).
_DIVISIBLE = ("hidden_ptr", "row_index_ptr", "weight_ptr", "out_ptr", "vocab", "hidden_size",
              "stride_hidden", "stride_weight", "stride_out")


@dataclass(frozen=True)
class KernelBuild:
    """What ptxas and Triton report for one sm_90 build of the kernel."""

    signature: str  # e.g. "bf16 hidden, bf16 weight, i32 index"
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # bytes of stack frame
    shared: int  # bytes of shared memory per program
    tensor_core: bool  # the PTX issues wgmma (Hopper's warpgroup MMA)
    target: str  # the PTX's .target line, e.g. "sm_90a"

    @property
    def fits(self) -> bool:
        """No spills and shared memory within the H200's 227 KiB per block."""
        return self.spill_stores == 0 and self.spill_loads == 0 and self.shared <= SHARED_LIMIT


def ptxas_path() -> str:
    """The triton wheel's ptxas that reads its PTX (the plain one beside it is older)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")


def build_sm90(dtype: str = "bf16", index: str = "i32") -> tuple[KernelBuild, str]:
    """Compile the kernel for sm_90 with `dtype` hidden rows and weight ("bf16", "fp16",
    "fp32") and an `index` ("i32", "i64") row index; returns its report and the PTX."""
    signature = {"hidden_ptr": f"*{dtype}", "row_index_ptr": f"*{index}", "weight_ptr": f"*{dtype}",
                 "out_ptr": "*fp32", "row_max_ptr": "*i64", "rows": "i32", "hidden_rows": "i32", "vocab": "i32", "hidden_size": "i32",
                 "stride_hidden": "i32", "stride_weight": "i32", "stride_out": "i32",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                 "INPUT_PRECISION": "constexpr", "HAS_ROW_MAX": "constexpr"}
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in _DIVISIBLE}
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    constexprs = {"BLOCK_M": lm_head_kernel.BLOCK_M, "BLOCK_N": lm_head_kernel.BLOCK_N,
                  "BLOCK_K": lm_head_kernel.BLOCK_K, "INPUT_PRECISION": lm_head_kernel.input_precision(torch_dtype),
                  "HAS_ROW_MAX": True}  # the kernel head's launch: each row's maximum for the controls kernel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # triton 3.9's notice about its FP-fusion default
        compiled = triton.compile(
            ASTSource(fn=lm_head_kernel.LM_HEAD_KERNEL, signature=signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": lm_head_kernel.NUM_WARPS, "num_stages": lm_head_kernel.NUM_STAGES})
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "lm_head.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([ptxas_path(), "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, report)
        if found is None:
            raise RuntimeError(f"ptxas -v printed no match for {pattern!r}:\n{report}")
        return int(found.group(1))

    return KernelBuild(
        signature=f"{dtype} hidden, {dtype} weight, {index} index",
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        stack=number(r"(\d+) bytes stack frame"),
        shared=compiled.metadata.shared,
        tensor_core="wgmma.mma_async" in ptx,
        target=re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE).group(1),
    ), ptx


def op_cost(rows: int, hidden_size: int = HIDDEN, vocab: int = VOCAB, dtype: torch.dtype = torch.bfloat16,
            hidden_rows: int | None = None) -> tuple[Kernel, int]:
    """One call of `engine::lm_head_logits` for `rows` sample rows (gathered from `hidden_rows`
    hidden rows, default `rows`) on the fake CUDA device, as the cost model counts it:
    (its one Kernel, the bytes of one read of the weight)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeCuda():
            weight = torch.empty(vocab, hidden_size, dtype=dtype, device="cuda")  # [V, H]
            hidden = torch.empty(hidden_rows or rows, hidden_size, dtype=dtype, device="cuda")  # [N, H]
            row_index = torch.empty(rows, dtype=torch.int32, device="cuda")
            out = torch.empty(rows, vocab, dtype=torch.float32, device="cuda")  # [rows, V]
            with KernelCounter(weights=[weight]) as counter:
                lm_head_kernel.lm_head_logits(hidden, row_index, weight, out)
    (kernel,) = counter.kernels
    return kernel, vocab * hidden_size * torch.empty((), dtype=dtype).element_size()


def block_path_cost(rows: int, hidden_size: int = HIDDEN, vocab: int = VOCAB,
                    dtype: torch.dtype = torch.bfloat16) -> list[Kernel]:
    """The same rows through today's CUDA path, for comparison: `engine.ops.gather`, then
    `get_logits` in the batch-invariant mode (64-row `mm` blocks, `default_block_rows`), on
    the fake CUDA device: its kernels."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeCuda():
            weight = torch.empty(vocab, hidden_size, dtype=dtype, device="cuda")
            hidden = torch.empty(rows, hidden_size, dtype=dtype, device="cuda")
            row_index = torch.empty(rows, dtype=torch.int32, device="cuda")
            out = torch.empty(rows, vocab, dtype=torch.float32, device="cuda")
            with KernelCounter(weights=[weight]) as counter:
                get_logits(gather(hidden, row_index), weight, out=out, batch_invariant=True)
    return counter.kernels


def cost_rows(buckets: tuple[int, ...] = (64, 256), node_us: float = NODE_US,
              bandwidth_tbs: float = BANDWIDTH_TBS) -> list[dict]:
    """Per row count: the op's kernels, bytes, weight reads, modelled µs and the weight-read floor."""
    table = []
    for rows in buckets:
        kernel, weight_bytes = op_cost(rows)
        today = block_path_cost(rows)
        today_us = sum(k.modelled_us(node_us, bandwidth_tbs) for k in today)
        table.append({"rows": rows, "op": kernel.op, "kernels": 1, "read": kernel.read, "written": kernel.written,
                      "bytes": kernel.bytes, "weight_reads": kernel.weight_read / weight_bytes,
                      "modelled_us": round(kernel.modelled_us(node_us, bandwidth_tbs), 1),
                      "weight_floor_us": round(weight_bytes / (bandwidth_tbs * 1e6), 1),
                      "block_path": {"kernels": len(today), "bytes": sum(k.bytes for k in today),
                                     "weight_reads": sum(k.weight_read for k in today) / weight_bytes,
                                     "modelled_us": round(today_us, 1)}})
    return table


def time_on_gpu(rows_list: tuple[int, ...] = (1, 8, 64, 256), hidden_size: int = HIDDEN, vocab: int = VOCAB,
                replays: int = 20) -> list[dict]:
    """On the CUDA device, bf16: per row count, the median µs of the fused op, of today's path
    (`engine.ops.gather`, then 64-row `mm` blocks) and of one `torch.mm` over the gathered
    rows, timed by CUDA events around each call, the three sides alternating call by call."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)  # [V, H]
    hidden = torch.randn(512, hidden_size, device="cuda", generator=gen).to(torch.bfloat16)  # [512, H]
    table = []
    for rows in rows_list:
        row_index = torch.randint(0, 512, (rows,), device="cuda", generator=gen, dtype=torch.int32)
        out = torch.empty(rows, vocab, device="cuda")  # [rows, V] fp32
        sides = {
            "fused": lambda: lm_head_kernel.lm_head_logits(hidden, row_index, weight, out),
            "blocks": lambda: get_logits(gather(hidden, row_index), weight, out=out, batch_invariant=True),
            "one_mm": lambda: out.copy_(torch.mm(gather(hidden, row_index), weight.t())),
        }
        times: dict[str, list[float]] = {name: [] for name in sides}
        for call in sides.values():  # compile and warm up
            call()
        torch.cuda.synchronize()
        for _ in range(replays):
            for name, call in sides.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) * 1e3)  # ms -> µs
        medians = {f"{name}_us": round(sorted(t)[len(t) // 2], 1) for name, t in times.items()}
        table.append({"rows": rows, **medians, "fused_vs_blocks": round(medians["fused_us"] / medians["blocks_us"], 3)})
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.lm_head_build", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="sample rows per step")
    parser.add_argument("--gpu", action="store_true",
                        help="also time the op on the CUDA device beside today's path and one mm (bf16)")
    args = parser.parse_args(argv)
    builds = [build_sm90("bf16", index)[0] for index in ("i32", "i64")]
    costs = cost_rows(tuple(args.rows))
    timed = time_on_gpu((1, 8, *args.rows)) if args.gpu else None
    if args.json:
        print(json.dumps({"builds": [asdict(b) | {"fits": b.fits} for b in builds], "cost": costs, "gpu": timed}))
        return 0
    config = (f"BLOCK_M {lm_head_kernel.BLOCK_M}, BLOCK_N {lm_head_kernel.BLOCK_N}, BLOCK_K {lm_head_kernel.BLOCK_K}, "
              f"{lm_head_kernel.NUM_WARPS} warps, {lm_head_kernel.NUM_STAGES} stages")
    print(f"engine::lm_head_logits for sm_90 ({config}):")
    for b in builds:
        print(f"  {b.signature}: {b.registers} registers, spills {b.spill_stores}/{b.spill_loads} B, "
              f"stack {b.stack} B, shared {b.shared / 1024:.0f} KiB, wgmma {'yes' if b.tensor_core else 'no'}"
              f" -> {'fits' if b.fits else 'DOES NOT FIT'}")
    print(f"one step's op at H = {HIDDEN}, V = {VOCAB}, bf16 ({NODE_US} us a node, {BANDWIDTH_TBS} TB/s):")
    for c in costs:
        print(f"  {c['rows']:>4} rows: {c['kernels']} kernel, {c['bytes'] / 1e9:.3f} GB (read {c['read'] / 1e9:.3f}, "
              f"written {c['written'] / 1e6:.1f} MB), weight read {c['weight_reads']:.2f}x, "
              f"modelled {c['modelled_us']:.1f} us, weight-read floor {c['weight_floor_us']:.1f} us")
        today = c["block_path"]
        print(f"        today's gather + 64-row mm blocks: {today['kernels']} kernels, {today['bytes'] / 1e9:.3f} GB, "
              f"weight read {today['weight_reads']:.2f}x, modelled {today['modelled_us']:.1f} us")
    for t in timed or ():
        print(f"  on {torch.cuda.get_device_name()}, {t['rows']:>4} rows: fused {t['fused_us']:.1f} us, "
              f"gather + 64-row blocks {t['blocks_us']:.1f} us, gather + one mm {t['one_mm_us']:.1f} us "
              f"(fused / blocks {t['fused_vs_blocks']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
