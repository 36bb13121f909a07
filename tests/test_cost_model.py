"""The kernel-level cost model (profiling/cost_model.py) against a hand count.

A tiny step on the fake CUDA device holds one of each case the counter must
get right: views (no kernel), an allocation (none), a fill (one, write only),
a dtype cast, a GEMM reading the weight through a transposed view, an in-place
update whose operand is an expanded (stride-0) tensor, a torch.library
custom_op whose fake implementation dispatches ops of its own, a Triton
triton_op mutating an `out` view, a gather, a column slice and an in-place
scatter. Every count and byte below is worked out by hand from the shapes,
not by the code under test. Then the CLI's JSON, end to end at small shapes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from torch.library import custom_op, triton_op, wrap_triton

from profiling.cost_calibration import calibration, calibration_lines
from profiling.cost_model import GraphCost, Kernel, KernelCounter, table_lines, touched_bytes
from profiling.cuda_dry_run import main
from profiling.fake_cuda import FakeCuda


@custom_op("cost_test::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    # Two ops inside the custom op: the counter must not see them.
    return (x * 2).clone()


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) * 3, mask=i < n)


@triton_op("cost_test::scale", mutates_args={"out"})
def scale(x: torch.Tensor, out: torch.Tensor) -> None:
    n = x.numel()
    wrap_triton(_scale_kernel)[(triton.cdiv(n, 64),)](x, out, n, BLOCK=64)


# No fake of its own, as the engine's kernels: a triton_op's fake is its launcher, whose
# Triton launch on fake tensors the fake device records (its grid) and does not run.


# (op, bytes read, bytes written, of the reads: weight bytes), worked out by hand.
# x [4, 16] f32, w [32, 16] bf16 (1024 B), bias [32] f32, out [4, 32] f32, ids [2, 1] i64.
HAND_COUNT = [
    ("aten._to_copy.default", 2 * 16 * 4, 2 * 16 * 2, 0),  # x[:2] f32 -> bf16 (the slice: a view)
    ("aten.mm.default", 2 * 16 * 2 + 1024, 2 * 32 * 2, 1024),  # both operands whole, w through w.t()
    ("aten._to_copy.default", 2 * 32 * 2, 2 * 32 * 4, 0),  # logits bf16 -> f32
    ("aten.add_.Tensor", 256 + 32 * 4, 256, 0),  # self read + written once; bias expanded: 32 floats, not 64
    ("cost_test.double.default", 256, 256, 0),  # one kernel; the mul and clone inside are not counted
    ("cost_test.scale.default", 256, 2 * 32 * 4, 0),  # `out` (a view of out[:2]) written, not read
    ("aten.gather.default", 2 * 8 + 2 * 4, 2 * 4, 0),  # the ids whole, 2 source elements, not out's 128
    ("aten.zero_.default", 0, 32 * 4, 0),  # out[0] (a select: a view) overwritten, not read
    ("aten.sum.dim_IntList", 4 * 4 * 4, 4 * 4, 0),  # out[:, :4]: 16 elements of a strided view
    ("aten.fill_.Scalar", 0, 8 * 4, 0),  # the empty scratch: the allocation launches nothing
    ("aten.index_put_.default", 2 * 8 + 32 * 4, 2 * 32 * 4, 0),  # rows + value; 2 rows of out written
]


def _tiny_step() -> tuple[list[Kernel], torch.Tensor]:
    """Run the tiny step on the fake device under the counter."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeCuda() as cuda:
            x = torch.empty(4, 16, device="cuda")  # [4, 16] f32
            w = torch.empty(32, 16, dtype=torch.bfloat16, device="cuda")  # [V=32, H=16]
            bias = torch.empty(32, device="cuda")
            out = torch.empty(4, 32, device="cuda")
            ids = torch.zeros(2, 1, dtype=torch.int64, device="cuda")
            rows = torch.zeros(2, dtype=torch.int64, device="cuda")
            counter = KernelCounter(weights=(w,), launches=cuda.launches)
            with counter:
                h = x[:2]
                logits = torch.mm(h.to(torch.bfloat16), w.t())  # [2, 32] bf16
                lf = logits.to(torch.float32)
                lf.add_(bias.expand(2, 32))
                y = double(lf)
                scale(y, out[:2])
                out.gather(1, ids)
                out[0].zero_()
                out[:, :4].sum(dim=1)
                scratch = torch.empty(8, device="cuda")
                scratch.fill_(1.0)
                out[rows] = bias
                torch.ones(3).add_(1)  # host work: no kernel
            return counter.kernels, w


