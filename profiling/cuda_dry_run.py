"""The CUDA path, run without a GPU: capture and steps on a fake CUDA device.

    python -m profiling.cuda_dry_run                      # H=7168, V=129280, bf16
    python -m profiling.cuda_dry_run --hidden 256 --vocab 4096 --max-num-reqs 8

Every object is built with device="cuda" inside `profiling.fake_cuda.FakeCuda`
(tensors with shapes and no memory, so the full-size LM head costs nothing),
and every replayer inside `graphs.replay.simulated_cuda_capture`: "capture"
runs each bucket's step once under the capture-safety check with its CUDA
rules (no host sync, no CPU tensor in a device op, no pageable host-to-device
copy, every output on the device, static addresses stable), since
torch.cuda.graph itself cannot run here. Then each scenario runs a few whole
steps (ledger, staging copy, replay, collection); host reads of device values
see zeros and are counted per call site.

Scenarios: the StepEngine (the source-copy path,
prompt logprobs, an eager fallback), drafts verified in strict and rejection
mode (also with penalties, logit bias and allowed tokens), one rank's step of the vocab-sharded engine (a fake process group):
the single-device heads over a shard with the logits exchange (`shard heads`, also with
drafts verified by rejection), and
the batch-invariant Llama model's decode step, checked under the same rules
with its KV cache as the static buffers.

The model's decode step is eager (its shapes follow the batch), so it runs
under the check's host_work variant: planning on the host is allowed, making
the host wait for the device is not.

Prints the ops checked per bucket, then the device-to-host reads and pageable
host-to-device copies the steps made outside their graphs (legal, but each one
a host wait), by call site, and their totals for the graph steps (the engine
steps within the largest bucket without prompt logprobs: the bar is one packed
copy each way, so at most one read a step and no pageable copy) apart from the
other engine steps. Exits 1 naming the op, the reason and the call site on a
violation, also for a host tensor in a device op outside the graphs, and when
the graph steps miss that bar. With --real-cuda the steps run under CUDA's
sync debug mode instead, and a graph step's flagged sync misses the bar.
`--real-cuda` is the twin on a GPU: the same scenarios with real graph capture,
whose first warm-up per bucket runs under the same check (graphs/replay.py);
profiling/gpu_check.sh runs it.

    python -m profiling.cuda_dry_run --cost               # the cost model, a table
    python -m profiling.cuda_dry_run --cost --json        # one JSON object
    python -m profiling.cuda_dry_run --cost --cost-detail --buckets 64

`--cost` runs the kernel-level cost model (profiling/cost_model.py,
docs/cost-model.md) instead of the checks: the same scenarios' engines, each
engine's step run once per bucket under a kernel counter, no steps. It prints per graph the kernels, their
bytes, how many times the step reads the LM-head weight, a modelled H200 replay
time and the floor. Occupancy is counted: the fake device has `--sms` SMs, and
every Triton launch's grid is read where its launcher makes it (a kernel of few
programs streams at `--sm-bandwidth-gbs` per SM, not at the HBM's bandwidth). With
--real-cuda each of those graphs is also captured and its replay timed beside the
model (gpu_check.sh). On the fake device the cost run also runs the scenarios' steps
(uncaptured), and its JSON carries their host counts: "host": {"steps", "d2h_reads",
"pageable_h2d", "other": {...}}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from engine.models.llama import LlamaModel
from engine.models.llama_weights import LayerWeights, LlamaConfig, LlamaWeights
from engine.models.protocol import ForwardBatch
from engine.host.params import SamplingParams
from engine.parallel.shard_heads import sharded_head, vocab_shards
from engine.step.engine_config import EngineConfig
from engine.step.kernel_head import KERNELS
from engine.step.step_engine import StepEngine
from graphs.capture_safety import capture_safety_check
from graphs.replay import BucketTable, GraphReplayer, simulated_cuda_capture
from profiling.cost_calibration import calibration, calibration_lines, replay_us
from profiling.cost_model import BANDWIDTH_TBS, NODE_US, SM_BANDWIDTH_GBS, SMS, GraphCost, KernelCounter, table_lines
from profiling.dry_run_report import DryRunFailure, DryRunReport, HostTraffic, failures_named
from profiling.dry_run_requests import controlled_params, masked_step, mixed_params, scenario_requests
from profiling.fake_cuda import FakeCuda, project_path


# The kernel head's one graph serves every kind of row; what its kernels move depends on
# the rows (engine/sampling/kernels/sample_kernel.py: passes over a row by row kind, raw logprobs
# always computed; the controls kernel skips a row without controls). The cost run prices
# the graph once per row mix: (name, passes of engine::sample_rows, of engine::apply_controls).
# engine::sample_rows reads its `logits` operand once by the operand rule; its passes over
# `scores` are the row reads beyond that one: 4 with top-k, top-p and raw logprobs (kept lists
# that fit: tests/test_kernel_passes.py), 3 plain, 2 greedy (a row without controls reads its
# logits as its scores); with controls the controls kernel hands over pass 1 and the raw
# masses (`PassOne`, the LM head keying each row's maximum): the three radix passes read the
# scores, and the logits are not read where the token is on the raw top-N (scores 3, logits 0).
ROW_MIXES = {
    "engine": (("full sampler", 3, 0), ("plain", 2, 0), ("greedy", 1, 0)),
    "drafts": (("full sampler", 3, 0), ("greedy", 1, 0), ("controls", (3, 0), 1)),
}


@dataclass(frozen=True)
class DryRunConfig:
    hidden: int = 7168
    vocab: int = 129280
    dtype: torch.dtype = torch.bfloat16
    max_num_reqs: int = 64
    max_draft_tokens: int = 3
    tp: int = 2  # ranks of the sharded engine (this process plays rank 0)
    kernels: str = "auto"  # EngineConfig.kernels of the engines: "auto" (on CUDA) runs the Triton kernel head
    sms: int = SMS  # SMs of the fake device: the launchers size their grids by them
    model: LlamaConfig = field(default_factory=lambda: LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, max_position=2048))  # SmolLM2-135M's shape

    def __post_init__(self) -> None:
        for name in ("hidden", "vocab", "max_num_reqs", "tp", "sms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DryRunConfig.{name}={value!r}: must be an int >= 1")
        if self.max_draft_tokens < 1:
            raise ValueError(f"DryRunConfig.max_draft_tokens={self.max_draft_tokens!r}: must be >= 1 (drafts are a scenario)")


@dataclass
class _Run:
    """One dry run's settings and findings; `cuda` is None on a real GPU (the twin).
    `replays` > 0: a cost run, which costs graphs instead of checking them (`graphs`)."""

    cfg: DryRunConfig
    report: DryRunReport
    cuda: FakeCuda | None
    replays: int = 0
    buckets: frozenset[int] | None = None  # a cost run: only these buckets (None: all)

    @property
    def costing(self) -> bool:
        return self.replays > 0

    def graphs(self, scenario: str, engine: StepEngine) -> None:
        """Capture the engine's graphs (one a bucket) under the checks, or in a cost run cost
        them: the kernel head's once per row mix (its kernels branch per row on the device),
        the torch head's once (on CUDA its graph runs every stage for every row)."""
        if not self.costing:
            self.capture(scenario, engine.replayer)
            return
        if engine.head.name != KERNELS:
            self._cost(scenario, engine)
            return
        for mix, sample_passes, control_passes in ROW_MIXES["drafts" if engine.config.max_draft_tokens else "engine"]:
            if not isinstance(sample_passes, int) and not engine.head.raw_max_keyed:
                sample_passes = (sample_passes[0], 1)  # no LM-head row maxima (a shard's): the logprob pass reads the logits
            passes = {"engine.sample_rows.default": sample_passes, "engine.apply_controls.default": control_passes}
            self._cost(scenario, engine, label=f"{KERNELS} ({mix})", passes=passes)

    def _cost(self, scenario: str, engine: StepEngine, label: str | None = None,
              passes: dict[str, int | tuple[int, ...]] | None = None) -> None:
        """Each bucket of the engine's graphs, run once under the kernel counter
        (`profiling.cost_model`); on a real GPU also captured, and each bucket's replay
        timed (the median of `replays`-replay runs)."""
        replayer, weight = engine.replayer, engine.weight  # weight: [V, H] or this rank's shard
        if self.buckets is not None and not self.buckets <= set(replayer.buckets):
            raise ValueError(f"buckets={sorted(self.buckets)}: {sorted(self.buckets - set(replayer.buckets))} "
                             f"not among {scenario}'s buckets {tuple(replayer.buckets)}")
        if self.cuda is None:
            replayer.capture(progress=False)
        for bucket in sorted(self.buckets or replayer.buckets):
            counter = KernelCounter(weights=(weight,), passes=passes,
                                    launches=None if self.cuda is None else self.cuda.launches)
            counts = replayer.counts()
            with counter:
                replayer.run_eager(bucket)
            replayer.restore_counts(counts)
            rows = engine.buffers.rows_for(bucket)
            draft_probs = engine.buffers.draft_probs
            cost = GraphCost(scenario, label or engine.head.name, bucket, rows, weight.shape[0],
                             weight.numel() * weight.element_size(), counter.kernels,
                             draft_probs_bytes=0 if draft_probs is None else rows * draft_probs[0].nbytes)
            if self.cuda is None:
                cost.measured_us = replay_us(replayer, bucket, self.replays)
            self.report.costs.append(cost)

    def weight(self, *shape: int) -> torch.Tensor:
        # Small finite values: on a real GPU uninitialised memory could hold NaN.
        return torch.empty(shape, dtype=self.cfg.dtype, device="cuda").normal_(0.0, 0.02)

    def capture(self, name: str, replayer: GraphReplayer) -> None:
        self.report.add_capture(name, replayer.capture(progress=False))

    @property
    def runs_steps(self) -> bool:
        """Whether the scenarios run their steps: a check run does; a cost run on the fake
        device too, for the host counts (on a GPU its steps are gpu_check's own part)."""
        return not self.costing or self.cuda is not None

    @contextmanager
    def steps(self, name: str, count: int, kind: str | None = "graph") -> Iterator[None]:
        """Count `count` steps of scenario `name` and the host traffic they cause (not
        the one-time copies of construction and capture): on the fake device its reads and
        pageable copies, on a GPU the calls CUDA's sync debug mode flags as synchronizing.
        `kind`: "graph" for engine steps the graphs serve, "other" for engine steps beyond
        them, None for the model's."""
        traffic = HostTraffic(steps=count)
        if self.cuda is not None:
            reads, copies = Counter(self.cuda.host_reads), Counter(self.cuda.pageable_copies)
            uploads = Counter(self.cuda.h2d_copies)
            yield
            new_reads, new_copies = self.cuda.host_reads - reads, self.cuda.pageable_copies - copies
            new_uploads = self.cuda.h2d_copies - uploads
            self.report.host_reads.update(new_reads)
            self.report.pageable_copies.update(new_copies)
            self.report.h2d_copies.update(new_uploads)
            traffic.d2h_reads, traffic.pageable_h2d = sum(new_reads.values()), sum(new_copies.values())
            traffic.h2d_copies = sum(new_uploads.values())
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = Counter(f"{project_path(w.filename)}:{w.lineno}" for w in caught
                            if "synchronizing CUDA operation" in str(w.message))
            self.report.cuda_syncs.update(syncs)
            traffic.syncs = sum(syncs.values())
        self.report.steps[name] += count
        if kind is not None:
            total = self.report.graph_steps if kind == "graph" else self.report.other_steps
            for f in dataclasses.fields(HostTraffic):
                setattr(total, f.name, getattr(total, f.name) + getattr(traffic, f.name))


