"""How many CPU threads torch runs on: a default that holds on a busy machine.

torch's own default is one thread per core. Its OpenMP threads meet at a barrier
after every parallel op, so when another process keeps one of those cores busy,
every op waits for the descheduled thread's next time slice: SmolLM2's demo on a
2-core AMD EPYC ran 28 tokens/s at 2 threads beside one busy loop, against 63 at
1 thread (and 6 against 62 at a load of 3), while on the quiet machine 2 threads
gave 82-85 and 1 thread 65.

So the default takes the cores this process may run on (`os.sched_getaffinity`)
less the tasks of other processes the kernel has runnable right now (the first
number of /proc/loadavg's fourth field, which counts every runnable thread,
less this process's own runnable threads), at least one thread. It samples that
count `SAMPLES` times, `SAMPLE_GAP_S` apart, and takes the median: a busy loop
is runnable at every sample, a short-lived command at few. The 1-minute load
average is the fallback where /proc is missing; it lags a busy process by a
minute, so it is not the first choice.

The count is chosen once, when a model and its engine are built, never changed
mid-run: the batch-invariance probes (`engine.invariance`) hold for the thread
count they ran at. A run that starts on a quiet machine keeps its threads when a
busy process arrives later; pass a count (`LLM(threads=1)`, `--threads 1`) for
such a machine. `OMP_NUM_THREADS`, when set, is taken as the user's count.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SAMPLES = 5  # runnable-task counts per choice (their median decides)
SAMPLE_GAP_S = 0.01  # between two counts: the choice costs about 40 ms


@dataclass(frozen=True)
class ThreadChoice:
    """The torch thread count a run uses and why, in words for a user."""

    count: int
    reason: str


def check_threads(threads: object, name: str = "threads") -> None:
    """ValueError naming `name` unless `threads` is None or an int >= 1."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"{name}={threads!r}: must be an int >= 1 (torch CPU threads) or None (chosen from the "
                         "cores and the load, engine.cpu_threads)")


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _own_runnable_threads() -> int:
    """This process's threads in state R (an OpenMP worker still spinning counts here, not as
    another process's load)."""
    count = 0
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            # The state follows the parenthesised command name, which may itself hold spaces.
            if stat.read_text().rpartition(")")[2].split()[0] == "R":
                count += 1
        except (OSError, IndexError):
            continue
    return count


def busy_elsewhere() -> tuple[float, str]:
    """How many cores other processes keep busy now, and where the figure comes from."""
    loadavg = Path("/proc/loadavg")
    try:
        counts = []
        for i in range(SAMPLES):
            if i:
                time.sleep(SAMPLE_GAP_S)
            runnable = int(loadavg.read_text().split()[3].split("/")[0])
            counts.append(max(0, runnable - _own_runnable_threads()))
        return statistics.median(counts), "runnable tasks of other processes"
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0], "1-minute load average"
        except OSError:
            return 0.0, "no load figure on this system"


def choose_threads(requested: int | None = None) -> ThreadChoice:
    """The thread count for a run: `requested` when given, else `OMP_NUM_THREADS` when set,
    else the usable cores less those other processes keep busy (at least one)."""
    check_threads(requested)
    if requested is not None:
        return ThreadChoice(requested, "as asked")
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) >= 1:
        return ThreadChoice(int(env), "OMP_NUM_THREADS")
    cores = usable_cores()
    busy, source = busy_elsewhere()
    count = max(1, min(cores, cores - round(busy)))
    return ThreadChoice(count, f"{cores} core{'s' if cores != 1 else ''}, {busy:g} busy with other work ({source})")


def use_threads(requested: int | None = None) -> ThreadChoice:
    """`choose_threads`, applied to torch (`torch.set_num_threads`); returns the choice."""
    choice = choose_threads(requested)
    torch.set_num_threads(choice.count)
    return choice
