"""Byte-level BPE tokenizer rebuilt from a GGUF vocabulary, plus the ChatML format of SmolLM2-Instruct."""
from __future__ import annotations

import json
import re
from typing import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp token types (gguf `tokenizer.ggml.token_type`).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def bpe_tokenizer(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int]) -> Tokenizer:
    """A GPT-2 style byte-level BPE from GGUF `tokens` / `merges` / `token_type` arrays.

    Pre-tokenization follows the `smollm` pre-tokenizer of llama.cpp: every digit is its
    own piece, then the GPT-2 split regex. Control tokens (`<|im_start|>`, ...) are
    special added tokens: they are matched whole in text and skipped by
    `decode(..., skip_special_tokens=True)`.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, kind in enumerate(token_types) if kind == _TOKEN_CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], normalized=False) for i, kind in enumerate(token_types) if kind == _TOKEN_USER_DEFINED]
    )
    return tokenizer


def default_system_prompt(chat_template: str | None) -> str | None:
    """The system message a ChatML template inserts when the conversation has none."""
    if not chat_template:
        return None
    found = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", chat_template, flags=re.S)
    return found.group(1) if found else None


class ChatMLFormat:
    """The ChatML conversation format over any `encode`.

    A conversation renders as `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message,
    preceded by the default system message when the first message is not a system one,
    and followed by `<|im_start|>assistant\\n` when a reply is wanted.
    """

    def __init__(self, system_prompt: str | None = None) -> None:
        self.system_prompt = system_prompt

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def chat_text(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        parts = []
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            parts.append(f"<|im_start|>system\n{self.system_prompt}<|im_end|>\n")
        for n, message in enumerate(messages):
            if "role" not in message or "content" not in message:
                raise ValueError(f"chat message {n} needs 'role' and 'content', got keys {sorted(message)}")
            parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def chat_prompt(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.chat_text(messages, add_generation_prompt))


class ChatMLTokenizer(ChatMLFormat):
    """Implements `engine.models.protocol.ChatTokenizer` for ChatML models (SmolLM2-Instruct):
    a `tokenizers` BPE plus the template's default system message."""

    def __init__(self, tokenizer: Tokenizer, system_prompt: str | None = None) -> None:
        super().__init__(system_prompt)
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return found

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def grammar_vocabulary(self, vocab_size: int) -> tuple[list[str], str]:
        """`engine.host.token_constraints.GrammarTokenizer`: the encoded tokens ("Ġword") of the
        byte-level BPE; special tokens and ids past the tokenizer get ""."""
        encoded = [""] * vocab_size
        special = {i for i, added in self.tokenizer.get_added_tokens_decoder().items() if added.special}
        for token, i in self.tokenizer.get_vocab(with_added_tokens=True).items():
            if i < vocab_size and i not in special:
                encoded[i] = token
        return encoded, "BYTE_LEVEL"

    def to_json(self) -> str:
        return json.dumps({"tokenizer": self.tokenizer.to_str(), "system_prompt": self.system_prompt})

    @classmethod
    def from_json(cls, text: str) -> ChatMLTokenizer:
        saved = json.loads(text)
        return cls(Tokenizer.from_str(saved["tokenizer"]), saved["system_prompt"])


class ByteChatMLTokenizer(ChatMLFormat):
    """ChatML over raw UTF-8 bytes, for models without a vocabulary of their own (the demo's
    seeded random model): ids 0-255 are bytes, 256 is `<|im_start|>`, 257 `<|im_end|>`."""

    SPECIALS = ("<|im_start|>", "<|im_end|>")

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def token_id(self, token: str) -> int:
        if token not in self.SPECIALS:
            raise ValueError(f"token {token!r} is not one of the special tokens {self.SPECIALS}")
        return 256 + self.SPECIALS.index(token)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in re.split("(" + "|".join(map(re.escape, self.SPECIALS)) + ")", text):
            ids.extend([self.token_id(part)] if part in self.SPECIALS else part.encode())
        return ids

    def grammar_vocabulary(self, vocab_size: int) -> tuple[list[str | bytes], str]:
        """`engine.host.token_constraints.GrammarTokenizer`: ids 0-255 are raw bytes; the
        special tokens and ids past them get ""."""
        encoded: list[str | bytes] = [""] * vocab_size
        for i in range(min(256, vocab_size)):
            encoded[i] = bytes([i])
        return encoded, "RAW"

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for t in token_ids:
            if t < 256:
                out.append(t)
            elif not skip_special_tokens and t < self.vocab_size:
                out.extend(self.SPECIALS[t - 256].encode())
        return out.decode(errors="replace")