def _engine(run: _Run) -> None:
    cfg = run.cfg
    engine = StepEngine(run.weight(cfg.vocab, cfg.hidden),
                        EngineConfig(device="cuda", max_num_reqs=cfg.max_num_reqs, eos_token_id=2, kernels=cfg.kernels))
    run.graphs("engine", engine)
    if not run.runs_steps:
        return
    n = min(5, cfg.max_num_reqs)
    greedy = lambda i: SamplingParams(temperature=0.0, seed=i)  # noqa: E731
    with_prompt_logprobs = lambda i: SamplingParams(temperature=0.5, seed=i, prompt_logprobs=True, logprobs=2)  # noqa: E731
    hidden = run.weight(n * 6, cfg.hidden)
    masked = engine.head.applies_token_bitmask
    with run.steps("engine", 4 if masked else 3):
        engine.step(engine.source, scenario_requests(n, params=mixed_params))  # zero-copy source
        engine.step(hidden, scenario_requests(n, decode=True, params=mixed_params))  # rows copied into the source
        engine.step(engine.source, scenario_requests(n, decode=True, params=greedy))  # the greedy graphs
        if masked:  # structured output: a row restricted by the token bitmask (tokens 0-31 only)
            engine.run(engine.source, *masked_step(engine, scenario_requests(n, decode=True, params=mixed_params)))
    with run.steps("engine", 2, kind="other"):
        engine.step(engine.source, scenario_requests(n, prompt=9, params=with_prompt_logprobs))
        engine.step(engine.source, scenario_requests(cfg.max_num_reqs + 1, decode=True))  # above the largest bucket: eager


