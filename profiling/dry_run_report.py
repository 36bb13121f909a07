"""What the CUDA dry run (profiling/cuda_dry_run.py) found: the ops checked per captured graph,
the steps run and the host waits they made outside their graphs (device-to-host reads,
pageable copies, on a GPU flagged syncs) by call site, the bar the graph steps must meet,
and the failure that names a violation's scenario and call site."""
from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

from graphs.capture_safety import CaptureSafetyError
from graphs.replay import CaptureReport
from profiling.cost_model import GraphCost
from profiling.fake_cuda import project_path


@dataclass
class HostTraffic:
    """Engine steps and the host waits they made outside their graphs."""

    steps: int = 0
    d2h_reads: int = 0  # the fake device's count
    pageable_h2d: int = 0  # the fake device's count
    h2d_copies: int = 0  # the fake device's count: every host-to-device copy, pinned ones too
    syncs: int = 0  # on a GPU: the calls torch.cuda.set_sync_debug_mode flags as synchronizing

    def as_dict(self) -> dict[str, int]:
        return {"steps": self.steps, "d2h_reads": self.d2h_reads, "pageable_h2d": self.pageable_h2d,
                "h2d_copies": self.h2d_copies}


@dataclass
class DryRunReport:
    """What the dry run checked: ops per bucket of every captured graph, steps run,
    and the host waits (device-to-host reads, pageable copies) of those steps outside
    their graphs."""

    graphs: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)  # set -> ((bucket, ops), ...)
    steps: Counter[str] = field(default_factory=Counter)  # scenario -> steps run
    host_reads: Counter[str] = field(default_factory=Counter)  # call site -> reads
    pageable_copies: Counter[str] = field(default_factory=Counter)  # call site -> copies
    h2d_copies: Counter[str] = field(default_factory=Counter)  # call site -> every host-to-device copy
    cuda_syncs: Counter[str] = field(default_factory=Counter)  # on a GPU: call site -> flagged syncs
    costs: list[GraphCost] = field(default_factory=list)  # a cost run: one per graph (and row mix) and bucket
    seconds: float = 0.0
    # The host traffic of the steps the graphs serve (one replay: within the largest bucket, no
    # prompt logprobs), where the bar is one copy each way, and of the other engine steps, apart.
    graph_steps: HostTraffic = field(default_factory=lambda: HostTraffic())
    other_steps: HostTraffic = field(default_factory=lambda: HostTraffic())

    def host_summary(self) -> dict[str, int | dict[str, int]]:
        """The JSON's "host": the graph steps' counts, and the other engine steps' under "other"."""
        return {**self.graph_steps.as_dict(), "other": self.other_steps.as_dict()}

    def host_bar(self) -> str | None:
        """What breaks the bar of the graph steps (one device-to-host read a step at most, no
        pageable copy, on a GPU no flagged sync), or None."""
        g = self.graph_steps
        if g.d2h_reads > g.steps or g.pageable_h2d or g.syncs:
            return (f"graph steps: {g.steps} steps made {g.d2h_reads} device-to-host reads, {g.pageable_h2d} "
                    f"pageable copies, {g.syncs} flagged syncs (bar: at most one read a step, no other)")
        return None

    def add_capture(self, name: str, report: CaptureReport) -> None:
        self.graphs[name] = tuple(zip(report.buckets, report.ops_checked))

    def lines(self) -> Iterator[str]:
        yield "ops checked per bucket under the CUDA rules (graphs: capture; the model: its eager decode step):"
        for name, buckets in self.graphs.items():
            yield f"  {name:<28} " + "  ".join(f"{bucket}:{ops}" for bucket, ops in sorted(buckets))
        yield "steps run: " + ", ".join(f"{name} {count}" for name, count in self.steps.items())
        total = sum(self.host_reads.values())
        yield f"device-to-host reads outside the graphs ({total} in all; legal, each one a host sync):"
        for site, count in sorted(self.host_reads.items()):
            yield f"  {count:4d}  {site}"
        total = sum(self.pageable_copies.values())
        yield f"pageable host-to-device copies outside the graphs ({total} in all; each one a host wait):"
        for site, count in sorted(self.pageable_copies.items()):
            yield f"  {count:4d}  {site}"
        total = sum(self.h2d_copies.values())
        yield f"host-to-device copies outside the graphs, pinned ones too ({total} in all):"
        for site, count in sorted(self.h2d_copies.items()):
            yield f"  {count:4d}  {site}"
        if self.cuda_syncs:
            yield f"synchronizing calls CUDA's sync debug mode flagged in the steps ({sum(self.cuda_syncs.values())}):"
            for site, count in sorted(self.cuda_syncs.items()):
                yield f"  {count:4d}  {site}"
        for label, traffic in (("graph steps", self.graph_steps), ("other steps", self.other_steps)):
            yield (f"{label}: {traffic.steps}, device-to-host reads {traffic.d2h_reads}, "
                   f"pageable host-to-device copies {traffic.pageable_h2d} (of {traffic.h2d_copies}), "
                   f"flagged syncs {traffic.syncs}")
        yield f"dry run passed in {self.seconds:.1f} s"


class DryRunFailure(RuntimeError):
    """A capture-safety violation or a host tensor in a device op, with its call site."""


def _call_site(err: BaseException) -> str:
    """The innermost frame of this project's code in the error's traceback."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if "/torch/" not in f.filename and not f.filename.endswith(("capture_safety.py", "fake_cuda.py"))]
    if not frames:
        return "unknown"
    f = frames[-1]
    return f"{project_path(f.filename)}:{f.lineno} ({f.line})"


@contextmanager
def failures_named(name: str) -> Iterator[None]:
    """Re-raise a capture-safety violation or a device mismatch in scenario `name` as a
    DryRunFailure that names the scenario and the call site."""
    try:
        yield
    except CaptureSafetyError as err:
        raise DryRunFailure(f"{name}: {err}\n  at {_call_site(err)}") from err
    except FakeTensorDeviceMismatchError as err:
        # Outside the graphs too: a host tensor in a device op is an error on CUDA.
        raise DryRunFailure(f"{name}: {err.func} {err}\n  at {_call_site(err)}") from err
