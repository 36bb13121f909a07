"""End to end on CPU: our decode loop + decoder vs vLLM's CPU engine and Hugging Face `generate`.

SmolLM2-135M-Instruct from the same GGUF file on every side, the demo's 16
chat prompts, greedy, `--max-tokens` new tokens each, fp32. Runs:
- ours: `DecodeLoop` (all prompts submitted at once, graphs on, no drafts), the
  model in its fast mode and in its batch-invariant mode (`--no-invariant` leaves
  the second out);
- vLLM (the side-by-side peer, in this process): `vllm.LLM(...).generate` on
  an HF checkpoint that this bench writes from the GGUF into the cache folder
  (config.json, model.safetensors, tokenizer files); its start-up (load and
  compile) is timed apart from the run;
- HF one prompt at a time, and HF batched with left padding (transformers
  reading the GGUF itself: a second, independent reference).
Every completion must be token-identical to ours (a completion ends at the
first stop token, inclusive); the bench reports how many of them are. Prints
tokens/s and the ratios; ours, vLLM and HF batched alternate over the repeats
and each reports its median.

vLLM and transformers come from the peer venv (`make peer-venv`): run from
another interpreter, the bench runs itself again under `.venv-peer/bin/python`
when that exists. Without vLLM it still compares with HF (needs the `hf` extra:
`.venv/bin/pip install -e '.[hf]'`) and says how to add the peer.

    python -m profiling.bench [--threads N] e2e [--quick] [--max-tokens 64] [--repeats 3] [--no-peer]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import struct
import time
from pathlib import Path

import torch

from engine.cli.demo_prompts import CHAT_PROMPTS
from engine.loop.decode_loop import DecodeLoop, LoopConfig
from engine.models.gguf_loader import cache_dir, file_digest, load_gguf, load_smollm2, smollm2_gguf_path
from engine.models.llama_weights import LlamaConfig, LlamaWeights
from engine.models.tokenizer import ChatMLTokenizer
from engine.host.params import SamplingParams
from engine.step.engine_config import EngineConfig
from profiling.bench._timing import print_table
from profiling.bench.peer import missing_peer_notice, run_under_peer

# Bump when the written checkpoint changes so stale folders are rewritten.
HF_CHECKPOINT_FORMAT = 1


def cpu_name() -> str:
    """The CPU's model name (Linux), for the report: speeds here depend on it."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        return "unknown"
    return f"{names[0]} x {len(names)}" if names else "unknown"


def _until_stop(tokens: list[int], stops: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


# -- the HF checkpoint for the peer ---------------------------------------------------


def hf_state_dict(config: LlamaConfig, weights: LlamaWeights) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face Llama names, fused projections split again.

    Our loader has already undone llama.cpp's interleaved Q/K row order (its
    RoPE rotates pairs (2i, 2i+1)); what it holds is the half-split order
    (i, i + d/2) that Hugging Face Llama checkpoints use, so the rows are
    written as they are. The LM head is tied to the embedding: no lm_head.weight.
    """
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    tensors = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm}
    for n, layer in enumerate(weights.layers):
        q, k, v = torch.split(layer.qkv, [q_rows, kv_rows, kv_rows])
        gate, up = torch.split(layer.gate_up, [config.intermediate_size, config.intermediate_size])
        prefix = f"model.layers.{n}."
        tensors.update({
            prefix + "input_layernorm.weight": layer.attn_norm,
            prefix + "self_attn.q_proj.weight": q,
            prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.o_proj.weight": layer.o_proj,
            prefix + "post_attention_layernorm.weight": layer.mlp_norm,
            prefix + "mlp.gate_proj.weight": gate,
            prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": layer.down,
        })
    return tensors


def hf_config(config: LlamaConfig) -> dict[str, object]:
    """config.json for `LlamaForCausalLM`, fp32."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        # Older transformers read rope_theta, newer ones rope_parameters.
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors layout, written directly (the format is a JSON header
    and raw little-endian bytes; the project does not depend on the package):
    u64 header length, header {name: dtype, shape, [begin, end)}, data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for name, tensor in tensors.items():
        if tensor.dtype != torch.float32:
            raise ValueError(f"{name}: dtype {tensor.dtype}, only float32 is written")
        blob = tensor.detach().contiguous().numpy().astype("<f4", copy=False).tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def chatml_template(system_prompt: str | None) -> str:
    """A Jinja chat template rendering what `ChatMLFormat.chat_text` renders."""
    system = ""
    if system_prompt is not None:
        escaped = system_prompt.replace("'", "\\'")
        system = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + escaped
                  + "<|im_end|>\n{% endif %}")
    return (system + "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_hf_checkpoint(config: LlamaConfig, weights: LlamaWeights, tokenizer: ChatMLTokenizer | None,
                        folder: Path) -> Path:
    """Write `folder` as a Hugging Face Llama checkpoint (fp32): config.json,
    generation_config.json, model.safetensors and, with a tokenizer,
    tokenizer.json and tokenizer_config.json. Written into a sibling folder
    and renamed, so a crash never leaves half a checkpoint behind."""
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    stops = list(config.stop_token_ids)
    (partial / "config.json").write_text(json.dumps(hf_config(config), indent=1))
    (partial / "generation_config.json").write_text(json.dumps({"eos_token_id": stops if len(stops) > 1 else stops[0]}))
    write_safetensors(partial / "model.safetensors", hf_state_dict(config, weights))
    if tokenizer is not None:
        (partial / "tokenizer.json").write_text(tokenizer.tokenizer.to_str())
        eos = tokenizer.tokenizer.id_to_token(config.eos_token_id)
        (partial / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": eos,
            "pad_token": eos,
            "model_max_length": config.max_position,
            "chat_template": chatml_template(tokenizer.system_prompt),
        }, indent=1))
    (partial / "format").write_text(str(HF_CHECKPOINT_FORMAT))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    return folder