def _drafts(run: _Run, mode: str) -> None:
    cfg, k = run.cfg, run.cfg.max_draft_tokens
    engine = StepEngine(run.weight(cfg.vocab, cfg.hidden), EngineConfig(
        device="cuda", max_num_reqs=cfg.max_num_reqs, max_draft_tokens=k, verify_mode=mode,
        max_control_slots=cfg.max_num_reqs, max_logit_bias=8, max_allowed_token_ids=64, kernels=cfg.kernels))
    run.graphs(f"drafts {mode}", engine)
    if not run.runs_steps:
        return
    n = min(4, cfg.max_num_reqs)
    drafts = [list(range(10 + i, 10 + i + k)) for i in range(n)]
    draft_logprobs = None
    if mode == "rejection":
        draft_logprobs = [np.full((k, cfg.vocab), -np.log(cfg.vocab), dtype=np.float32)] * n
    with run.steps(f"drafts {mode}", 3):
        engine.step(engine.source, scenario_requests(n, params=mixed_params))
        engine.step(engine.source, scenario_requests(n, decode=True, drafts=k, params=mixed_params), drafts, draft_logprobs,
                    next_drafts=[list(range(20, 20 + k))] * n)
        engine.step(engine.source, scenario_requests(n, decode=True, drafts=k, params=mixed_params))  # drafts from the pool
    # New request ids: the controls join with their prompt, before any generated token.
    renamed = lambda seqs: [dataclasses.replace(s, request_id=f"c{s.request_id}") for s in seqs]  # noqa: E731
    with run.steps(f"drafts {mode} controls", 2):
        engine.step(engine.source, renamed(scenario_requests(n, params=controlled_params)))
        engine.step(engine.source, renamed(scenario_requests(n, decode=True, drafts=k, params=controlled_params)), drafts,
                    draft_logprobs)


