"""Calibrating the cost model (`profiling.cost_model`) on a GPU: a captured graph's replay
timed by CUDA events, and the modelled times set against the measured ones
(`python -m profiling.cuda_dry_run --real-cuda --cost`, docs/cost-model.md)."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from profiling.cost_model import BANDWIDTH_TBS, NODE_US, SM_BANDWIDTH_GBS, SMS, GraphCost


def calibration(costs: Sequence[GraphCost], node_us: float = NODE_US, bandwidth_tbs: float = BANDWIDTH_TBS,
                sms: int = SMS, sm_bandwidth_gbs: float = SM_BANDWIDTH_GBS) -> dict[str, float] | None:
    """From the graphs with a measured replay: the median, min and max of measured / modelled,
    and a least-squares fit measured ≈ kernels * node_us + bytes / bandwidth (one line through
    every graph: a rough calibration, since the model takes a max per kernel). None: no graph
    was timed."""
    timed = [c for c in costs if c.measured_us is not None]
    if not timed:
        return None
    ratios = sorted(c.measured_us / c.modelled_us(node_us, bandwidth_tbs, sms, sm_bandwidth_gbs) for c in timed)
    out = {"graphs_timed": len(timed), "median_ratio": ratios[len(ratios) // 2], "min_ratio": ratios[0],
           "max_ratio": ratios[-1]}
    if len(timed) >= 2:
        terms = np.array([[len(c.kernels), c.bytes / 1e6] for c in timed], dtype=np.float64)  # kernels, MB
        measured = np.array([c.measured_us for c in timed], dtype=np.float64)
        (per_kernel, per_mb), *_ = np.linalg.lstsq(terms, measured, rcond=None)
        out["fit_node_us"] = float(per_kernel)
        if per_mb > 0:
            out["fit_bandwidth_tbs"] = float(1.0 / per_mb)  # MB per µs = TB/s
    return out


def calibration_lines(calibrated: dict[str, float] | None) -> Iterator[str]:
    if calibrated is None:
        return
    yield (f"measured / modelled over {calibrated['graphs_timed']} graphs: median {calibrated['median_ratio']:.2f}x "
           f"(min {calibrated['min_ratio']:.2f}x, max {calibrated['max_ratio']:.2f}x)")
    if "fit_node_us" in calibrated:
        bandwidth = calibrated.get("fit_bandwidth_tbs")
        yield (f"least-squares fit: measured us = kernels x {calibrated['fit_node_us']:.2f} us + bytes / "
               + (f"{bandwidth:.2f} TB/s" if bandwidth else "(no positive bandwidth term)"))


def replay_us(replayer: Any, bucket: int, replays: int, runs: int = 3) -> float:
    """A captured CUDA graph's replay time in µs: the median over `runs` runs of
    `replays` back-to-back replays, timed by CUDA events (after 3 warm replays)."""
    for _ in range(3):
        replayer.replay(bucket)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            replayer.replay(bucket)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)  # ms -> µs per replay
    return sorted(times)[len(times) // 2]