def smollm2_hf_checkpoint() -> Path:
    """SmolLM2-135M-Instruct as an HF checkpoint in the cache folder, written on first use."""
    path = smollm2_gguf_path()
    folder = cache_dir() / f"{file_digest(path)}.hf"
    marker = folder / "format"
    if marker.is_file() and marker.read_text() == str(HF_CHECKPOINT_FORMAT):
        return folder
    config, weights, tokenizer = load_gguf(path)
    return write_hf_checkpoint(config, weights, tokenizer, folder)


# -- the runs -------------------------------------------------------------------------


def run_ours(model, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, DecodeLoop]:
    loop = DecodeLoop(model.with_options(), LoopConfig(max_num_reqs=len(prompts), token_budget=512),
                      engine_config=EngineConfig(device="cpu"))  # a fresh KV cache on the same weights
    for i, prompt in enumerate(prompts):
        loop.submit(i, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    start = time.perf_counter()
    done = loop.run()
    return [done[i].tokens for i in range(len(prompts))], time.perf_counter() - start, loop


def start_vllm(folder: Path, num_prompts: int, max_context: int):
    """`vllm.LLM` on the checkpoint, in this process, fp32; returns (llm, start-up seconds).

    The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so
    both sides share one process and its threads: vLLM binds its OpenMP
    threads to as many CPUs as torch uses here (unless VLLM_CPU_OMP_THREADS_BIND
    is set), and OMP_NUM_THREADS keeps it from dropping torch to one thread
    for serving, which would slow our side down after its start-up."""
    threads = torch.get_num_threads()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the table
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(model=str(folder), dtype="float32", max_model_len=max_context, max_num_seqs=num_prompts,
              kv_cache_memory_bytes=1 << 30, seed=0)
    return llm, time.perf_counter() - start


def run_vllm(llm, prompts: list[list[int]], max_tokens: int, stops: set[int]) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    params = VllmParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=sorted(stops))
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [_until_stop(list(o.outputs[0].token_ids), stops) for o in outputs], seconds


