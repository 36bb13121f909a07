"""Two processes under torchrun (gloo on CPU, 127.0.0.1 only) give one process's tokens.

`torchrun --nproc-per-node 2 -m engine demo --tp 2` against `python -m engine demo`, and
`LLM(..., tensor_parallel_size=2)` in a script torchrun runs against `LLM(...)` in this
process (engine/parallel/launch.py). Each launch is a subprocess with a time limit; the
tiny random model keeps them to seconds.
"""
from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from engine import LLM
from engine.cli.demo import main as demo_main
from engine.loop.loop_config import LoopConfig
from engine.loop.decode_loop import DecodeLoop
from engine.models.tiny import tiny_model
from engine.parallel.launch import TORCHRUN_ENV
from profiling.tp_demo_check import demo_args, launch_env, torchrun
from profiling.tp_demo_check import main as main_check

LIMIT_S = 240  # per launch; each takes under a minute on two busy cores


def test_demo_under_torchrun_prints_one_processs_completions(capsys):
    """profiling.tp_demo_check (what gpu_check.sh runs over NCCL on two GPUs): the demo on one
    process and on 2 gloo ranks, every completion (tokens, text, logprobs, seed) compared."""
    assert main_check(["--device", "cpu", "--tp", "2", "--limit-s", str(LIMIT_S)]) == 0
    assert "4 completions, every one identical" in capsys.readouterr().out


SCRIPT = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from engine import LLM, SamplingParams

    prompts = [[5, 6, 7], [40, 2, 9, 9], [100, 7, 3]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.9, max_tokens=6, repetition_penalty=1.2),
              SamplingParams(temperature=1.0, top_k=20, max_tokens=6, prompt_logprobs=1, logit_bias={3: 3.0})]


    def found(outputs):
        # Per output: its prompt logprobs, then each sample's tokens, seed and logprobs.
        entries = lambda positions: [[(t, lp.logprob) for t, lp in sorted(d.items())] for d in positions or [] if d]
        return [[entries(out.prompt_logprobs), *((o.token_ids, o.seed, entries(o.logprobs)) for o in out.outputs)]
                for out in outputs]


    if __name__ == "__main__":
        # No seed: rank 0 draws the seed base, every rank takes it (reported for the check).
        llm = LLM("tiny", max_num_reqs=2, device="cpu", tensor_parallel_size=2)
        with open(f"{sys.argv[1]}/{dist.get_rank()}.json", "w") as f:
            json.dump({"seed_base": llm.config.seed_base, "found": found(llm.generate(prompts, params))}, f)
""")


def test_llm_with_tensor_parallel_size_2_under_torchrun(tmp_path):
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT)
    done = subprocess.run(torchrun(2, str(script), str(tmp_path)), env=launch_env(), capture_output=True, text=True,
                          timeout=LIMIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    script_names: dict = {"__name__": "script"}
    exec(SCRIPT, script_names)  # its prompts, params and `found`, without its main part
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["seed_base"] == ranks[1]["seed_base"] is not None
    # The ranks' seed base through the config: LLM(seed=) would seed the tiny model's weights too.
    one = LLM("tiny", device="cpu", config=LoopConfig(max_num_reqs=2, seed_base=ranks[0]["seed_base"],
                                                      default_max_tokens=16))
    expected = json.loads(json.dumps(script_names["found"](one.generate(script_names["prompts"],
                                                                         script_names["params"]))))
    assert any(sample[2] for output in expected for sample in output[1:])  # logprobs are compared
    assert any(output[0] for output in expected)  # and prompt logprobs
    assert ranks[0]["found"] == expected and ranks[1]["found"] == expected


def test_tensor_parallel_without_a_group_or_torchrun_names_the_launch(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    model, _ = tiny_model(0, "cpu", 2, max_context=64, batch_invariant=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: no torch.distributed group.*torchrun "
                                         "--nproc-per-node 2"):
        DecodeLoop(model, LoopConfig(max_num_reqs=2, tensor_parallel_size=2), capture=False)
    with pytest.raises(ValueError, match="LoopConfig.tensor_parallel_size=0"):
        LoopConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: config=LoopConfig"):
        LLM("tiny", config=LoopConfig(), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: no torch.distributed group"):
        LLM("tiny", device="cpu", tensor_parallel_size=2)


def test_demo_tp_without_torchrun_is_one_line(monkeypatch, capsys):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    assert demo_main(["--tp", "2", *demo_args("cpu")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m engine demo: error: tensor_parallel_size=2: no torch.distributed group")
    assert "torchrun --nproc-per-node 2" in err and len(err.splitlines()) == 1
    assert demo_main(["--tp", "0", *demo_args("cpu")]) == 2
    assert "--tp 0: must be >= 1" in capsys.readouterr().err