@contextmanager
def _fake_process_group(world: int) -> Iterator[None]:
    """A `world`-rank group of which this process is rank 0; its collectives move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded(run: _Run) -> None:
    cfg = run.cfg
    with _fake_process_group(cfg.tp):
        # The single-device heads over rank 0's shard, the logits exchange their logits stage;
        # without drafts, and with drafts verified by rejection (its verify kernels).
        shard_rows = vocab_shards(cfg.vocab, cfg.tp).sizes[0]
        for drafts in (0, cfg.max_draft_tokens):
            config = EngineConfig(device="cuda", max_num_reqs=cfg.max_num_reqs, kernels=cfg.kernels, eos_token_id=2,
                                  max_draft_tokens=drafts, verify_mode="rejection")
            engine = StepEngine(sharded_head(run.weight(shard_rows, cfg.hidden), cfg.vocab, config), config)
            name = "shard heads drafts" if drafts else f"shard heads tp={cfg.tp}"  # drafts: verified by rejection
            run.graphs(name, engine)
            if run.costing:
                continue
            n = min(4, cfg.max_num_reqs)
            top_k = lambda i: SamplingParams(temperature=0.8, top_k=20, seed=i)  # noqa: E731
            with run.steps(f"{name} rank 0 of {cfg.tp}", 2):
                engine.step(engine.source, scenario_requests(n, params=top_k))
                engine.step(engine.source, scenario_requests(n, decode=True, drafts=drafts),
                            [[1] * drafts for _ in range(n)] if drafts else None)


def _model_weights(run: _Run, config: LlamaConfig) -> LlamaWeights:
    """Llama weights of the config's shapes on the device."""
    H, I, d = config.hidden_size, config.intermediate_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    layers = [LayerWeights(attn_norm=run.weight(H), qkv=run.weight(qkv, H), o_proj=run.weight(H, config.num_heads * d),
                           mlp_norm=run.weight(H), gate_up=run.weight(2 * I, H), down=run.weight(H, I))
              for _ in range(config.num_layers)]
    return LlamaWeights(embed=run.weight(config.vocab_size, H), layers=layers, final_norm=run.weight(H))


