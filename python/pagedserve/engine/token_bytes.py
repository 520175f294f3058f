"""The raw bytes one token stands for: what OpenAI's logprobs `bytes` field
carries, so that joining the bytes of consecutive tokens gives the UTF-8 of
their text even when a character is split across tokens (a lone piece of a
multi-byte character decodes to U+FFFD on its own).

- Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM2: the tokenizer's
  decoder is tokenizers' ByteLevel): each character of the vocabulary entry
  maps back to one byte through GPT-2's byte-to-unicode table.
- SentencePiece byte fallback: `<0xE6>` entries are that byte; "▁" is a space.
- Anything else (special and added tokens, other vocabularies): the UTF-8 of
  the token decoded on its own.
"""

from __future__ import annotations

import json
import re

from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(tokenizer) -> set[str]:
    """Types named in the fast tokenizer's decoder (a Sequence lists several)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return set()
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(backend.decoder.__getstate__()))
    return found


class TokenBytes:
    """Callable token id -> bytes for one tokenizer (results cached per id).

    Args:
        tokenizer: a transformers tokenizer (fast tokenizers are inspected;
            slow ones fall back to the UTF-8 of the decoded token).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = "ByteLevel" in _decoder_types(tokenizer)
        self._to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        out = self._cache.get(token_id)
        if out is None:
            out = self._cache[token_id] = self._compute(token_id)
        return out

    def _compute(self, token_id: int) -> bytes:
        if token_id not in self._special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece:
                if self.byte_level and all(c in self._to_byte for c in piece):
                    return bytes(self._to_byte[c] for c in piece)
                match = _BYTE_FALLBACK.fullmatch(piece)
                if match:
                    return bytes([int(match.group(1), 16)])
                if not self.byte_level and "\u2581" in piece:
                    return piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")