def test_kernels_and_bytes_match_a_hand_count() -> None:
    kernels, _ = _tiny_step()
    assert [(k.op, k.read, k.written, k.weight_read) for k in kernels] == HAND_COUNT


def test_graph_cost_sums_the_kernels_against_the_floor() -> None:
    kernels, w = _tiny_step()
    total = sum(read + written for _, read, written, _ in HAND_COUNT)
    cost = GraphCost("tiny", "all", bucket=2, rows=2, vocab=32, weight_bytes=1024, kernels=kernels)
    assert cost.bytes == total and cost.weight_reads == 1.0
    assert cost.floor_bytes() == 1024 + 2 * (2 * 32 * 4)  # the weight once, the f32 logits written and read
    # At 1e-6 TB/s a byte takes 1 µs: each kernel costs max(node, its bytes).
    assert cost.modelled_us(node_us=0.0, bandwidth_tbs=1e-6) == pytest.approx(total)
    assert cost.modelled_us(node_us=300.0, bandwidth_tbs=1e-6) == pytest.approx(
        sum(max(300.0, read + written) for _, read, written, _ in HAND_COUNT))
    assert cost.modelled_us() == pytest.approx(len(HAND_COUNT) * 1.3)  # all tiny: node-bound at the defaults
    assert cost.floor_us(bandwidth_tbs=1e-6) == pytest.approx(1536)
    row = cost.as_dict(detail=True)
    assert row["kernels"] == len(HAND_COUNT) and row["bytes"] == total
    assert sum(op["kernels"] for op in row["ops"]) == len(HAND_COUNT)
    lines = list(table_lines([cost], detail=True))
    assert lines[1].split()[:4] == ["tiny", "all", "2", "2"] and "aten.mm.default" in "\n".join(lines)


