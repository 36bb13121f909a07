"""A kernel-level cost model of a captured step, computed from the ops it dispatches.

`KernelCounter` is a TorchDispatchMode: run one bucket's step function under it
(on the fake CUDA device of `profiling.fake_cuda`, or on a real GPU) and it
lists the kernels the step launches, with the bytes each one reads and writes,
taken from the tensors' shapes, dtypes and strides. `GraphCost` turns that list
into a modelled replay time, beside the floor of the LM head's compulsory
traffic. `python -m profiling.cuda_dry_run --cost` prints it for every graph of
every scenario; docs/cost-model.md says what the model leaves out.

What counts as a kernel (`launches`):
- every op of a custom namespace (a `torch.library.custom_op` or `triton_op`,
  e.g. `engine.sample.default`) is one kernel. The ops its own implementation
  (or fake implementation) dispatches are not seen: a dispatch mode is off the
  stack while it handles an op, so nothing inside a custom op reaches it;
- an op none of whose tensors is on the device is host work: no kernel;
- an aten or prims op launches a kernel unless it is a view (`func.is_view`),
  an allocation or a metadata change (`NO_KERNEL`: empty, empty_strided,
  empty_like, resize_, set_, in-place views...), or a query that returns no
  tensor and writes none (size, stride, device, is_contiguous...; but
  `_assert_async`, a device-side check, is a kernel). Inside a captured graph
  an allocation is a pool offset: no node; a fill (`zeros`, `full`, `fill_`,
  `zero_`) is one.

The bytes of a kernel (`kernel_bytes`), device tensors only (a 0-dim host tensor
is a kernel argument, not a memory read):
- a tensor's bytes are the distinct elements its view addresses: a dimension of
  stride 0 (an expanded tensor) counts once, a strided slice counts the
  elements it selects, whatever the logical `numel()`;
- every tensor argument is read whole and every returned tensor that aliases
  no argument is written whole; the same view passed twice is read once;
- an argument the op mutates is read and written (an in-place update,
  `add_`), except where the op overwrites it without reading: `copy_`, the
  fills and the random fills (`WRITE_ONLY_SELF`), aten's `out=` arguments,
  and a custom op's mutated argument named `out` or `out_*`;
- the in-place scatters (`index_put_`, `scatter_`, `index_copy_`...) write
  only the elements they index (and read them too where they accumulate),
  `scatter_` reads only as many source elements as it has indices, and their
  returned alias of `self` adds nothing;
- the gathers (`index`, `gather`, `index_select`, `take`, `embedding`) read
  only as many source elements as they produce; `searchsorted` reads
  log2(n) + 1 elements of its sorted rows per query;
- a custom op that gathers rows (`ROW_GATHERS`: `engine.lm_head_logits` and
  `engine.fail_non_finite_hidden` read the sample rows of `hidden`) reads as
  many rows of that argument as its index has elements; one that reads (and
  updates) only part of an argument (`PARTIAL_READS`: the verification kernels)
  moves the elements its rule names;
- the passes rule (`KernelCounter(passes=...)`, `with_passes`): a custom op
  that streams over its first argument n times (the sampling kernel's passes
  over a row, by row kind) reads it n times; n = 0 (every row of the mix skips
  the op on its per-row flag) moves no bytes, only the node. A tuple names the
  passes over its first arguments in order (the sampling kernel's scores, then
  its logits: 0 where the mix's rows never read them).

A GEMM therefore reads both operands whole: the kernels that read the LM-head
weight (any view of its storage) say how many times a step reads it.

The programs of a kernel (`Kernel.programs`, occupancy): a custom op's Triton
launch is read where it happens. On the fake CUDA device every Triton launch
over fake tensors records its kernel and grid (`FakeCuda.launches`) instead of
running, so the counter, given that log (`KernelCounter(launches=...)`), takes
the grid each launcher computed for the very launch the op makes. An op that
launches several kernels (the split sampler: one per phase) is that many
kernels, sharing its bytes evenly (`per_launch`). An op with no recorded launch
(aten ops, whose grids torch picks; a run on a real GPU) has `programs` None:
modelled as spread over every SM.

The time of a kernel (`Kernel.modelled_us`): the largest of one graph node,
its bytes at the device bandwidth, and its busiest SM's bytes at what one SM
can stream: a kernel of P programs on S SMs runs ceil(P / S) waves, each
program moving bytes / P, so an SM streams bytes / P per wave. A kernel of one
program per row at one row is bound by that one SM, not by HBM.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# The defaults of the modelled replay: a CUDA graph pays about 1.3 µs per kernel node on
# an H100 (Hazy Research, "no bubbles", 2025); a device-to-device copy moved 4.3 TB/s on
# an H200 here. An H100 SXM and an H200 have 132 SMs (NVIDIA's Hopper whitepaper). What
# one SM streams is an assumption, not a measurement (docs/cost-model.md): Little's law
# with 64 KB in flight per SM over ~600 ns of HBM latency, ~100 GB/s; 132 such SMs would
# be 13 TB/s, so a kernel over every SM is bound by HBM, one over a few SMs is not.
NODE_US = 1.3
BANDWIDTH_TBS = 4.3
SMS = 132
SM_BANDWIDTH_GBS = 100.0

# Ops that launch nothing: allocations (a pool offset inside a graph) and in-place
# metadata changes. Views are told by `func.is_view`, queries by returning no tensor.
NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted",
    "resize_", "resize_as_", "set_", "_unsafe_view", "lift_fresh", "as_strided_", "detach_",
    "squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "_reshape_alias",
})
# Ops that launch a kernel though they return no tensor and write none: a device-side check.
DEVICE_CHECKS = frozenset({"_assert_async"})
# In-place ops that overwrite `self` without reading it.
WRITE_ONLY_SELF = frozenset({
    "copy_", "fill_", "zero_", "uniform_", "normal_", "exponential_", "random_", "bernoulli_",
    "geometric_", "log_normal_", "cauchy_",
})
# In-place scatters: they write only the elements they index; the accumulating ones read them too.
_SCATTERS = frozenset({"index_put_", "_index_put_impl_", "scatter_", "scatter_add_", "scatter_reduce_",
                       "index_copy_", "index_add_", "index_fill_", "index_reduce_", "put_"})
_ACCUMULATING = frozenset({"scatter_add_", "scatter_reduce_", "index_add_", "index_reduce_"})
# Gathers: the argument they read only as many elements of as they produce.
_GATHER_SOURCE = {"index": "self", "gather": "self", "index_select": "self", "take": "self",
                  "embedding": "weight"}
# Scatters whose source is read only where `index` points.
_SCATTER_SOURCE = {"scatter_": "src", "scatter_add_": "src", "scatter_reduce_": "src", "put_": "source"}
# Custom ops that read only the rows of an argument an index names: op -> (argument, index).
ROW_GATHERS = {"lm_head_logits": ("hidden", "row_index"), "fail_non_finite_hidden": ("hidden", "row_index")}
# Custom ops that move only part of a [rows, V] argument: op -> {argument: elements, from the
# bound arguments}; a mutated one is read and written there (atomic adds). Verification reads
# each row's draft entry and, per request, its rejected row's chunk (`verify_step`, the
# residual draw: one of `split`) or whole row (`verify_residual_chunks`), and adds one count
# per emitted token (engine/sampling/kernels/verify_kernel.py).
def _draft_entries(bound: dict[str, Any]) -> int:
    return bound["drafts"].numel()


def _rejected_rows(bound: dict[str, Any]) -> int:
    return bound["residual_sums"].shape[0] * bound["weights"].shape[1] + _draft_entries(bound)


def _rejected_chunks(bound: dict[str, Any]) -> int:
    reqs, split, _ = bound["residual_sums"].shape
    return reqs * -(-bound["weights"].shape[1] // split) + _draft_entries(bound)


PARTIAL_READS = {
    "verify_residual_chunks": {"weights": _rejected_rows, "draft_probs": _rejected_rows},
    "verify_step": {"weights": _rejected_chunks, "draft_probs": _rejected_chunks, "counts": _draft_entries},
}


# Op namespaces of torch.distributed's collectives (a fake process group's too): what such
# a kernel writes on this rank is the step's exchange (`GraphCost.exchanged_bytes`).
COLLECTIVE_NAMESPACES = ("c10d.", "_c10d_functional.")


@dataclass(frozen=True)
class Kernel:
    """One launched kernel: its op and the bytes it moves."""

    op: str  # e.g. "aten.mm.default", "engine.sample.default"
    read: int  # bytes read from device memory
    written: int  # bytes written to device memory
    weight_read: int = 0  # of `read`, bytes of the LM-head weight
    programs: int | None = None  # its launch grid's programs; None: not known (spread over every SM)

    @property
    def bytes(self) -> int:
        return self.read + self.written

    def waves(self, sms: int = SMS) -> int:
        """ceil(programs / SMs): the rounds of programs the SMs run (1 when not known)."""
        return 1 if not self.programs else -(-self.programs // sms)

    def modelled_us(self, node_us: float = NODE_US, bandwidth_tbs: float = BANDWIDTH_TBS, sms: int = SMS,
                    sm_bandwidth_gbs: float = SM_BANDWIDTH_GBS) -> float:
        """max(one graph node, its bytes at the bandwidth, its bytes per program x waves at
        one SM's bandwidth), in µs (module doc)."""
        hbm = self.bytes / (bandwidth_tbs * 1e6)
        if not self.programs:
            return max(node_us, hbm)
        per_sm = self.bytes / self.programs * self.waves(sms) / (sm_bandwidth_gbs * 1e3)
        return max(node_us, hbm, per_sm)


@dataclass(frozen=True)
class _Op:
    """What the cost rules need of an op's schema, worked out once per op."""

    name: str  # the base name: "add_", "index_put_", "sample"
    custom: bool  # of a custom namespace: one kernel, whatever it does inside
    no_kernel: bool  # a view, an allocation or an in-place metadata change
    writes: bool  # mutates an argument
    arguments: tuple[tuple[str, bool, bool], ...]  # (name, mutated, overwritten without a read)
    fresh: tuple[bool, ...]  # per return: a new tensor (not an alias of an argument)


_OPS: dict[Any, _Op] = {}
_OWN_NAMESPACES = frozenset({"aten", "prims", "prim", "_c10d_functional", "c10d"})


def _op(func: Any) -> _Op:
    op = _OPS.get(func)
    if op is None:
        schema = func._schema
        name = schema.name.split("::", 1)[1]
        custom = func.namespace not in _OWN_NAMESPACES
        arguments = []
        for a in schema.arguments:
            mutated = a.alias_info is not None and a.alias_info.is_write
            write_only = mutated and (a.is_out or name in WRITE_ONLY_SELF
                                      or (custom and (a.name == "out" or a.name.startswith("out_"))))
            arguments.append((a.name, mutated, write_only))
        op = _OPS[func] = _Op(name, custom, not custom and (func.is_view or name in NO_KERNEL),
                              any(m for _, m, _ in arguments), tuple(arguments),
                              tuple(r.alias_info is None for r in schema.returns))
    return op


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _on_device(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "cpu"


def launches(func: Any, args: Sequence[Any], kwargs: dict[str, Any], result: Any) -> bool:
    """Whether dispatching `func` (an OpOverload) over these arguments, with this `result`,
    launches a kernel on the device."""
    op = _op(func)
    if op.no_kernel:
        return False
    results = _tensors(result)
    if not (op.custom or op.name in DEVICE_CHECKS or op.writes or results):
        return False  # a query: size, stride, device...
    # Host work (every tensor on the host) is no node of a device graph.
    return any(_on_device(t) for t in results) or any(_on_device(t) for t in _tensors((args, kwargs)))


def touched_elements(tensor: torch.Tensor) -> int:
    """The distinct elements a strided view addresses: stride-0 dimensions once, never
    more than the span from its first to its last element."""
    if tensor.numel() == 0:
        return 0
    sizes, strides = tensor.shape, tensor.stride()
    distinct = math.prod(size for size, stride in zip(sizes, strides) if stride != 0)
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(sizes, strides))
    return min(distinct, span)


def touched_bytes(tensor: torch.Tensor) -> int:
    return touched_elements(tensor) * tensor.element_size()


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage (shared by all its views; fake or real)."""
    return tensor.untyped_storage()._cdata


def _view_key(tensor: torch.Tensor) -> tuple:
    return storage_key(tensor), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


def _indexed_elements(name: str, bound: dict[str, Any]) -> int:
    """The elements of `self` an in-place scatter writes."""
    self_ = bound["self"]
    if name in ("index_put_", "_index_put_impl_"):
        indices = bound["indices"]
        given = [index for index in indices if index is not None]
        shape = torch.broadcast_shapes(*(index.shape for index in given)) if given else ()
        consumed = sum(index.dim() if index.dtype == torch.bool else 1 for index in given)
        consumed += sum(1 for index in indices if index is None)
        rest = [size for d, size in enumerate(self_.shape) if d >= consumed or (d < len(indices) and indices[d] is None)]
        return math.prod(shape) * math.prod(rest)
    if name in ("index_copy_", "index_add_", "index_fill_", "index_reduce_"):
        dim = bound["dim"] % max(self_.dim(), 1)
        return bound["index"].numel() * math.prod(s for d, s in enumerate(self_.shape) if d != dim)
    return bound["index"].numel()  # scatter_, scatter_add_, scatter_reduce_, put_


def kernel_bytes(func: Any, args: Sequence[Any], kwargs: dict[str, Any], result: Any,
                 weights: frozenset[int] = frozenset()) -> Kernel:
    """The bytes one launched op reads and writes (module doc); `weights`: the storage
    keys whose reads count as LM-head weight reads."""
    op = _op(func)
    name = op.name
    # Positional arguments, then keywords, by schema name (those not given are no tensors).
    bound = {arg_name: args[i] if i < len(args) else kwargs[arg_name]
             for i, (arg_name, _, _) in enumerate(op.arguments) if i < len(args) or arg_name in kwargs}
    reads: dict[tuple, int] = {}  # view -> bytes (a view passed twice is read once)
    weight: dict[tuple, int] = {}
    written = 0

    def read(tensor: torch.Tensor, nbytes: int | None = None) -> None:
        if not _on_device(tensor):
            return
        key = _view_key(tensor)
        nbytes = touched_bytes(tensor) if nbytes is None else min(nbytes, touched_bytes(tensor))
        reads[key] = max(reads.get(key, 0), nbytes)
        if key[0] in weights:
            weight[key] = reads[key]

    for arg_name, mutated, write_only in op.arguments:
        if arg_name not in bound:
            continue
        tensors = [t for t in _tensors(bound[arg_name]) if _on_device(t)]
        if not mutated:
            if _GATHER_SOURCE.get(name) == arg_name:
                produced = sum(touched_elements(t) for t in _tensors(result) if _on_device(t))
                for t in tensors:
                    read(t, produced * t.element_size())
            elif op.custom and arg_name in PARTIAL_READS.get(name, {}):
                for t in tensors:
                    read(t, PARTIAL_READS[name][arg_name](bound) * t.element_size())
            elif op.custom and ROW_GATHERS.get(name, ("",))[0] == arg_name:
                rows = bound[ROW_GATHERS[name][1]].numel()
                for t in tensors:
                    read(t, rows * math.prod(t.shape[1:]) * t.element_size())
            elif _SCATTER_SOURCE.get(name) == arg_name:
                for t in tensors:
                    read(t, bound["index"].numel() * t.element_size())
            elif name == "searchsorted" and arg_name == "sorted_sequence":
                queries = bound["self"].numel() if isinstance(bound.get("self"), torch.Tensor) else 1
                for t in tensors:
                    per_query = int(math.log2(max(t.shape[-1], 1))) + 1  # a binary search's probes
                    read(t, queries * per_query * t.element_size())
            else:
                for t in tensors:
                    read(t)
            continue
        for t in tensors:
            if op.custom and arg_name in PARTIAL_READS.get(name, {}):
                nbytes = min(PARTIAL_READS[name][arg_name](bound) * t.element_size(), touched_bytes(t))
                written += nbytes
                read(t, nbytes)
                continue
            if name in _SCATTERS and arg_name == "self":
                nbytes = _indexed_elements(name, bound) * t.element_size()
                written += nbytes
                if name in _ACCUMULATING or bool(bound.get("accumulate", False)) or bound.get("reduce") is not None:
                    read(t, nbytes)
                continue
            written += touched_bytes(t)
            if not write_only:
                read(t)
    results = result if isinstance(result, (tuple, list)) and len(op.fresh) > 1 else (result,)
    for fresh, value in zip(op.fresh, results):
        if fresh:  # a new tensor (an alias of a mutated argument is counted there)
            written += sum(touched_bytes(t) for t in _tensors(value) if _on_device(t))
    return Kernel(str(func), sum(reads.values()), written, sum(weight.values()))


class KernelCounter(TorchDispatchMode):
    """Lists the kernels of the ops dispatched under it (module doc); `weights`: tensors
    (the LM-head weight) whose reads are counted apart, through any view of their storage."""

    def __init__(self, weights: Iterable[torch.Tensor] = (), passes: dict[str, int | tuple[int, ...]] | None = None,
                 launches: Sequence[Any] | None = None) -> None:
        super().__init__()
        self.weights = frozenset(storage_key(w) for w in weights)
        self.passes = passes or {}
        self.launches = launches  # the fake device's launch log (`FakeCuda.launches`), or None
        self.kernels: list[Kernel] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = 0 if self.launches is None else len(self.launches)
        # While this runs the mode is off the stack: what `func` dispatches inside
        # (a custom op's implementation) never reaches it.
        result = func(*args, **kwargs)
        if launches(func, args, kwargs, result):
            kernel = kernel_bytes(func, args, kwargs, result, self.weights)
            if str(func) in self.passes:
                kernel = with_passes(kernel, args, self.passes[str(func)])
            launched = [] if self.launches is None else self.launches[before:]
            self.kernels.extend(per_launch(kernel, [launch.programs for launch in launched]))
        return result


def per_launch(kernel: Kernel, programs: Sequence[int]) -> list[Kernel]:
    """An op's kernels, one per Triton launch it made with that launch's programs (none
    recorded: the op as one kernel of unknown grid). Several launches (the split sampler's
    one per phase, each reading its rows once) share the op's bytes evenly."""
    if not programs:
        return [kernel]
    n = len(programs)

    def share(total: int, i: int) -> int:  # the i-th of n near-equal shares summing to total
        return total // n + (1 if i < total % n else 0)

    return [dataclasses.replace(kernel, read=share(kernel.read, i), written=share(kernel.written, i),
                                weight_read=share(kernel.weight_read, i), programs=p)
            for i, p in enumerate(programs)]


def with_passes(kernel: Kernel, args: Sequence[Any], passes: int | tuple[int, ...]) -> Kernel:
    """The passes rule for a custom op that streams over its first argument (the [rows, V]
    scores) `passes` times: that argument is read `passes` times instead of once; a tuple
    counts the passes over its first arguments in order (a None argument is skipped). 0
    over the first: the rows it serves skip the op (a per-row flag), which then moves no
    bytes, only its node."""
    counts = (passes,) if isinstance(passes, int) else passes
    if counts[0] == 0:
        return dataclasses.replace(kernel, read=0, written=0, weight_read=0)
    extra = sum((n - 1) * touched_bytes(arg) for arg, n in zip(args, counts) if isinstance(arg, torch.Tensor))
    return dataclasses.replace(kernel, read=kernel.read + extra)


@dataclass
class GraphCost:
    """One captured graph: the kernels of one bucket's step and what they cost."""

    scenario: str  # e.g. "engine", "drafts rejection", "sharded tp=2"
    graph_set: str  # the graph: its head's name (`LMHead.name`), the kernel head's per row mix
    bucket: int
    rows: int  # sample rows of the bucket: bucket * (1 + drafts)
    vocab: int  # vocabulary rows of the weight this graph reads (a rank's shard when sharded)
    weight_bytes: int  # one read of the LM-head weight
    kernels: list[Kernel] = field(default_factory=list)
    measured_us: float | None = None  # a GPU replay's median, where one was timed
    draft_probs_bytes: int = 0  # rejection mode: one read of the rows' staged draft distributions

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.kernels)

    @property
    def exchanged_bytes(self) -> int:
        """What the step's collectives write on this rank (an all-gather: every rank's part,
        this rank's own included): the bytes exchanged per step, 0 on one device."""
        return sum(k.written for k in self.kernels if k.op.startswith(COLLECTIVE_NAMESPACES))

    @property
    def weight_reads(self) -> float:
        """How many times the step reads the whole LM-head weight."""
        return sum(k.weight_read for k in self.kernels) / self.weight_bytes if self.weight_bytes else 0.0

    def floor_bytes(self) -> int:
        """One read of the weight, one write and one read of the [rows, V] f32 logits, and in
        rejection mode one read of the draft distributions verification must see."""
        return self.weight_bytes + 2 * self.rows * self.vocab * 4 + self.draft_probs_bytes

    def modelled_us(self, node_us: float = NODE_US, bandwidth_tbs: float = BANDWIDTH_TBS, sms: int = SMS,
                    sm_bandwidth_gbs: float = SM_BANDWIDTH_GBS) -> float:
        return sum(k.modelled_us(node_us, bandwidth_tbs, sms, sm_bandwidth_gbs) for k in self.kernels)

    def floor_us(self, bandwidth_tbs: float = BANDWIDTH_TBS) -> float:
        return self.floor_bytes() / (bandwidth_tbs * 1e6)

    def as_dict(self, node_us: float = NODE_US, bandwidth_tbs: float = BANDWIDTH_TBS,
                detail: bool = False, sms: int = SMS, sm_bandwidth_gbs: float = SM_BANDWIDTH_GBS) -> dict[str, Any]:
        """The JSON form; `detail`: per op, its kernels, programs, bytes and modelled µs,
        costliest first."""
        modelled, floor = self.modelled_us(node_us, bandwidth_tbs, sms, sm_bandwidth_gbs), self.floor_us(bandwidth_tbs)
        out: dict[str, Any] = {
            "scenario": self.scenario, "graph_set": self.graph_set, "bucket": self.bucket, "rows": self.rows,
            "vocab": self.vocab, "weight_bytes": self.weight_bytes, "kernels": len(self.kernels), "bytes": self.bytes, "exchanged_bytes": self.exchanged_bytes,
            "weight_reads": round(self.weight_reads, 3),
            "modelled_us": round(modelled, 2), "floor_us": round(floor, 2), "ratio": round(modelled / floor, 3),
        }
        if self.measured_us is not None:
            out["measured_us"] = round(self.measured_us, 2)
        if detail:
            out["ops"] = [{"op": op, "kernels": n, "programs": programs, "bytes": nbytes, "modelled_us": round(us, 2)}
                          for op, n, programs, nbytes, us in by_op(self.kernels, node_us, bandwidth_tbs, sms,
                                                                  sm_bandwidth_gbs)]
        return out