def load_hf():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def run_hf(model, prompts: list[list[int]], max_tokens: int, *, batched: bool) -> tuple[list[list[int]], float]:
    stops = model.generation_config.eos_token_id
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    kwargs = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    groups = [prompts] if batched else [[p] for p in prompts]
    outputs: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for group in groups:
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            generated = model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, width:]
            outputs.extend(generated.tolist())
    seconds = time.perf_counter() - start
    stop_set = set(stops if isinstance(stops, list) else [stops])
    return [_until_stop(o, stop_set) for o in outputs], seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.bench e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of ours, vLLM and HF batched")
    parser.add_argument("--no-peer", action="store_true", help="leave vLLM out (ours against HF only)")
    parser.add_argument("--no-invariant", action="store_true", help="leave out ours with the batch-invariant model")
    args = parser.parse_args(argv)
    argv = list(argv) if argv is not None else []
    with_peer = not args.no_peer and importlib.util.find_spec("vllm") is not None
    if not args.no_peer and not with_peer:
        status = run_under_peer("e2e", argv)
        if status is not None:
            return status
        print(missing_peer_notice("e2e"))
    if importlib.util.find_spec("transformers") is None:
        print("e2e: transformers is not installed; install the hf extra: .venv/bin/pip install -e '.[hf]'")
        return 0
    count, max_tokens = (4, 16) if args.quick else (16, args.max_tokens)
    ours_model, tokenizer = load_smollm2(num_slots=count, max_context=1024, batch_invariant=False)
    invariant_model = None if args.no_invariant else ours_model.with_options(batch_invariant=True)
    prompts = [tokenizer.chat_prompt([{"role": "user", "content": text}]) for text in CHAT_PROMPTS[:count]]
    stops = set(ours_model.stop_token_ids)
    hf_model = load_hf()
    llm = None
    if with_peer:
        # vLLM's start-up binds this process's OpenMP threads to CPUs: one run
        # of ours before it shows whether that moved our speed.
        _, t_ours_before, _ = run_ours(ours_model, prompts, max_tokens)
        llm, t_startup = start_vllm(smollm2_hf_checkpoint(), count, 1024)

    # This VM's speed drifts by up to 2x over minutes: the batched runs alternate
    # and each reports its median over the repeats.
    t_ours, t_vllm, t_batched, t_invariant = [], [], [], []
    for _ in range(args.repeats):
        ours, seconds, loop = run_ours(ours_model, prompts, max_tokens)
        t_ours.append(seconds)
        if invariant_model is not None:
            invariant, seconds, _ = run_ours(invariant_model, prompts, max_tokens)
            t_invariant.append(seconds)
        if llm is not None:
            from_vllm, seconds = run_vllm(llm, prompts, max_tokens, stops)
            t_vllm.append(seconds)
        hf_batched, seconds = run_hf(hf_model, prompts, max_tokens, batched=True)
        t_batched.append(seconds)
    hf_single, t_single = run_hf(hf_model, prompts, max_tokens, batched=False)
    t_ours, t_batched = statistics.median(t_ours), statistics.median(t_batched)
    total = sum(len(t) for t in ours)

    def row(name: str, completions: list[list[int]], seconds: float) -> list[object]:
        tokens = sum(map(len, completions))
        return [name, tokens, f"{seconds:.2f}", f"{tokens / seconds:.1f}", f"{seconds / t_ours:.2f}x"]

    rows = [["ours (DecodeLoop, graphs)", total, f"{t_ours:.2f}", f"{total / t_ours:.1f}", "1.00x"]]
    if invariant_model is not None:
        t_invariant = statistics.median(t_invariant)
        rows.append(row("ours, batch-invariant model", invariant, t_invariant))
    if llm is not None:
        t_vllm = statistics.median(t_vllm)
        rows.append(row("vLLM CPU (LLM.generate)", from_vllm, t_vllm))
    rows += [row("HF generate, one at a time", hf_single, t_single), row("HF generate, batched", hf_batched, t_batched)]
    print(f"SmolLM2-135M-Instruct, {count} prompts, greedy, {max_tokens} new tokens, fp32, {torch.get_num_threads()} "
          f"threads, median of {args.repeats} alternating runs (HF one at a time: 1 run); CPU: {cpu_name()}")
    print_table(["run", "tokens", "seconds", "tokens/s", "ours faster by"], rows)
    stats = loop.stats
    print(f"ours, last run: {stats.steps} steps; model forward {stats.forward_seconds:.2f} s, step engine "
          f"{stats.engine_seconds:.2f} s, scheduling {stats.schedule_seconds:.2f} s; prompt tokens computed "
          f"{stats.prefill_tokens}, copied from a shared prefix {stats.shared_prefix_tokens}; "
          f"{loop.engine.stats.greedy_steps} steps by the argmax alone")
    same_single = sum(a == b for a, b in zip(ours, hf_single))
    same_batched = sum(a == b for a, b in zip(ours, hf_batched))
    line = (f"identical greedy completions: {same_single}/{count} vs HF one at a time, "
            f"{same_batched}/{count} vs HF batched")
    same_vllm = count
    if llm is not None:
        same_vllm = sum(a == b for a, b in zip(ours, from_vllm))
        line += f", {same_vllm}/{count} vs vLLM"
        print(f"vLLM start-up (load + compile, not in its run time): {t_startup:.1f} s; ours before it started: "
              f"{t_ours_before:.2f} s; ours / vLLM tokens per second: {t_vllm / t_ours:.2f}x")
        if invariant_model is not None:
            print(f"ours with the batch-invariant model / vLLM tokens per second: {t_vllm / t_invariant:.2f}x")
    if invariant_model is not None:
        line += f"; batch-invariant model: {sum(a == b for a, b in zip(invariant, hf_single))}/{count} vs HF one at a time"
    print(line)
    return 0 if same_single == count and same_vllm == count else 1
