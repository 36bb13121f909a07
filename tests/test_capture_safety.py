"""The capture-safety check: each planted hazard is rejected with a message
naming the op, a realistic safe step passes unchanged, and static buffers
that move are caught."""
from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

from graphs.capture_safety import (
    CaptureSafetyError,
    capture_safety_check,
    check_addresses,
    record_addresses,
)

ROWS, VOCAB = 8, 32


def make_static() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "logits": torch.randn(ROWS, VOCAB, generator=gen),
        "row_index": torch.randperm(ROWS, generator=gen),
        "temperature": torch.rand(ROWS, generator=gen) + 0.5,
        "tokens": torch.zeros(ROWS, dtype=torch.int64),
        "logprobs": torch.zeros(ROWS),
    }


# Each hazard: (name, step, substring the error must contain).
HAZARDS: list[tuple[str, Callable[[dict[str, torch.Tensor]], object], str]] = [
    ("item", lambda s: s["temperature"][0].item(), "Tensor.item()"),
    ("tolist", lambda s: s["row_index"].tolist(), "Tensor.tolist()"),
    ("numpy", lambda s: s["logits"].numpy(), "Tensor.numpy()"),
    ("np.asarray", lambda s: np.asarray(s["logits"]), "numpy.asarray(tensor)"),
    ("cpu", lambda s: s["tokens"].cpu(), "Tensor.cpu()"),
    ("if tensor", lambda s: 1 if s["temperature"][0] > 1 else 0, "bool(tensor)"),
    ("int()", lambda s: int(s["row_index"][0]), "int(tensor)"),
    ("python index", lambda s: [0, 1, 2][s["row_index"][0]], "Python index"),
    ("print", lambda s: print(s["logits"]), "repr/str/print"),
    ("torch.tensor", lambda s: torch.tensor([1.0, 2.0]), "torch.tensor(host data)"),
    ("bool mask index", lambda s: s["logits"][s["logits"] > 0], "aten.index.Tensor with a boolean-mask"),
    ("bool mask assign", lambda s: s["logits"].__setitem__(s["logits"] > 0, 0.0), "aten.index_put_"),
    ("nonzero", lambda s: torch.nonzero(s["logits"]), "aten.nonzero"),
    ("where(cond)", lambda s: torch.where(s["logits"] > 0), "aten.nonzero"),
    ("masked_select", lambda s: s["logits"].masked_select(s["logits"] > 0), "aten.masked_select"),
    ("unique", lambda s: torch.unique(s["row_index"]), "aten._unique2"),
    ("bincount", lambda s: torch.bincount(s["row_index"]), "aten.bincount"),
    ("repeat_interleave", lambda s: torch.repeat_interleave(s["row_index"], s["row_index"]), "output_size"),
    ("equal", lambda s: torch.equal(s["logits"], s["logits"]), "aten.equal"),
    ("aten host read", lambda s: torch.ops.aten._local_scalar_dense(s["row_index"][0]), "aten._local_scalar_dense"),
    ("rand", lambda s: torch.rand(ROWS), "aten.rand"),
    ("randn", lambda s: torch.randn(ROWS), "aten.randn"),
    ("randint", lambda s: torch.randint(0, VOCAB, (ROWS,)), "aten.randint"),
    ("randperm", lambda s: torch.randperm(ROWS), "aten.randperm"),
    ("multinomial", lambda s: torch.multinomial(s["logits"].softmax(-1), 1), "aten.multinomial"),
    ("bernoulli", lambda s: torch.bernoulli(s["temperature"] / 2), "aten.bernoulli"),
    ("normal", lambda s: torch.normal(s["logits"], 1.0), "aten.normal"),
    ("uniform_", lambda s: torch.empty(ROWS).uniform_(), "aten.uniform_"),
    ("exponential_", lambda s: torch.empty_like(s["logits"]).exponential_(), "aten.exponential_"),
    ("dropout", lambda s: torch.nn.functional.dropout(s["logits"], 0.1), "aten.bernoulli_"),
    ("seeded generator", lambda s: torch.rand(ROWS, generator=torch.Generator().manual_seed(1)), "aten.rand"),
]


@pytest.mark.parametrize(("name", "step", "expected"), HAZARDS, ids=[h[0] for h in HAZARDS])
def test_hazard_is_rejected(name: str, step: Callable, expected: str) -> None:
    static = make_static()
    with pytest.raises(CaptureSafetyError) as info:
        with capture_safety_check(static):
            step(static)
    assert expected in str(info.value)


def test_resize_of_static_buffer_is_rejected() -> None:
    static = make_static()
    with pytest.raises(CaptureSafetyError, match=r"aten.resize_.* static buffer 'tokens'"):
        with capture_safety_check(static):
            static["tokens"].resize_(2 * ROWS)


def test_resize_of_a_static_slice_is_rejected() -> None:
    static = make_static()
    with pytest.raises(CaptureSafetyError, match=r"static buffer 'logprobs'"):
        with capture_safety_check(static):
            static["logprobs"][:4].resize_(64)


