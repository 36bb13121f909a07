"""Models the decode loop can drive: the protocol, the built-in Llama decoder, loaders and adapters.

`engine.models.hf_adapter` is imported on demand: it needs the optional `transformers` extra.
"""
from engine.models.gguf_loader import load_gguf, load_smollm2, smollm2_gguf_path
from engine.models.llama import LlamaModel
from engine.models.llama_weights import LlamaConfig, LlamaWeights
from engine.models.protocol import CausalLM, ChatTokenizer, ForwardBatch
from engine.models.tokenizer import ChatMLTokenizer

__all__ = [
    "CausalLM", "ChatTokenizer", "ForwardBatch", "LlamaConfig", "LlamaModel", "LlamaWeights",
    "ChatMLTokenizer", "load_gguf", "load_smollm2", "smollm2_gguf_path",
]
