"""The vLLM peer benches without vLLM: the skip notice, the run under the peer
venv, the HF checkpoint the e2e bench writes for vLLM, and the report's shape.

The checkpoint is read back with a plain parser of the safetensors layout
written here (8-byte header length, JSON header, raw little-endian data), and,
where those packages are installed, with `safetensors` itself and with
transformers' `LlamaForCausalLM`, whose logits must match our model's.
"""
from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.models.llama import LlamaModel
from engine.models.llama_weights import LlamaConfig, LlamaWeights, fuse_layer
from engine.models.protocol import ForwardBatch
from engine.models.tokenizer import ChatMLTokenizer, bpe_tokenizer
from profiling.bench import e2e, peer

TINY = LlamaConfig.tiny(vocab_size=100, stop_token_ids=(2,))


@pytest.fixture
def no_peer(monkeypatch, tmp_path):
    """An interpreter without vLLM (or transformers) and no peer venv."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("vllm", "transformers") else real(name, *a))
    monkeypatch.setattr(peer, "PEER_VENV", tmp_path / "no-venv")
    monkeypatch.delenv(peer.REEXEC_MARK, raising=False)
    return tmp_path


# ---- skipping and running under the peer venv ------------------------------------------


@pytest.mark.parametrize("bench", [peer, e2e])
def test_without_the_peer_the_bench_prints_how_to_make_it_and_exits_0(bench, no_peer, capsys):
    assert bench.main(["--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    notice = [line for line in lines if "vLLM" in line]
    assert len(notice) == 1 and "make peer-venv" in notice[0]
    if bench is peer:
        assert lines == notice  # one line, nothing else


def test_with_a_peer_venv_the_bench_runs_again_under_its_python(no_peer, monkeypatch):
    python = no_peer / "no-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    calls = []
    monkeypatch.setattr(peer.subprocess, "call", lambda command, env, cwd: calls.append((command, env, cwd)) or 3)
    assert peer.main(["--quick", "--json"]) == 3  # the peer run's status is the bench's
    (command, env, cwd), = calls
    assert command[0] == str(python)
    assert command[1:3] == ["-m", "profiling.bench"]
    assert command[3:] == ["--threads", str(torch.get_num_threads()), "peer", "--quick", "--json"]
    assert env[peer.REEXEC_MARK] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(peer.REPO_ROOT) and cwd == peer.REPO_ROOT


def test_the_run_under_the_peer_venv_never_runs_itself_again(no_peer, monkeypatch, capsys):
    python = no_peer / "no-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    monkeypatch.setenv(peer.REEXEC_MARK, "1")
    monkeypatch.setattr(peer.subprocess, "call", lambda *a, **k: pytest.fail("ran itself again"))
    assert peer.main([]) == 0
    assert "make clean peer-venv" in capsys.readouterr().out


# ---- the report ---------------------------------------------------------------------


def results() -> list[peer.Result]:
    out = []
    for part in ("sampler", "tail"):
        for batch in (1, 16):
            for n, case in enumerate(peer.CASES):
                out.append(peer.Result(part, 49152, 576, batch, case, ours_us=100.0 + n, vllm_us=200.0))
    return out


def test_report_prints_every_case_and_a_ratio_matrix_per_part(capsys):
    rows = results()
    floor = peer.weight_floor(rows, bandwidth=10e9)
    peer.report(rows, floor, dict(vllm="0.32.0", torch="2", threads=2, repeats=5, cpu="x"), list(peer.CASES))
    out = capsys.readouterr().out
    for header in ("ours ms", "vLLM ms", "vLLM/ours", "sampler, V=49152: vLLM / ours", "tail, V=49152: vLLM / ours"):
        assert header in out
    # 20 detail rows, then per matrix its header row and B = 1, 16.
    assert sum(line.split()[:1] in (["sampler"], ["tail"]) for line in out.splitlines()) == len(rows)
    matrix = peer.ratio_matrix(rows, "tail", 49152, list(peer.CASES))
    assert matrix == [[b, *(f"{200.0 / (100.0 + n):.2f}" for n in range(len(peer.CASES)))] for b in (1, 16)]
    assert "floor 11.32 ms" in out  # 49152 * 576 * 4 bytes at 10 GB/s
    assert floor["ours_us"] == 100.0 and floor["vllm_us"] == 200.0
    assert floor["read_us"] > 0 and "a pure read of the weight (amax over it) took" in out


def test_json_holds_every_result_with_its_ratio():
    rows = results()
    doc = json.loads(peer.to_json(rows, peer.weight_floor(rows, 1e10), dict(vllm="0.32.0")))
    assert set(doc) == {"meta", "results", "floor"}
    assert len(doc["results"]) == len(rows)
    first = doc["results"][0]
    assert set(first) == {"part", "vocab", "hidden", "batch", "case", "ours_us", "vllm_us", "ratio"}
    assert first["ratio"] == pytest.approx(first["vllm_us"] / first["ours_us"])
    assert peer.weight_floor([r for r in rows if r.part == "sampler"], 1e10) is None


def test_the_cases_spell_out_every_control():
    for case in peer.CASES:
        p = peer.case_params(case)
        assert set(p) == {"temperature", "top_k", "top_p", "min_p"}
    assert peer.case_params("greedy")["temperature"] == 0.0
    assert peer.case_params("top-k50+top-p0.9") == dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.0)
    assert [s.params.seed for s in peer.decode_seqs("plain", 3)] == [0, 1, 2]


# ---- the HF checkpoint ----------------------------------------------------------------


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A plain reader of the layout: independent of the writer."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)
    data = raw[8 + length :]
    out = {}
    for name, entry in header.items():
        assert entry["dtype"] == "F32"
        begin, end = entry["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype="<f4").reshape(entry["shape"])
    return out


def tiny_tokenizer() -> ChatMLTokenizer:
    # The two ChatML control tokens (EOS = id 1 = <|im_end|>), then byte-level symbols.
    symbols = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
    tokens = ["<|im_start|>", "<|im_end|>"] + symbols[: TINY.vocab_size - 2]
    return ChatMLTokenizer(bpe_tokenizer(tokens, [], [3, 3] + [1] * (len(tokens) - 2)), "You are tiny.")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[LlamaWeights, Path]:
    weights = LlamaModel.random(TINY, seed=3).weights
    folder = tmp_path_factory.mktemp("ckpt") / "tiny.hf"
    return weights, e2e.write_hf_checkpoint(TINY, weights, tiny_tokenizer(), folder)


def test_checkpoint_round_trips_to_our_weights(checkpoint):
    weights, folder = checkpoint
    tensors = {k: torch.from_numpy(v.copy()) for k, v in read_safetensors(folder / "model.safetensors").items()}
    assert "lm_head.weight" not in tensors  # tied to the embedding
    layers = [
        fuse_layer(*(tensors[f"model.layers.{n}.{name}.weight"] for name in (
            "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")))
        for n in range(TINY.num_layers)
    ]
    back = LlamaWeights(embed=tensors["model.embed_tokens.weight"], layers=layers, final_norm=tensors["model.norm.weight"])
    assert len(tensors) == 2 + 9 * TINY.num_layers
    original = weights.state_dict()
    assert original.keys() == back.state_dict().keys()
    for name, value in back.state_dict().items():
        assert torch.equal(value, original[name]), name
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (TINY.num_heads * TINY.head_dim, TINY.hidden_size)


def test_checkpoint_config_and_tokenizer_files(checkpoint):
    _, folder = checkpoint
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"],
            config["head_dim"], config["rms_norm_eps"]) == (TINY.vocab_size, TINY.hidden_size, TINY.num_layers,
                                                           TINY.num_kv_heads, TINY.head_dim, TINY.rms_norm_eps)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [1, 2]
    from tokenizers import Tokenizer

    ours = tiny_tokenizer()
    text = ours.chat_text([{"role": "user", "content": "hi!"}])
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids == ours.encode(text)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == "<|im_end|>"
    if importlib.util.find_spec("jinja2") is not None:
        import jinja2

        for messages in ([{"role": "user", "content": "hi!"}],
                         [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}]):
            rendered = jinja2.Template(settings["chat_template"]).render(messages=messages, add_generation_prompt=True)
            assert rendered == ours.chat_text(messages)


def test_checkpoint_reads_the_same_with_the_safetensors_package(checkpoint):
    safetensors = pytest.importorskip("safetensors.torch")
    _, folder = checkpoint
    theirs = safetensors.load_file(str(folder / "model.safetensors"))
    mine = read_safetensors(folder / "model.safetensors")
    assert theirs.keys() == mine.keys()
    for name, value in theirs.items():
        assert np.array_equal(value.numpy(), mine[name]), name


def test_transformers_on_the_checkpoint_computes_our_logits(checkpoint):
    transformers = pytest.importorskip("transformers")
    weights, folder = checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokens = [5, 17, 42, 8, 99, 3, 60]
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    model = LlamaModel(TINY, weights, num_slots=1, batch_invariant=False)
    batch = ForwardBatch.of([model.allocate_slot()], [len(tokens)], [len(tokens)])
    hidden = model.forward(torch.tensor(tokens), batch.positions(), batch)
    torch.testing.assert_close(hidden @ model.lm_head_weight.T, expected, rtol=1e-4, atol=1e-4)


# ---- vLLM's side, where the peer venv runs the tests ------------------------------------


def test_vllm_metadata_drives_vllms_sampler_as_each_case_says():
    pytest.importorskip("vllm")
    v, why = peer.import_vllm_sampler()
    assert v is not None, why
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0)) * 3
    sampler = v.Sampler()

    def draw(case: str) -> torch.Tensor:
        return sampler(logits.clone(), peer.vllm_metadata(v, case, 8)).sampled_token_ids.flatten().long()

    assert torch.equal(draw("greedy"), logits.argmax(-1))
    assert torch.equal(draw("plain"), draw("plain"))  # per-request seeds: the same draws again
    probs = logits.softmax(-1)
    picked = probs.gather(1, draw("min-p0.05")[:, None])
    assert bool((picked >= 0.05 * probs.amax(-1, keepdim=True)).all())
    rank = (logits > logits.gather(1, draw("top-k50+top-p0.9")[:, None])).sum(-1)
    assert bool((rank < 50).all())


def test_peer_plots_one_png_per_part_and_vocabulary_from_a_saved_run(tmp_path, capsys):
    """`peer --from-json FILE --plot DIR`: the report and one PNG per comparison, without vLLM."""
    pytest.importorskip("matplotlib")
    import json

    from profiling.bench import peer

    rows = [dict(part=part, vocab=vocab, hidden=576, batch=batch, case=case, ours_us=100.0 * batch,
                 vllm_us=150.0 * batch, ratio=1.5)
            for part in ("sampler", "tail") for vocab in (49152, 128256) for batch in (1, 16)
            for case in ("greedy", "top-p0.9")]
    meta = dict(vllm="0.32.0", torch="2.13", threads=1, repeats=1, cpu="AMD EPYC", cpu_flags="avx2", commit="abc1234")
    saved = tmp_path / "peer.json"
    saved.write_text(json.dumps({"meta": meta, "results": rows, "floor": None}))
    assert peer.main(["--from-json", str(saved), "--plot", str(tmp_path / "plots")]) == 0
    assert "vLLM 0.32.0 V1 Sampler vs ours" in capsys.readouterr().out
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert written == ["peer-sampler-v128256.png", "peer-sampler-v49152.png", "peer-tail-v128256.png",
                       "peer-tail-v49152.png"]
    assert all((tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in written)
