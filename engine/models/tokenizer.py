"""Byte-level BPE tokenizer rebuilt from a GGUF vocabulary, plus the ChatML format of SmolLM2-Instruct.

Every tokenizer here speaks the part of Hugging Face's tokenizer protocol a
generation script uses: `encode(text)`, `decode(ids)`, `tok(text)` (a dict
with `input_ids` and `attention_mask`), `apply_chat_template(messages,
add_generation_prompt=True)` and `eos_token_id`; plus the engine's own
`chat_prompt(messages)` (`ChatTokenizer`). `as_tokenizer` takes one of ours,
a `transformers` tokenizer or a `tokenizers.Tokenizer`.
"""
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


def byte_level_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[str], str]:
    """`engine.host.token_constraints.GrammarTokenizer.grammar_vocabulary` of a byte-level
    BPE `tokenizers.Tokenizer` (GPT-2's scheme: SmolLM2, Llama 3, Qwen): its encoded tokens
    ("Ġword"); special tokens and ids past the tokenizer get "". **Raises** ValueError for
    another scheme, whose tokens xgrammar would read as other bytes than they stand for."""
    # The decoder says how a token's string maps to bytes; ByteLevel is GPT-2's byte alphabet.
    decoder = tokenizer.decoder
    scheme = None if decoder is None else json.loads(decoder.__getstate__()).get("type")
    if scheme != "ByteLevel":
        raise ValueError(f"tokenizer: its decoder is {scheme}; structured output reads byte-level BPE "
                         "vocabularies (decoder ByteLevel) here: serve this model without json_schema, regex "
                         "or grammar, or give a byte-level BPE tokenizer")
    encoded = [""] * vocab_size
    special = {i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special}
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            encoded[i] = token
    return encoded, "BYTE_LEVEL"


Conversation = Sequence[dict[str, str]]  # [{"role": "user", "content": "..."}, ...]


class BatchEncoding(dict):
    """What calling a tokenizer returns, as Hugging Face's does: `enc["input_ids"]` or
    `enc.input_ids` (a list of ids for one text, a list of lists for several), and
    `attention_mask` (all ones: nothing is padded)."""

    def __getattr__(self, name: str) -> object:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFProtocol:
    """Hugging Face's tokenizer calls over `encode`, `decode` and `chat_text`.

    `decode` skips special tokens unless told not to (vLLM's default for output
    text; Hugging Face's own `decode` keeps them)."""

    eos_token_id: int | None = None
    # Whether conversations render through a chat template of the model's own (an
    # instruct model answers inside it; raw text often gets an empty completion).
    has_chat_template: bool = False
    # The ids `decode(..., skip_special_tokens=True)` leaves out.
    special_ids: frozenset[int] = frozenset()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def chat_text(self, messages: Conversation, add_generation_prompt: bool = True) -> str:
        raise NotImplementedError

    def chat_prompt(self, messages: Conversation, add_generation_prompt: bool = True) -> list[int]:
        # The rendered template holds its own special tokens: none are added around it.
        return self.encode(self.chat_text(messages, add_generation_prompt), add_special_tokens=False)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, **_: object) -> BatchEncoding:
        if isinstance(text, str):
            ids: list = self.encode(text, add_special_tokens=add_special_tokens)
            mask: list = [1] * len(ids)
        elif isinstance(text, Sequence) and all(isinstance(t, str) for t in text):
            ids = [self.encode(t, add_special_tokens=add_special_tokens) for t in text]
            mask = [[1] * len(row) for row in ids]
        else:
            raise ValueError(f"text={text!r}: must be a str or a list of str")
        return BatchEncoding(input_ids=ids, attention_mask=mask)

    def apply_chat_template(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **_: object,
    ) -> list[int] | str:
        """The conversation in the model's chat format: token ids (`tokenize=True`, Hugging
        Face's default) or the text. `add_generation_prompt=True` ends it with the opening
        of the assistant's turn, which is what generation wants."""
        check_conversation(conversation)
        if tokenize:
            return self.chat_prompt(conversation, add_generation_prompt)
        return self.chat_text(conversation, add_generation_prompt)


def check_conversation(conversation: object, where: str = "conversation") -> None:
    """A list of {"role": str, "content": str} dicts, or ValueError naming the message and the fix."""
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence) or not conversation:
        raise ValueError(f"{where}={conversation!r}: must be a non-empty list of "
                         "{'role': ..., 'content': ...} messages")
    for n, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}[{n}]={message!r}: a message is a dict with str 'role' and 'content' "
                             "(e.g. {'role': 'user', 'content': 'Hi'})")


