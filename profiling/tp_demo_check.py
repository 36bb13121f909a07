"""The demo on one process against the demo on `--tp` ranks under torchrun: the same completions.

    python -m profiling.tp_demo_check                       # gloo on CPU, 2 ranks, the tiny model
    python -m profiling.tp_demo_check --device cuda --tp 2  # NCCL, one GPU per rank (gpu_check.sh)

Both runs are subprocesses with a time limit; torchrun's rendezvous and gloo's connections
stay on 127.0.0.1. Prints each run's wall time and whether every completion (tokens, text,
logprobs, seed) is identical; exits 1 when one differs or a run fails.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from engine.parallel.launch import TORCHRUN_ENV

ROOT = Path(__file__).resolve().parents[1]


def demo_args(device: str) -> list[str]:
    """A short demo workload on the tiny random model (no weights to carry), as JSON."""
    return ["--model", "tiny", "--requests", "4", "--max-tokens", "8", "--max-num-reqs", "2", "--json",
            "--device", device, "--threads", "1"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for torchrun's --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> dict[str, str]:
    """This environment without torchrun's rank variables, the repository on PYTHONPATH, gloo on loopback."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's connections on the loopback interface only
    return env


def torchrun(tp: int, *args: str) -> list[str]:
    """The command that starts `tp` ranks of `args` (a script, or -m module) on this machine, rendezvous on 127.0.0.1."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), *args]


def run_demo(device: str, tp: int, limit_s: float) -> tuple[dict, float]:
    """The demo's JSON (rank 0's under torchrun) and the run's wall time in seconds.
    **Raises** RuntimeError with the run's stderr tail when it fails; TimeoutExpired past `limit_s`."""
    command = [sys.executable, "-m", "engine", "demo", *demo_args(device)]
    if tp > 1:
        command = torchrun(tp, "-m", "engine", "demo", "--tp", str(tp), *demo_args(device))
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=limit_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.tp_demo_check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--limit-s", type=float, default=240.0, help="per run")
    args = parser.parse_args(argv)
    if args.tp < 2:
        parser.error(f"--tp {args.tp}: must be >= 2")
    one, one_s = run_demo(args.device, 1, args.limit_s)
    many, many_s = run_demo(args.device, args.tp, args.limit_s)
    completions = one["completions"]
    differ = [i for i, (a, b) in enumerate(zip(completions, many["completions"])) if a != b]
    if len(completions) != len(many["completions"]):
        differ.append(min(len(completions), len(many["completions"])))
    print(f"one process: {one_s:.1f} s; tp={args.tp} under torchrun on {args.device}: {many_s:.1f} s")
    if not completions or not any(c["tokens"] for c in completions):
        print("NOTHING TO COMPARE: the demo generated no tokens")
        return 1
    print(f"{len(completions)} completions, every one identical" if not differ else f"DIFFERENT: completions {differ}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
