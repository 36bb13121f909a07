"""Dispatch `python -m profiling.bench NAME ...` to profiling/bench/NAME.py."""
from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings

# torch.cuda imports pynvml and warns about the package name; the dependency is deliberate.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)

import profiling.bench as _pkg

# Run by name only: the peer bench needs its own venv (`make peer-venv`) and minutes.
NOT_IN_ALL = {"peer"}


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__) if not m.name.startswith("_"))


def _take_threads(argv: list[str]) -> list[str]:
    """`--threads N` anywhere: set torch's CPU threads for every benchmark.
    On a busy 2-core machine one thread avoids OpenMP threads fighting other
    processes, which slows small ops by an order of magnitude."""
    if "--threads" not in argv:
        return argv
    i = argv.index("--threads")
    import torch

    torch.set_num_threads(int(argv[i + 1]))
    return argv[:i] + argv[i + 2 :]


def main(argv: list[str]) -> int:
    argv = _take_threads(argv)
    # Process-wide, so both sides of a side-by-side bench run with it (vLLM's CPU backend asks
    # for tcmalloc, which also keeps freed blocks): the allocator LLM uses on a CPU.
    from engine.cpu_memory import keep_freed_memory

    keep_freed_memory()
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m profiling.bench {{{','.join(names + ['all'])}}} [--threads N] [options]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "all":
        print(f"all: every benchmark but {', '.join(sorted(NOT_IN_ALL))} (run those by name)")
        return max((importlib.import_module(f"profiling.bench.{n}").main(rest) for n in names if n not in NOT_IN_ALL),
                   default=0)
    if name not in names:
        print(f"unknown benchmark {name!r}; choose one of: {', '.join(names)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"profiling.bench.{name}").main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
