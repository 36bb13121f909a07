"""NVML telemetry sampled in a background thread: utilisation, memory, SM clock, power.

On a machine without an NVIDIA driver `Telemetry.start()` records a one-line
notice instead and the summary says so; nothing else changes.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field


@dataclass
class TelemetrySummary:
    notice: str | None = None  # set when there is nothing to report
    samples: int = 0
    gpu_util_pct: float = 0.0  # mean
    memory_used_mib: float = 0.0  # peak
    sm_clock_mhz: float = 0.0  # mean
    power_w: float = 0.0  # mean

    def as_dict(self) -> dict[str, object]:
        """The fields by name, numbers as numbers (the demo's `--json`)."""
        return dataclasses.asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        if self.notice:
            return [("GPU telemetry", self.notice)]
        return [
            ("GPU utilisation (mean)", f"{self.gpu_util_pct:.0f} %"),
            ("GPU memory used (peak)", f"{self.memory_used_mib:,.0f} MiB"),
            ("SM clock (mean)", f"{self.sm_clock_mhz:,.0f} MHz"),
            ("power (mean)", f"{self.power_w:.0f} W"),
            ("NVML samples", str(self.samples)),
        ]


@dataclass
class Telemetry:
    device_index: int = 0
    interval_s: float = 0.05
    _samples: list[tuple[float, float, float, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _notice: str | None = None

    def start(self) -> Telemetry:
        try:
            import pynvml  # the module of the nvidia-ml-py package

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except Exception as err:  # no driver, no library, no device: all mean "nothing to sample"
            self._notice = f"no NVIDIA driver ({type(err).__name__}): telemetry off"
            return self

        def sample() -> None:
            while not self._stop.is_set():
                try:
                    util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                    mem = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
                    clock = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
                    power = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000
                except Exception:  # a query the device does not support: stop sampling
                    return
                self._samples.append((util, mem, clock, power))
                time.sleep(self.interval_s)

        self._thread = threading.Thread(target=sample, name="nvml-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> TelemetrySummary:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        if self._notice:
            return TelemetrySummary(notice=self._notice)
        if not self._samples:
            return TelemetrySummary(notice="no samples (run too short)")
        n = len(self._samples)
        return TelemetrySummary(
            samples=n,
            gpu_util_pct=sum(s[0] for s in self._samples) / n,
            memory_used_mib=max(s[1] for s in self._samples),
            sm_clock_mhz=sum(s[2] for s in self._samples) / n,
            power_w=sum(s[3] for s in self._samples) / n,
        )
