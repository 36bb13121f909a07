"""The Llama decoder's config and weights (Hugging Face layout: RoPE on rotate-half pairs
`(i, i + head_dim/2)`; q/k/v and gate/up stored fused, so a layer runs four GEMMs), and its
projections prepacked per GEMM kernel (`LlamaWeights.packed_layers`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from engine.ops import block_gemm


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    eos_token_id: int = 0
    stop_token_ids: tuple[int, ...] = field(default=())  # EOS is always added

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and value < 1 and f.name != "eos_token_id":
                raise ValueError(f"LlamaConfig.{f.name} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        stops = tuple(dict.fromkeys((self.eos_token_id, *self.stop_token_ids)))
        for token in stops:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"LlamaConfig stop/eos token id {token} is outside the vocabulary [0, {self.vocab_size})")
        object.__setattr__(self, "stop_token_ids", stops)

    @classmethod
    def tiny(cls, **overrides: object) -> LlamaConfig:
        """A few-hundred-kilobyte config for tests; widths are multiples of 32 (see `LlamaModel`)."""
        base = dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position=512,
            eos_token_id=1,
        )
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, H]
    o_proj: torch.Tensor  # [H, heads * head_dim]
    mlp_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]: gate rows first
    down: torch.Tensor  # [H, I]


@dataclass
class LlamaWeights:
    embed: torch.Tensor  # [V, H], also the LM head (tied)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    # Layers with prepacked projections, per (kernel, GEMM row count) (`packed_layers`).
    _packed: dict[tuple[str, int], list[LayerWeights] | None] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def packed_layers(self, kernel: str, rows: int) -> list[LayerWeights] | None:
        """The layers with every projection as a `BlockGemm` of `kernel` (`engine.ops`) at
        `rows`-row blocks, built once per (kernel, rows) and shared by the models on these
        weights; None where the kernel does not apply (device, dtype, torch build). A packed
        form's summation order may differ from F.linear's; whether it is one order for every
        row of a block is probed (`engine.invariance`) before the batch-invariant mode
        relies on it."""
        if (kernel, rows) not in self._packed:
            packed = [
                {name: block_gemm(getattr(layer, name), kernel, rows) for name in PROJECTIONS} for layer in self.layers
            ]
            self._packed[kernel, rows] = None if any(g is None for p in packed for g in p.values()) else [
                LayerWeights(**{f.name: p.get(f.name, getattr(layer, f.name)) for f in fields(LayerWeights)})
                for layer, p in zip(self.layers, packed)
            ]
        return self._packed[kernel, rows]

    def to(self, device: torch.device | str, dtype: torch.dtype) -> LlamaWeights:
        device = torch.device(device)
        if all(t.device == device and t.dtype == dtype and t.is_contiguous() for t in self.state_dict().values()):
            return self  # models built on one weights object share its packed layers
        move = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
        return LlamaWeights(
            embed=move(self.embed),
            layers=[LayerWeights(**{f.name: move(getattr(layer, f.name)) for f in fields(LayerWeights)}) for layer in self.layers],
            final_norm=move(self.final_norm),
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {"embed": self.embed, "final_norm": self.final_norm}
        for n, layer in enumerate(self.layers):
            for f in fields(LayerWeights):
                tensors[f"layers.{n}.{f.name}"] = getattr(layer, f.name)
        return tensors

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], num_layers: int) -> LlamaWeights:
        layers = [LayerWeights(**{f.name: tensors[f"layers.{n}.{f.name}"] for f in fields(LayerWeights)}) for n in range(num_layers)]
        return cls(embed=tensors["embed"], layers=layers, final_norm=tensors["final_norm"])


# The four projections of a layer, each one GEMM.
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


def fuse_layer(
    attn_norm: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    mlp_norm: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
) -> LayerWeights:
    """One layer from separate Hugging Face-layout projections (`[out, in]` each)."""
    return LayerWeights(
        attn_norm=attn_norm, qkv=torch.cat([q, k, v]), o_proj=o, mlp_norm=mlp_norm,
        gate_up=torch.cat([gate, up]), down=down,
    )


def random_weights(config: LlamaConfig, seed: int) -> LlamaWeights:
    """Seeded weights scaled so activations stay O(1) and logits are peaked (greedy ties are rare)."""
    gen = torch.Generator().manual_seed(seed)
    H, I, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(H, generator=gen)

    layers = [
        fuse_layer(norm(), linear(q_out, H), linear(kv_out, H), linear(kv_out, H), linear(H, q_out),
                   norm(), linear(I, H), linear(I, H), linear(H, I))
        for _ in range(config.num_layers)
    ]
    return LlamaWeights(embed=torch.randn(config.vocab_size, H, generator=gen), layers=layers, final_norm=norm())

