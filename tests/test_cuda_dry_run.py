"""The fake-CUDA dry run: the whole CUDA path passes at small shapes, and a CPU
constant or a host sync planted inside the captured step makes it fail, naming
the op, the reason and the line (the CPU capture check alone cannot see the
first)."""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

import engine.sampling.sampler as sampler_module
from engine import EngineConfig, StepEngine
from engine.models.llama_weights import LlamaConfig
from profiling.cuda_dry_run import DryRunConfig, DryRunFailure, main, run

# The torch-op head: the hazards below are planted in its sampler (the kernel head runs none of it).
SMALL = DryRunConfig(hidden=64, vocab=2048, max_num_reqs=2, max_draft_tokens=1, tp=2, model=LlamaConfig.tiny(),
                     kernels="torch")
# A constant made once, outside any step, on the CPU: harmless on a CPU engine,
# a host operand of a device op on CUDA.
NEG_INF = torch.tensor(-math.inf)


def test_dry_run_passes_and_reports_ops_per_bucket(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--hidden", "64", "--vocab", "2048", "--max-num-reqs", "2", "--drafts", "1", "--tiny-model"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # On CUDA the engines run the kernel head: one graph set, one graph per bucket (no variants).
    assert not re.search(r"^  (engine|drafts \w+) (plain|greedy|controls) ", out, re.M), out
    for graph_set in ("engine", "drafts strict", "drafts rejection",
                      "shard heads tp=2", "model decode (eager)"):
        line = next(line for line in out.splitlines() if line.strip().startswith(graph_set + " "))
        counts = [int(ops) for ops in re.findall(r"\b\d+:(\d+)", line)]
        assert counts and min(counts) > 30, line  # every bucket ran a real step under the check
    assert re.search(r"^  engine +1:\d+  2:\d+$", out, re.M), out  # both buckets of max_num_reqs=2
    # The output copy after each replay is counted, not hidden: one read a graph step.
    assert re.search(r"engine/step/static_buffers.py:\d+", out)
    assert re.search(r"^graph steps: (\d+), device-to-host reads \1, pageable host-to-device copies 0", out, re.M), out
    # The engine's own per-step uploads (staging, source-copy index, draft probabilities)
    # are pinned and asynchronous; what is left pageable is listed, and is not the engine's.
    pageable = out.split("pageable host-to-device copies")[1].split("host-to-device copies outside the graphs, pinned")[0]
    assert "step_engine.py" not in pageable and "static_buffers.py" not in pageable, pageable
    assert not any(f"engine/step/{name}.py" in pageable for name in ("body", "collect", "drafts", "lm_head", "kernel_head", "kernel_step")), pageable
    assert "dry run passed" in out


def _plant(monkeypatch: pytest.MonkeyPatch, hazard) -> None:
    """Wrap the sampler's suppression stage (inside the captured step of every
    graph set) with `hazard`, given the masked scores and their row maximum."""
    original = sampler_module.suppress_stop_ids_

    def planted(scores, rows):
        stops = original(scores, rows)
        stops.scores = hazard(stops.scores, stops.scores.amax(-1))
        return stops

    monkeypatch.setattr(sampler_module, "suppress_stop_ids_", planted)


def _cpu_constant(e: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return torch.maximum(e, NEG_INF)


def _item(e: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    if shift.max().item() > 1e30:
        return e * 0
    return e


def _host_factory(e: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return e + torch.zeros(e.shape[1])  # no device=: a host tensor made during the step


def test_a_host_tensor_in_a_device_op_outside_the_graphs_fails_the_dry_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager code after the replay (here the output copy) is held to CUDA's device rules."""
    from engine.step.static_buffers import OutputCopy

    original = OutputCopy.fetch

    def planted(self, *, wide):
        tokens = self.area.out.tokens
        tokens + torch.ones(tokens.shape[0], dtype=torch.int64)  # a host vector in a device op
        return original(self, wide=wide)

    monkeypatch.setattr(OutputCopy, "fetch", planted)
    with pytest.raises(DryRunFailure, match=r"StepEngine: aten.add.Tensor .*devices(?s:.*)test_cuda_dry_run.py"):
        run(SMALL)


@pytest.mark.parametrize(("hazard", "op", "reason", "line"), [
    (_cpu_constant, "aten.maximum.default", "reads a CPU tensor in a device op", "torch.maximum(e, NEG_INF)"),
    (_item, "Tensor.item()", "a host sync", "if shift.max().item() > 1e30:"),
    (_host_factory, "aten.zeros.default", "produces a tensor on the host", "torch.zeros(e.shape[1])"),
], ids=["cpu constant", "item", "host factory"])
def test_a_hazard_inside_the_step_fails_the_dry_run(monkeypatch: pytest.MonkeyPatch, hazard, op: str, reason: str,
                                                    line: str) -> None:
    _plant(monkeypatch, hazard)
    with pytest.raises(DryRunFailure) as info:
        run(SMALL)
    message = str(info.value)
    assert message.startswith("StepEngine: ") and op in message and reason in message, message
    assert "tests/test_cuda_dry_run.py:" in message and line in message, message


def test_cpu_capture_check_cannot_see_the_cpu_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the dry run exists: on a CPU engine the planted constant is an ordinary operand."""
    _plant(monkeypatch, _cpu_constant)
    engine = StepEngine(torch.randn(256, 32), EngineConfig(device="cpu", max_num_reqs=2, sampler_variants=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.capture()


def test_main_exits_nonzero_naming_the_op(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _plant(monkeypatch, _cpu_constant)
    argv = ["--hidden", "64", "--vocab", "2048", "--max-num-reqs", "2", "--drafts", "1", "--tiny-model",
            "--kernels", "torch"]  # the torch-op sampler, where the hazard is planted
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("FAILED: StepEngine: aten.maximum.default reads a CPU tensor in a device op"), err
