"""A local Hugging Face causal LM behind the `CausalLM` protocol (optional extra: `pip install .[hf]`).

Each KV-cache slot holds the model's own cache object for one request; a forward call
runs the requests one after another through the base model (the LM head stays with
the step engine). Correctness over speed: no batching across requests.
"""
from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Sequence

import torch

from engine.host.slot_pool import SlotPool
from engine.models.protocol import ForwardBatch, check_forward_args
from engine.models.tokenizer import HFChatTokenizer


class HFCausalLM:
    """Implements `engine.models.protocol.CausalLM` over a `transformers` causal LM."""

    def __init__(self, model: torch.nn.Module, *, num_slots: int = 8, max_context: int | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        # Frozen, so tensors the step engine derives from lm_head_weight never track gradients.
        self.model = model.eval().requires_grad_(False)
        self.decoder = model.get_decoder()
        config = model.config
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(self.lm_head_weight.shape[0])
        limit = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self.max_context = limit if max_context is None else max_context
        if not 1 <= self.max_context <= limit:
            raise ValueError(f"max_context must be in [1, {limit}], got {max_context}")
        generation = getattr(model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        eos = config.eos_token_id if eos is None else eos
        stops = [eos] if isinstance(eos, int) else list(eos or [])
        if not stops:
            raise ValueError("the model's config names no eos_token_id")
        self.eos_token_id = int(stops[0])
        self.stop_token_ids = tuple(int(t) for t in stops)
        self.num_slots = num_slots
        self.slots = SlotPool(num_slots)
        self._caches: dict[int, object] = {}  # slot -> the model's cache object
        # transformers 5.x renamed the decoder's `past_key_values` (argument and output) to `cache`.
        self._cache_arg = "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"
        self._lengths: dict[int, int] = {}  # slot -> tokens cached

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_slots: int = 8,
        max_context: int | None = None,
    ) -> tuple[HFCausalLM, HFChatTokenizer | None]:
        """Load a checkpoint directory offline; the tokenizer is None when the folder has none."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"model path {str(path)!r} is not a directory")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
        tokenizer = None
        if any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            tokenizer = HFChatTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
        return cls(model, num_slots=num_slots, max_context=max_context), tokenizer

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [V, H]
        return self.model.get_output_embeddings().weight

    def allocate_slot(self) -> int:
        slot = self.slots.take()
        if slot is None:
            raise RuntimeError(f"all {self.num_slots} KV-cache slots are in use")
        self._caches[slot], self._lengths[slot] = None, 0
        return slot

    def free_slot(self, slot: int) -> None:
        if not self.slots.holds(slot):
            raise ValueError(f"KV-cache slot {slot} is not allocated")
        del self._caches[slot], self._lengths[slot]
        self.slots.give_back(slot)

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        batch: ForwardBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H]
        check_forward_args(self, token_ids, positions, batch, out)
        device = self.lm_head_weight.device
        offsets = batch.token_offsets
        for i, (slot, start) in enumerate(zip(batch.slots.tolist(), batch.context_starts.tolist())):
            if not self.slots.holds(slot):
                raise ValueError(f"request {i}: KV-cache slot {slot} is not allocated")
            if self._lengths[slot] != start:
                # The model's cache only appends: it cannot rewind or skip positions.
                raise ValueError(f"request {i}: slot {slot} holds {self._lengths[slot]} tokens but the step starts at {start}")
        hidden = torch.empty(batch.num_tokens, self.hidden_size, device=device, dtype=self.lm_head_weight.dtype)
        for i, slot in enumerate(batch.slots.tolist()):
            begin, end = int(offsets[i]), int(offsets[i + 1])
            result = self.decoder(
                input_ids=token_ids[begin:end].to(device)[None],
                position_ids=positions[begin:end].to(device)[None],
                use_cache=True,
                **{self._cache_arg: self._caches[slot]},
            )
            self._caches[slot] = result[self._cache_arg]
            self._lengths[slot] = int(batch.seqlens_k[i])
            hidden[begin:end] = result.last_hidden_state[0]
        if out is None:
            return hidden
        out[: len(hidden)].copy_(hidden)
        return out[: len(hidden)]