def _model(run: _Run) -> None:
    cfg = run.cfg
    model = LlamaModel(cfg.model, _model_weights(run, cfg.model), num_slots=8, max_context=256,
                       device="cuda", dtype=cfg.dtype, batch_invariant=True)
    static = {f"{kind}_cache.{i}": cache for kind, caches in (("k", model.k_cache), ("v", model.v_cache))
              for i, cache in enumerate(caches)}
    slots = [model.allocate_slot() for _ in range(4)]
    prompt = np.array([5, 9, 3, 12])
    prefill = ForwardBatch.of(slots, prompt, prompt)
    decode = ForwardBatch.of(slots, [1, 1, 1, 1], prompt + 1)
    static["out"] = out = torch.empty(decode.num_tokens, cfg.model.hidden_size, dtype=cfg.dtype, device="cuda")
    # Token ids and positions arrive on the device, as a decode loop keeps them.
    ids = torch.zeros(prefill.num_tokens, dtype=torch.int64, device="cuda")
    positions = torch.arange(prefill.num_tokens, device="cuda") % int(prompt.min())
    with run.steps("model", 2, kind=None):
        model.forward(ids, positions, prefill)
        # An eager step (its shapes follow the batch): host-side planning is allowed,
        # waiting for the device is not.
        with capture_safety_check(static, device=out.device, is_pinned=run.cuda.is_pinned if run.cuda else None,
                                  host_work=True) as stats:
            model.forward(ids[:4], positions[:4], decode, out=out)
    run.report.graphs["model decode (eager)"] = ((decode.num_reqs, stats.ops),)