def by_op(kernels: Iterable[Kernel], node_us: float = NODE_US, bandwidth_tbs: float = BANDWIDTH_TBS,
          sms: int = SMS, sm_bandwidth_gbs: float = SM_BANDWIDTH_GBS) -> list[tuple[str, int, int | None, int, float]]:
    """(op, kernels, programs of its largest launch or None, bytes, modelled µs) per op, costliest first."""
    table: dict[str, list] = {}
    for k in kernels:
        row = table.setdefault(k.op, [0, None, 0, 0.0])
        row[0] += 1
        if k.programs is not None:
            row[1] = max(row[1] or 0, k.programs)
        row[2] += k.bytes
        row[3] += k.modelled_us(node_us, bandwidth_tbs, sms, sm_bandwidth_gbs)
    return sorted(((op, n, p, b, us) for op, (n, p, b, us) in table.items()), key=lambda r: -r[4])


def table_lines(costs: Sequence[GraphCost], node_us: float = NODE_US, bandwidth_tbs: float = BANDWIDTH_TBS,
                detail: bool = False, sms: int = SMS, sm_bandwidth_gbs: float = SM_BANDWIDTH_GBS) -> Iterator[str]:
    """The readable table: one line per graph (and its costliest ops with `detail`)."""
    measured = any(c.measured_us is not None for c in costs)
    yield (f"{'scenario':<18} {'graph':<40} {'bucket':>6} {'rows':>5} {'kernels':>7} {'MB':>9} "
           f"{'W reads':>7} {'model us':>9} {'floor us':>9} {'ratio':>6}" + (f" {'GPU us':>9}" if measured else ""))
    for c in costs:
        modelled, floor = c.modelled_us(node_us, bandwidth_tbs, sms, sm_bandwidth_gbs), c.floor_us(bandwidth_tbs)
        gpu = "" if not measured else f" {c.measured_us:9.1f}" if c.measured_us is not None else f" {'-':>9}"
        yield (f"{c.scenario:<18} {c.graph_set:<40} {c.bucket:>6} {c.rows:>5} {len(c.kernels):>7} "
               f"{c.bytes / 1e6:>9.1f} {c.weight_reads:>7.2f} {modelled:>9.1f} {floor:>9.1f} {modelled / floor:>6.2f}{gpu}")
        if c.exchanged_bytes:
            yield f"{'':<18}   exchanged per step: {c.exchanged_bytes / 1e6:.3f} MB written by the collectives on this rank"
        if detail:
            for op, n, programs, nbytes, us in by_op(c.kernels, node_us, bandwidth_tbs, sms, sm_bandwidth_gbs)[:8]:
                grid = f"{programs:>6} programs" if programs is not None else f"{'?':>6} programs"
                yield f"{'':<18}   {op:<40} {n:>4} kernels {grid} {nbytes / 1e6:>9.1f} MB {us:>9.1f} us"