class ChatMLFormat(HFProtocol):
    """The ChatML conversation format over any `encode`.

    A conversation renders as `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message,
    preceded by the default system message when the first message is not a system one,
    and followed by `<|im_start|>assistant\\n` when a reply is wanted.
    """

    has_chat_template = True

    def __init__(self, system_prompt: str | None = None) -> None:
        self.system_prompt = system_prompt

    def token_id(self, token: str) -> int:
        raise NotImplementedError

    @property
    def eos_token_id(self) -> int:
        """`<|im_end|>`: the end of a ChatML turn, where an assistant's answer stops."""
        return self.token_id("<|im_end|>")

    def chat_text(self, messages: Conversation, add_generation_prompt: bool = True) -> str:
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


def added_special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of a `tokenizers.Tokenizer`'s added tokens marked special."""
    return frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)


class ChatMLTokenizer(ChatMLFormat):
    """Implements `engine.models.protocol.ChatTokenizer` for ChatML models (SmolLM2-Instruct):
    a `tokenizers` BPE plus the template's default system message."""

    def __init__(self, tokenizer: Tokenizer, system_prompt: str | None = None) -> None:
        super().__init__(system_prompt)
        self.tokenizer = tokenizer

    @property
    def special_ids(self) -> frozenset[int]:
        return added_special_ids(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return found

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """ChatML adds no BOS: `add_special_tokens` changes nothing (it is accepted for Hugging
        Face's signature); special tokens written in the text are matched whole."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def grammar_vocabulary(self, vocab_size: int) -> tuple[list[str], str]:
        """`engine.host.token_constraints.GrammarTokenizer`: see `byte_level_vocabulary`."""
        return byte_level_vocabulary(self.tokenizer, vocab_size)

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
    special_ids = frozenset(range(256, 256 + len(SPECIALS)))

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def token_id(self, token: str) -> int:
        if token not in self.SPECIALS:
            raise ValueError(f"token {token!r} is not one of the special tokens {self.SPECIALS}")
        return 256 + self.SPECIALS.index(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
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


class PlainTokenizer(HFProtocol):
    """A `tokenizers.Tokenizer` without a chat format of its own: text and ids only;
    `apply_chat_template` asks for a tokenizer that carries a chat template."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id

    @property
    def special_ids(self) -> frozenset[int]:
        return added_special_ids(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def grammar_vocabulary(self, vocab_size: int) -> tuple[list[str], str]:
        """`engine.host.token_constraints.GrammarTokenizer`: see `byte_level_vocabulary`."""
        return byte_level_vocabulary(self.tokenizer, vocab_size)

    def chat_text(self, messages: Conversation, add_generation_prompt: bool = True) -> str:
        raise ValueError("this tokenizers.Tokenizer has no chat template: give text or token ids, or a "
                         "transformers tokenizer (it carries the model's chat template)")


class HFChatTokenizer(HFProtocol):
    """Implements `ChatTokenizer` (and Hugging Face's protocol, by passing it through)
    over a `transformers` tokenizer and its chat template.

    Without a chat template the messages' contents are joined by newlines.
    """

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.all_special_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def grammar_vocabulary(self, vocab_size: int) -> tuple[list[str], str]:
        """`engine.host.token_constraints.GrammarTokenizer`, for structured output: a fast
        (`tokenizers`-backed) transformers tokenizer's vocabulary, see `byte_level_vocabulary`.
        **Raises** ValueError for a slow (Python) tokenizer."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"tokenizer: a {type(self.tokenizer).__name__} has no backend_tokenizer; structured "
                             "output needs a fast one (AutoTokenizer.from_pretrained(..., use_fast=True))")
        return byte_level_vocabulary(backend, vocab_size)

    def chat_text(self, messages: Conversation, add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            return "\n".join(message["content"] for message in messages)
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def chat_prompt(self, messages: Conversation, add_generation_prompt: bool = True) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            return self.encode(self.chat_text(messages, add_generation_prompt))
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
        if not isinstance(ids, list):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)


def as_tokenizer(tokenizer: object, eos_token_id: int | None = None) -> HFProtocol:
    """One of ours as it is; a `transformers` tokenizer wrapped with its chat template
    (`HFChatTokenizer`); a `tokenizers.Tokenizer` as ChatML when its vocabulary holds
    `<|im_start|>` and `<|im_end|>`, else as text only. **Raises** ValueError for anything else."""
    if isinstance(tokenizer, HFProtocol):
        return tokenizer
    if isinstance(tokenizer, Tokenizer):
        if tokenizer.token_to_id("<|im_start|>") is not None and tokenizer.token_to_id("<|im_end|>") is not None:
            return ChatMLTokenizer(tokenizer)
        return PlainTokenizer(tokenizer, eos_token_id)
    if callable(getattr(tokenizer, "apply_chat_template", None)) and callable(getattr(tokenizer, "encode", None)):
        return HFChatTokenizer(tokenizer)
    raise ValueError(f"tokenizer={type(tokenizer).__name__}: must be one of the engine's tokenizers, a "
                     "transformers tokenizer (AutoTokenizer.from_pretrained) or a tokenizers.Tokenizer")