def run(cfg: DryRunConfig, *, real_cuda: bool = False, cost: bool = False, replays: int = 20,
        buckets: Iterable[int] | None = None) -> DryRunReport:
    """All scenarios on the fake device (or, `real_cuda=True`, on this machine's GPU with real
    graph capture); raises DryRunFailure on the first violation.

    `cost=True`: the cost run instead of the checks. The graphs the checks capture (the
    model's eager step is no graph: left out), each bucket's step
    run once under `profiling.cost_model.KernelCounter`, into `report.costs`; no steps.
    `buckets`: only those (each one of the engines' buckets). With `real_cuda`, each graph
    is also captured and its replay timed (`replays` replays a run, median of 3)."""
    if cost and replays < 1:
        raise ValueError(f"replays={replays!r}: must be >= 1")
    report = DryRunReport()
    start = time.perf_counter()
    with warnings.catch_warnings(), ExitStack() as stack:
        # FakeTensor data pointers read 0 (the checks use storage identities instead).
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        warnings.filterwarnings("ignore", message="a step with .* requests exceeds the largest graph bucket")
        # A cost run's steps (for the host counts) run its engines uncaptured, eagerly.
        warnings.filterwarnings("ignore", message=r"EngineConfig\(use_graphs=True\) but this engine's graphs were never")
        cuda = None
        if not real_cuda:
            cuda = stack.enter_context(FakeCuda(sms=cfg.sms))
            stack.enter_context(simulated_cuda_capture(cuda.is_pinned))
        state = _Run(cfg, report, cuda, replays if cost else 0, None if buckets is None else frozenset(buckets))
        with failures_named("StepEngine"):
            _engine(state)
        for mode in ("strict", "rejection"):
            with failures_named(f"drafts ({mode})"):
                _drafts(state, mode)
        with failures_named("sharded engine"):
            _sharded(state)
        if not cost:
            with failures_named("model decode step"):
                _model(state)
    report.seconds = time.perf_counter() - start
    return report


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _bucket_list(text: str) -> list[int]:
    """--buckets 1,8,64."""
    try:
        return [int(bucket) for bucket in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bucket sizes separated by commas, e.g. 1,8,64") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.cuda_dry_run", description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=DryRunConfig.hidden)
    parser.add_argument("--vocab", type=int, default=DryRunConfig.vocab)
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16")
    parser.add_argument("--max-num-reqs", type=int, default=DryRunConfig.max_num_reqs)
    parser.add_argument("--drafts", type=int, default=DryRunConfig.max_draft_tokens)
    parser.add_argument("--tp", type=int, default=DryRunConfig.tp)
    parser.add_argument("--kernels", choices=("auto", "triton", "torch"), default=DryRunConfig.kernels,
                        help="EngineConfig.kernels of the engines (auto: the Triton kernel head on CUDA)")
    parser.add_argument("--tiny-model", action="store_true", help="LlamaConfig.tiny() instead of SmolLM2-135M's shape")
    parser.add_argument("--real-cuda", action="store_true",
                        help="the twin: the same scenarios on this machine's GPU, capturing real CUDA graphs")
    cost = parser.add_argument_group("cost model (profiling/cost_model.py, docs/cost-model.md)")
    cost.add_argument("--cost", action="store_true",
                      help="instead of the checks: kernels, bytes and a modelled H200 replay time of every "
                           "graph (the kernels': per row mix) and bucket (with --real-cuda, also each graph's measured replay)")
    cost.add_argument("--json", action="store_true", help="with --cost: one JSON object on stdout")
    cost.add_argument("--json-out", metavar="PATH", help="with --cost: also write the JSON object to PATH")
    cost.add_argument("--cost-detail", action="store_true", help="with --cost: kernels, bytes and time per op")
    cost.add_argument("--node-us", type=float, default=NODE_US, help="µs per kernel node of a graph (default %(default)s)")
    cost.add_argument("--bandwidth-tbs", type=float, default=BANDWIDTH_TBS,
                      help="device memory bandwidth in TB/s (default %(default)s)")
    cost.add_argument("--sms", type=int, default=None,
                      help=f"SMs of the device: the fake device's (its launchers size their grids by them) and the "
                           f"model's waves (default {SMS}, an H100 SXM's and an H200's; with --real-cuda the GPU's)")
    cost.add_argument("--sm-bandwidth-gbs", type=float, default=SM_BANDWIDTH_GBS,
                      help="what one SM streams from device memory in GB/s, an assumption (docs/cost-model.md; "
                           "default %(default)s)")
    cost.add_argument("--buckets", type=_bucket_list, default=None,
                      help="with --cost: only these buckets, e.g. 1,8,64 (default: all)")
    cost.add_argument("--replays", type=int, default=20, help="with --real-cuda --cost: replays per timed run")
    args = parser.parse_args(argv)
    if args.real_cuda and not torch.cuda.is_available():
        parser.error("--real-cuda: no CUDA device here")
    if (args.json or args.json_out or args.cost_detail or args.buckets) and not args.cost:
        parser.error("--json, --json-out, --cost-detail and --buckets go with --cost")
    if args.sms is None:
        args.sms = torch.cuda.get_device_properties().multi_processor_count if args.real_cuda else SMS
    if args.node_us < 0 or args.bandwidth_tbs <= 0 or args.replays < 1 or args.sms < 1 or args.sm_bandwidth_gbs <= 0:
        parser.error(f"--sms {args.sms} must be >= 1, --sm-bandwidth-gbs {args.sm_bandwidth_gbs} > 0, "
                     f"--node-us {args.node_us} >= 0, --bandwidth-tbs {args.bandwidth_tbs} > 0, "
                     f"--replays {args.replays} >= 1")
    cfg = DryRunConfig(hidden=args.hidden, vocab=args.vocab, dtype=_DTYPES[args.dtype], max_num_reqs=args.max_num_reqs,
                       max_draft_tokens=args.drafts, tp=args.tp, kernels=args.kernels, sms=args.sms,
                       **({"model": LlamaConfig.tiny()} if args.tiny_model else {}))
    if args.buckets and not set(args.buckets) <= set(BucketTable(cfg.max_num_reqs).buckets):
        parser.error(f"--buckets {args.buckets}: each must be one of {BucketTable(cfg.max_num_reqs).buckets}")
    device = "real" if args.real_cuda else "fake"
    if not args.json:
        print(f"{device}-CUDA {'cost run' if args.cost else 'dry run'}: H={cfg.hidden}, V={cfg.vocab}, {args.dtype}, "
              f"max_num_reqs={cfg.max_num_reqs}, drafts={cfg.max_draft_tokens}, tp={cfg.tp}, kernels={cfg.kernels}"
              + ("" if args.cost else f", model {cfg.model.num_layers}x{cfg.model.hidden_size}"))
    try:
        report = run(cfg, real_cuda=args.real_cuda, cost=args.cost, replays=args.replays,
                     buckets=args.buckets)
    except DryRunFailure as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 1
    if args.cost:
        model = dict(node_us=args.node_us, bandwidth_tbs=args.bandwidth_tbs, sms=args.sms,
                     sm_bandwidth_gbs=args.sm_bandwidth_gbs)
        calibrated = calibration(report.costs, **model)
        document = json.dumps({
            "device": f"{device} cuda" + (f" ({torch.cuda.get_device_name()})" if args.real_cuda else ""),
            "hidden": cfg.hidden, "vocab": cfg.vocab, "dtype": args.dtype, "max_num_reqs": cfg.max_num_reqs,
            "drafts": cfg.max_draft_tokens, "tp": cfg.tp, **model,
            "seconds": round(report.seconds, 1),
            "graphs": [c.as_dict(detail=args.cost_detail, **model) for c in report.costs],
            **({} if args.real_cuda else {"host": report.host_summary()}),
            **({"calibration": calibrated} if calibrated is not None else {}),
        })
        if args.json_out:
            with open(args.json_out, "w") as f:
                f.write(document + "\n")
        if args.json:
            print(document)
            return 0
        print(f"modelled replay: sum over kernels of max({args.node_us} us, bytes / {args.bandwidth_tbs} TB/s, "
              f"bytes / programs x ceil(programs / {args.sms} SMs) / {args.sm_bandwidth_gbs} GB/s per SM); "
              "floor: one weight read + the [rows, V] f32 logits written and read once")
        for line in table_lines(report.costs, detail=args.cost_detail, **model):
            print(line)
        for line in calibration_lines(calibrated):
            print(line)
        print(f"cost run finished in {report.seconds:.1f} s")
        return 0
    for line in report.lines():
        print(line)
    broken = report.host_bar()
    if broken is not None:
        print(f"FAILED: {broken}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
