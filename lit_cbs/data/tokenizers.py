"""Tokenizers: raw UTF-8 bytes by default, or a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]


class ByteTokenizer:
    """One token per UTF-8 byte: vocabulary 256, documents separated by the NUL byte (id 0)."""

    name = "bytes"
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer from a ``tokenizer.json``; ``eos_token`` (default: the first of
    ``DEFAULT_EOS_TOKENS`` it holds) separates documents. Ids without the special tokens a template would add."""

    DEFAULT_EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")

    def __init__(self, path: str | os.PathLike[str], eos_token: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError as error:
            raise ImportError(
                f"HFTokenizer({str(path)!r}) needs the Hugging Face tokenizers package: pip install tokenizers"
            ) from error
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist; give the path of a tokenizer.json")
        self.path, self.name = path, str(path.resolve())
        self._tokenizer = Tokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token is not None else self.DEFAULT_EOS_TOKENS
        self.eos_id: int = next((i for i in map(self._tokenizer.token_to_id, candidates) if i is not None), -1)
        if self.eos_id < 0:
            raise ValueError(
                f"{str(path)!r} has none of the tokens {list(candidates)}; "
                "pass eos_token=<the tokenizer's end-of-document token>"
            )

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def load_tokenizer(spec: str | os.PathLike[str]) -> ByteTokenizer | HFTokenizer:
    """``"bytes"`` -> ``ByteTokenizer``; anything else is read as the path of a tokenizer.json."""
    return ByteTokenizer() if str(spec) == "bytes" else HFTokenizer(spec)