def test_set_on_static_buffer_is_rejected() -> None:
    static = make_static()
    with pytest.raises(CaptureSafetyError, match=r"aten.set_.* static buffer 'logprobs'"):
        with capture_safety_check(static):
            static["logprobs"].set_(torch.zeros(ROWS))


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_out_write_that_reallocates_a_static_buffer_is_rejected() -> None:
    static = make_static()
    # An out= of the wrong shape makes torch resize (reallocate) the out tensor.
    with pytest.raises(CaptureSafetyError, match=r"aten.argmax.out reallocated static buffer 'tokens'"):
        with capture_safety_check(static):
            torch.argmax(torch.zeros(3 * ROWS, VOCAB), dim=-1, out=static["tokens"])


def test_rebinding_a_static_buffer_is_caught_at_exit() -> None:
    static = make_static()
    with pytest.raises(CaptureSafetyError, match=r"static buffer 'tokens' changed"):
        with capture_safety_check(static):
            static["tokens"] = torch.zeros(ROWS, dtype=torch.int64)


def safe_step(static: dict[str, torch.Tensor], bucket: int) -> None:
    """A realistic sampling tail over leading slices: only capture-safe ops."""
    logits = static["logits"].index_select(0, static["row_index"][:bucket])  # [bucket, vocab]
    logits = logits / static["temperature"][:bucket, None]
    top_values, top_ids = torch.topk(logits, k=4, dim=-1)
    kth = top_values[:, -1:]
    logits = torch.where(logits >= kth, logits, torch.full_like(logits, float("-inf")))
    logits = logits.masked_fill(logits > 50, 50.0).clamp(min=-1e4)
    logprobs = torch.log_softmax(logits, dim=-1)
    cdf = torch.cumsum(logprobs.exp(), dim=-1)
    sorted_values, _ = torch.sort(cdf, dim=-1)
    threshold = torch.full((bucket, 1), 0.5)
    first_above = torch.searchsorted(sorted_values.contiguous(), threshold)
    mask = torch.zeros_like(logits).scatter_(1, top_ids, 1.0)
    picked = torch.gather(logprobs, 1, top_ids[:, :1]) + 0.0 * first_above + 0.0 * mask.sum(-1, keepdim=True)
    torch.argmax(logprobs, dim=-1, out=static["tokens"][:bucket])
    torch.add(picked.squeeze(1), 0.0, out=static["logprobs"][:bucket])
    torch.nonzero_static(static["tokens"][:bucket], size=bucket)
    torch.nn.functional.dropout(logits, 0.5, training=False)
    torch.native_dropout(logits, 0.5, False)
    torch.as_tensor(logits)


@pytest.mark.parametrize("bucket", [1, 3, ROWS])
def test_realistic_safe_step_passes_and_is_unchanged(bucket: int) -> None:
    checked = make_static()
    plain = make_static()
    with capture_safety_check(checked):
        safe_step(checked, bucket)
    safe_step(plain, bucket)
    for name in plain:
        assert torch.equal(checked[name], plain[name]), name
    # Scratch tensors may be resized freely; only static buffers are pinned.
    with capture_safety_check(checked):
        torch.empty(0).resize_(16)
        torch.add(checked["logprobs"], 1.0, out=torch.empty(0))


def test_modes_are_removed_after_an_error() -> None:
    static = make_static()
    with pytest.raises(CaptureSafetyError):
        with capture_safety_check(static):
            static["tokens"][0].item()
    assert static["tokens"][0].item() == 0
    assert torch.nonzero(static["tokens"]).shape == (0, 1)


def test_check_addresses() -> None:
    static = make_static()
    recorded = record_addresses(static)
    check_addresses(static, recorded)
    static["logprobs"].zero_()  # contents may change, the address may not
    check_addresses(static, recorded)

    moved = dict(static, logprobs=static["logprobs"].clone())
    with pytest.raises(CaptureSafetyError, match="'logprobs' changed"):
        check_addresses(moved, recorded)
    reshaped = dict(static, logits=static["logits"].view(VOCAB, ROWS))
    with pytest.raises(CaptureSafetyError, match="'logits' changed"):
        check_addresses(reshaped, recorded)
    restrided = dict(static, logits=static["logits"].t())
    with pytest.raises(CaptureSafetyError, match="'logits' changed"):
        check_addresses(restrided, recorded)
    with pytest.raises(CaptureSafetyError, match="static buffer set changed"):
        check_addresses({k: v for k, v in static.items() if k != "tokens"}, recorded)


# -- the CUDA rules, on the fake CUDA device of the dry run ---------------------------------


@pytest.fixture
def cuda():
    """Device buffers on a fake CUDA device (no GPU), host tensors real, one pinned."""
    from profiling.fake_cuda import FakeCuda

    with FakeCuda() as fake:
        static = {
            "logits": torch.zeros(ROWS, VOCAB, device="cuda"),
            "tokens": torch.zeros(ROWS, dtype=torch.int64, device="cuda"),
            "logprobs": torch.zeros(ROWS, device="cuda"),
        }
        host = {
            "vector": torch.ones(VOCAB),
            "scalar": torch.tensor(2.0),
            "pageable": torch.zeros(ROWS),
            "pinned": torch.zeros(ROWS, pin_memory=True),
        }
        yield fake, static, host