def test_the_grid_of_a_triton_op_is_read_from_its_launch() -> None:
    """`scale` launches cdiv(n, 64) programs: 1 for out[:2] (64 elements). Every other op
    of the tiny step is aten or a plain custom op: no grid known."""
    kernels, _ = _tiny_step()
    assert {k.op: k.programs for k in kernels}["cost_test.scale.default"] == 1
    assert [k.programs for k in kernels if k.op != "cost_test.scale.default"] == [None] * (len(HAND_COUNT) - 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeCuda() as cuda:
            x = torch.empty(64 * 7 + 1, device="cuda")
            counter = KernelCounter(launches=cuda.launches)
            with counter:
                scale(x, torch.empty_like(x))
    assert [(k.op, k.programs) for k in counter.kernels] == [("cost_test.scale.default", 8)]
    assert [(launch.kernel, launch.grid) for launch in cuda.launches] == [("_scale_kernel", (8,))]


def test_verification_is_charged_what_it_reads() -> None:
    """`PARTIAL_READS`, by hand: 2 requests of 4 rows, V = 4096, split 4. The chunk kernel reads
    each request's rejected row of the kept weights and of q (2 x 4096) and every row's draft
    entry (8); `verify_step` one chunk of 1024 per request and the draft entries, and adds one
    count per row (read and written), not the whole [slots, V] counts."""
    from engine.sampling.kernels.verify_kernel import verify_residual_chunks, verify_step

    vocab = 4096
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeCuda() as cuda:
            def vec(n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
                return torch.empty(n, dtype=dtype, device="cuda")

            weights, q = torch.empty(8, vocab, device="cuda"), torch.empty(8, vocab, device="cuda")
            probs = (weights, vec(8, torch.float64), vec(8), q, vec(8, torch.bool), vec(2), vec(2))
            sums, counts = torch.empty(2, 4, 2, dtype=torch.int64, device="cuda"), vec(3 * vocab, torch.int32)
            counter = KernelCounter(launches=cuda.launches)
            with counter:
                verify_residual_chunks(vec(8), vec(8), vec(8), *probs, sums)
                verify_step(vec(8), vec(8), vec(8), vec(8), vec(8), vec(2), vec(8), *probs, sums, None, None,
                            None, None, None, None, None, vec(2), counts.view(3, vocab), vec(8),
                            mode="rejection", max_drafts=3, rows_per_req=4)
    # Besides the [rows, V] operands: drafts, row_to_req, local_step, the total (f64), one-hot,
    # has q (bool), seeds, positions.
    vectors = 3 * 64 + 64 + 64 + 8 + 16 + 16
    residual, step = counter.kernels
    # The sums, a mutated argument not named out: read and written by the general rule.
    assert (residual.read, residual.written) == (2 * (2 * vocab + 8) * 4 + vectors + 128, 128)
    # verify_step also reads tokens and errors, the sums, the control slots; it updates
    # num_accepted, emitted and counted_index (read and written) and 8 counts.
    step_vectors = vectors + 2 * 64 + 128 + 16 + 16 + 64 + 64
    assert step.read == 2 * (2 * 1024 + 8) * 4 + 8 * 4 + step_vectors
    assert step.written == 16 + 64 + 64 + 8 * 4


# (bytes, programs, µs) at node 1 µs, HBM 100 TB/s (1e8 B/µs), 10 SMs at 1 GB/s (1e3 B/µs) each,
# worked out by hand: max(node, bytes / HBM, bytes / programs x ceil(programs / SMs) / per SM).
OCCUPANCY_HAND_COUNT = [
    (20_000, 1, 20.0),  # one program: one SM streams it all, 20000 B at 1000 B/µs
    (20_000, 4, 5.0),  # 4 SMs, 5000 B each
    (20_000, 10, 2.0),  # every SM: 2000 B each
    (20_000, 11, 20_000 / 11 * 2 / 1000),  # 2 waves of 1818.2 B per program: 3.64 µs
    (20_000, 20, 2.0),  # 2 waves of 1000 B
    (500, 1, 1.0),  # node-bound
    (5e9, 10, 5e5),  # 5e8 B per SM: bound by the SMs (500000 µs), not HBM (50 µs)
    (5e9, None, 50.0),  # grid unknown: spread over every SM, HBM-bound
]


@pytest.mark.parametrize("nbytes, programs, expected", OCCUPANCY_HAND_COUNT)
def test_occupancy_matches_a_hand_count(nbytes: float, programs: int | None, expected: float) -> None:
    kernel = Kernel("engine.k.default", int(nbytes), 0, programs=programs)
    modelled = kernel.modelled_us(node_us=1.0, bandwidth_tbs=100.0, sms=10, sm_bandwidth_gbs=1.0)
    assert modelled == pytest.approx(expected, rel=1e-4)


def test_touched_bytes_of_strided_views() -> None:
    base = torch.empty(8, 100)
    assert touched_bytes(base) == 3200
    assert touched_bytes(base[:, :4]) == 8 * 4 * 4  # a column slice: the elements it selects
    assert touched_bytes(base[0].expand(5, 100)) == 400  # stride 0: the row once
    assert touched_bytes(torch.empty(()).expand(64, 1000)) == 4
    assert touched_bytes(torch.empty(0, 5)) == 0
    # Overlapping windows: no more than the span they cover.
    assert touched_bytes(torch.empty(10).as_strided((4, 5), (1, 1))) == 8 * 4


def test_calibration_recovers_the_node_time_and_bandwidth_of_measured_graphs() -> None:
    """Graphs whose measured replay is exactly kernels x 2 µs + bytes at 0.5 TB/s."""
    costs = []
    for n, mb in ((10, 1.0), (40, 3.0), (25, 50.0), (300, 20.0)):
        kernels = [Kernel("aten.add.Tensor", int(mb * 1e6) // n, 0)] * n
        cost = GraphCost("s", "g", 1, 1, 1, 1, kernels)
        cost.measured_us = 2.0 * n + cost.bytes / 0.5e6
        costs.append(cost)
    fit = calibration(costs, node_us=1.0, bandwidth_tbs=1.0)
    assert fit is not None and fit["graphs_timed"] == 4
    assert fit["fit_node_us"] == pytest.approx(2.0) and fit["fit_bandwidth_tbs"] == pytest.approx(0.5)
    assert fit["min_ratio"] <= fit["median_ratio"] <= fit["max_ratio"]
    assert "0.50 TB/s" in "\n".join(calibration_lines(fit))
    assert calibration([GraphCost("s", "g", 1, 1, 1, 1)]) is None  # nothing timed: no calibration


def test_cli_json_has_every_graph_and_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # At 1e-6 TB/s and no node time a graph's modelled µs are its bytes, and the floor µs its floor bytes.
    # The torch head's graph sets (on CUDA the engines default to the kernel head: the next test).
    argv = ["--cost", "--json", "--cost-detail", "--hidden", "64", "--vocab", "2048", "--max-num-reqs", "2",
            "--drafts", "1", "--buckets", "2", "--node-us", "0", "--bandwidth-tbs", "1e-6",
            "--json-out", str(tmp_path / "cost.json"), "--kernels", "torch"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)  # one JSON object, nothing else on stdout
    assert json.loads((tmp_path / "cost.json").read_text()) == report
    assert "calibration" not in report  # nothing measured on the fake device
    assert report["sms"] == 132 and report["sm_bandwidth_gbs"] == 100.0  # the occupancy model's device
    graphs = report["graphs"]
    assert {(g["scenario"], g["graph_set"]) for g in graphs} >= {
        ("engine", "torch"), ("drafts strict", "torch"), ("drafts rejection", "torch"),
        ("shard heads tp=2", "torch"), ("shard heads drafts", "torch")}
    assert len(graphs) == 5  # one graph a scenario (every stage for every row), bucket 2 only
    for g in graphs:
        assert {"scenario", "graph_set", "bucket", "kernels", "bytes", "exchanged_bytes", "modelled_us", "floor_us",
                "weight_reads", "ratio", "ops"} <= set(g)
        assert g["bucket"] == 2 and g["rows"] == (4 if g["scenario"].endswith("drafts") or
                                                  g["scenario"].startswith("drafts") else 2)
        assert g["kernels"] > 20 and g["weight_reads"] == 1.0  # one 64-row GEMM block covers every bucket here
        assert g["modelled_us"] == g["bytes"]
        # Rejection mode's floor reads the staged draft distributions once more: [rows, V] f32.
        rejection = g["scenario"] in ("drafts rejection", "shard heads drafts")  # the shard heads' drafts: rejection
        # The draft distributions are over the whole vocabulary (tp = 2 shards for the shard heads).
        full_vocab = g["vocab"] * (2 if g["scenario"].startswith("shard heads") else 1)
        draft_probs = g["rows"] * full_vocab * 4 if rejection else 0
        assert g["floor_us"] == g["weight_bytes"] + 2 * g["rows"] * g["vocab"] * 4 + draft_probs
        assert g["ratio"] == pytest.approx(g["modelled_us"] / g["floor_us"], rel=1e-3)
        assert sum(op["kernels"] for op in g["ops"]) == g["kernels"]
        assert sum(op["bytes"] for op in g["ops"]) == g["bytes"]
    engine = next(g for g in graphs if g["scenario"] == "engine")
    assert engine["vocab"] == 2048 and engine["weight_bytes"] == 2048 * 64 * 2


def test_the_kernel_heads_graphs_are_a_dozen_kernels_at_most(capsys: pytest.CaptureFixture[str]) -> None:
    """The default engines on CUDA: one graph per bucket, priced per row mix, each graph at
    most 12 kernels reading the weight once (drafts included); the passes rule charges the
    sampling kernel 4 row reads for the full sampler (its cuts' kept lists fit), 3 plain,
    2 greedy."""
    argv = ["--cost", "--json", "--cost-detail", "--hidden", "64", "--vocab", "2048", "--max-num-reqs", "4",
            "--drafts", "3", "--node-us", "0", "--bandwidth-tbs", "1e-6"]
    assert main(argv) == 0
    graphs = json.loads(capsys.readouterr().out)["graphs"]
    assert {g["graph_set"] for g in graphs} == {"kernels (full sampler)", "kernels (plain)", "kernels (greedy)",
                                                 "kernels (controls)"}
    for g in graphs:
        assert g["kernels"] <= 12 and g["weight_reads"] == 1.0, g
    # The shard heads (engine/parallel/shard_heads.py), rank 0 of 2: its 1024 rows of the weight, and
    # an all-gather that writes both ranks' [rows, 1024] f32 logits, by hand: 2 * rows * 1024 * 4 bytes.
    shards = [g for g in graphs if g["scenario"].startswith("shard heads")]
    assert {g["scenario"] for g in shards} == {"shard heads tp=2", "shard heads drafts"}
    for g in graphs:
        sharded = g["scenario"].startswith("shard heads")
        assert g["exchanged_bytes"] == (2 * g["rows"] * 1024 * 4 if sharded else 0), g
        assert g["vocab"] == (1024 if sharded else 2048)
    engine = {g["graph_set"]: g for g in graphs if g["scenario"] == "engine" and g["bucket"] == 4}
    row = 4 * 2048 * 4  # one read of the bucket's [4, V] f32 rows
    sample = {name: next(op["bytes"] for op in g["ops"] if op["op"] == "engine.sample_rows.default")
              for name, g in engine.items()}
    assert sample["kernels (full sampler)"] - sample["kernels (greedy)"] == 2 * row
    assert sample["kernels (plain)"] - sample["kernels (greedy)"] == row
    # The grids are the launches': the LM head's persistent grid, min(tiles, 2 per SM) with
    # cdiv(4, 64) x cdiv(2048, 128) = 16 tiles; the sampler splits each of the 4 rows into
    # its 2 chunks of 1024 (132 SMs), one launch per phase: 9 kernels of the graph's 12.
    ops = {op["op"]: op for op in engine["kernels (full sampler)"]["ops"]}
    assert ops["engine.lm_head_logits.default"]["programs"] == 16
    assert ops["engine.sample_rows.default"]["programs"] == 8 and ops["engine.sample_rows.default"]["kernels"] == 9
    assert engine["kernels (full sampler)"]["kernels"] == 12
    # A drafts graph keeps the sampler in one launch, one program per row (16 rows at bucket 4).
    drafts = next(g for g in graphs if g["scenario"] == "drafts rejection" and g["bucket"] == 4)
    sampler = next(op for op in drafts["ops"] if op["op"] == "engine.sample_rows.default")
    assert sampler["kernels"] == 1 and sampler["programs"] == 16


def test_cli_refuses_cost_flags_without_cost(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--json"])
    assert "go with --cost" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--cost", "--buckets", "3", "--max-num-reqs", "2"])
    assert "--buckets [3]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--cost", "--buckets", "1;8"])
    assert "expected bucket sizes separated by commas" in capsys.readouterr().err


def test_replay_timing_reports_the_median_per_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path's arithmetic, with CUDA events stood in for: 3 runs of 10 replays that
    take 2, 5 and 3 ms give 300 µs per replay."""
    from profiling import cost_calibration

    elapsed = iter([2.0, 5.0, 3.0])

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: "Event") -> float:
            return next(elapsed)

    class Replayer:
        replays = 0

        def replay(self, bucket: int) -> None:
            assert bucket == 8
            Replayer.replays += 1

    monkeypatch.setattr(cost_calibration.torch.cuda, "Event", Event)
    monkeypatch.setattr(cost_calibration.torch.cuda, "synchronize", lambda: None)
    assert cost_calibration.replay_us(Replayer(), 8, replays=10) == pytest.approx(300.0)
    assert Replayer.replays == 3 + 3 * 10


GPU_CHECK = Path(__file__).resolve().parent.parent / "profiling" / "gpu_check.sh"


def test_gpu_check_parses_and_its_dry_run_lists_the_cost_step(tmp_path: Path) -> None:
    """`gpu_check.sh --dry` with a stand-in Python that records its arguments: every
    step is printed, none runs, and the cost step's fake twin is called with the flags
    the GPU step uses."""
    assert subprocess.run(["bash", "-n", str(GPU_CHECK)]).returncode == 0
    calls = tmp_path / "calls"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')
    stub.chmod(0o755)
    done = subprocess.run(["bash", str(GPU_CHECK), "--dry"], env={**os.environ, "OUT": str(tmp_path), "PYTHON": str(stub)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "gpu_check.log").read_text()
    steps = [line for line in log.splitlines() if line.startswith("$ ")]
    # With the kernel head check, the torch head's cost and the demo over NCCL (listed: --dry lists every step).
    assert len(steps) == 12 and "SKIPPED" not in log, log
    json_out = f"--json-out {tmp_path}/cost_gpu.json"
    assert any("-m profiling.cuda_dry_run --cost" in s and json_out in s and s.rstrip().endswith("--real-cuda")
               for s in steps), steps
    ran = calls.read_text().splitlines()  # the dry run's own calls: the demo's weight probe, the cost twin
    assert [c for c in ran if "--cost" in c] == [
        f"-m profiling.cuda_dry_run --cost {json_out} --hidden 64 --vocab 2048 --max-num-reqs 2 --drafts 1 --buckets 2"]
    assert subprocess.run(["bash", str(GPU_CHECK), "--wet"], capture_output=True).returncode == 2


def test_gpu_check_budget_runs_each_step_or_skips_it(tmp_path: Path) -> None:
    """Not dry, with stand-ins for Python and nvidia-smi that fail: each step runs and reports
    its time and exit status (the run goes on) within the budget; past it every step is skipped."""
    stub = tmp_path / "python"
    stub.write_text("#!/usr/bin/env bash\nexit 3\n")
    stub.chmod(0o755)
    (tmp_path / "nvidia-smi").symlink_to(stub)
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": str(stub), "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    for budget, ran in (("450", 11), ("19", 0)):
        done = subprocess.run(["bash", str(GPU_CHECK)], env={**env, "GPU_CHECK_BUDGET_S": budget},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        log = (tmp_path / "gpu_check.log").read_text()
        assert log.count("[step took ") == log.count(", rc 3]") == ran and log.count("SKIPPED") == 11 - ran, log


@pytest.mark.skipif(not os.environ.get("ENGINE_LONG_TESTS"), reason="ENGINE_LONG_TESTS=1: runs the cost CLI (~15 s)")
def test_gpu_check_dry_run_writes_the_cost_json(tmp_path: Path) -> None:
    root = GPU_CHECK.parent.parent
    done = subprocess.run(["bash", str(GPU_CHECK), "--dry"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable,
                               "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert done.returncode == 0, done.stderr
    graphs = json.loads((tmp_path / "cost_gpu.json").read_text())["graphs"]
    # The kernel head's graph per row mix (3 each for the engine, both draft modes and the shard
    # heads with and without drafts).
    assert len(graphs) == 15 and all(g["kernels"] > 0 and g["floor_us"] > 0 for g in graphs)