# Each: (name, step(static, host), substring the error must contain).
CUDA_HAZARDS: list[tuple[str, Callable, str]] = [
    ("cpu vector operand", lambda s, h: s["logits"] * h["vector"], "aten.mul.Tensor reads a CPU tensor in a device op"),
    ("cpu 0-dim operand", lambda s, h: s["logits"] * h["scalar"], "aten.mul.Tensor reads a CPU tensor in a device op"),
    ("cpu index", lambda s, h: s["logits"].index_select(0, torch.as_tensor(np.arange(2))), "torch.as_tensor(host data)"),
    ("pageable copy_", lambda s, h: s["logprobs"].copy_(h["pageable"]), "aten.copy_.default copies host memory to the device from pageable"),
    ("blocking pinned copy_", lambda s, h: s["logprobs"].copy_(h["pinned"]), "from pageable memory or blocking"),
    ("pageable .to(cuda)", lambda s, h: h["pageable"].to("cuda", non_blocking=True), "aten._to_copy.default copies host memory"),
    ("device constant", lambda s, h: s["logits"] + torch.tensor(-math.inf, device="cuda"), "torch.tensor(host data)"),
    ("host factory", lambda s, h: torch.arange(ROWS), "aten.arange.default produces a tensor on the host"),
    ("host op", lambda s, h: h["pageable"] + 1, "aten.add.Tensor produces a tensor on the host"),
    ("blocking device-to-host copy", lambda s, h: h["pageable"].copy_(s["logprobs"]), "aten.copy_.default reads tensor data on the host"),
    ("unpinned async device-to-host copy", lambda s, h: h["pageable"].copy_(s["logprobs"], non_blocking=True), "reads tensor data on the host"),
    ("cpu()", lambda s, h: s["tokens"].cpu(), "Tensor.cpu()"),
    ("item", lambda s, h: s["logprobs"].sum().item(), "Tensor.item()"),
]


@pytest.mark.parametrize(("name", "step", "expected"), CUDA_HAZARDS, ids=[h[0] for h in CUDA_HAZARDS])
def test_cuda_hazard_is_rejected(cuda, name: str, step: Callable, expected: str) -> None:
    fake, static, host = cuda
    with pytest.raises(CaptureSafetyError) as info:
        with capture_safety_check(static, is_pinned=fake.is_pinned):
            step(static, host)
    assert expected in str(info.value)


def test_cuda_safe_step_passes_and_counts_its_ops(cuda) -> None:
    fake, static, host = cuda
    with capture_safety_check(static, is_pinned=fake.is_pinned) as stats:
        static["logprobs"].copy_(host["pinned"], non_blocking=True)  # pinned, asynchronous: capturable
        top = torch.topk(static["logits"] * 0.5 + static["logprobs"][:, None], 4).indices
        ids = torch.arange(VOCAB, device=static["logits"].device)
        torch.amax(torch.where(static["logits"] > 0, ids, -1), -1, out=static["tokens"])
        static["tokens"][: ROWS // 2] = top[: ROWS // 2, 0]
        static["logprobs"].masked_fill_(static["tokens"] < 0, -math.inf)
        host["pinned"].copy_(static["logprobs"], non_blocking=True)  # into pinned memory: capturable
    assert stats.ops >= 10 and stats.op_counts["aten.topk.default"] == 1


def test_cuda_checks_static_addresses_of_fake_buffers(cuda) -> None:
    fake, static, host = cuda
    with pytest.raises(CaptureSafetyError, match=r"aten.resize_.* static buffer 'tokens'"):
        with capture_safety_check(static, is_pinned=fake.is_pinned):
            static["tokens"][:4].resize_(64)
    with pytest.raises(CaptureSafetyError, match=r"static buffer 'logits' changed"):
        with capture_safety_check(static, is_pinned=fake.is_pinned):
            static["logits"] = torch.zeros(ROWS, VOCAB, device="cuda")


def test_host_work_allows_host_planning_not_waiting_for_the_device(cuda) -> None:
    """The eager-step variant (a model forward): host-only work passes, host waits do not."""
    fake, static, host = cuda
    with capture_safety_check(static, is_pinned=fake.is_pinned, host_work=True):
        index = torch.as_tensor(np.arange(3)) + 1  # host planning
        assert index.tolist() == [1, 2, 3]
        index = index.pin_memory().to("cuda", non_blocking=True)
        static["logits"].index_select(0, index)
    for step, expected in (
        (lambda: static["logprobs"].copy_(host["pageable"]), "from pageable memory"),
        (lambda: static["logprobs"].sum().item(), "Tensor.item()"),
        (lambda: static["logits"] * host["vector"], "reads a CPU tensor in a device op"),
    ):
        with pytest.raises(CaptureSafetyError, match=re.escape(expected)):
            with capture_safety_check(static, is_pinned=fake.is_pinned, host_work=True):
                step()
