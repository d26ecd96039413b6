"""Tokenizers: raw UTF-8 bytes by default, or a Hugging Face ``tokenizer.json``.

Every tokenizer has ``name`` (recorded in a prepared dataset's metadata), ``vocab_size``
(ids are in [0, vocab_size)), ``eos_id`` (the id written after each document) and
``encode(text) -> list[int]`` / ``decode(ids) -> str``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]


class ByteTokenizer:
    """One token per UTF-8 byte: vocabulary 256, no training, no files.

    Documents are separated by the NUL byte (id 0), which does not occur in text files.

    Examples:
        >>> from lit_cbs.data import ByteTokenizer
        >>> tokenizer = ByteTokenizer()
        >>> tokenizer.encode("hé!")  # "é" is two bytes in UTF-8
        [104, 195, 169, 33]
        >>> tokenizer.decode([104, 195, 169, 33]), tokenizer.vocab_size, tokenizer.eos_id
        ('hé!', 256, 0)
    """

    name = "bytes"
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``, as ids in [0, 256).

        Args:
            text: the text to tokenize.

        Returns:
            One id per UTF-8 byte of ``text``.
        """
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """The text of the bytes ``ids``; an invalid UTF-8 sequence decodes to U+FFFD.

        Args:
            ids: token ids, each in [0, 256).

        Returns:
            The decoded text.
        """
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file.

    ``eos_token`` names the document separator; by default the first of
    ``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>`` that the vocabulary holds.

    Args:
        path: the ``tokenizer.json`` file.
        eos_token: the end-of-document token (None: the first of ``DEFAULT_EOS_TOKENS`` in the vocabulary).

    Raises:
        ImportError: the ``tokenizers`` package is not installed (``pip install tokenizers``).
        ValueError: ``path`` is not a file, or the vocabulary holds none of the end-of-document tokens.

    Examples:
        A word-level tokenizer of four tokens, saved to a temporary folder:

        >>> import pathlib, tempfile
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from lit_cbs.data import HFTokenizer
        >>> vocab = {"</s>": 0, "[UNK]": 1, "hello": 2, "world": 3}
        >>> words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        >>> words.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = pathlib.Path(folder, "tokenizer.json")
        ...     words.save(str(path))
        ...     tokenizer = HFTokenizer(path)
        >>> tokenizer.encode("hello world"), tokenizer.vocab_size, tokenizer.eos_id
        ([2, 3], 4, 0)
    """

    DEFAULT_EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError as error:
            raise ImportError(
                f"HFTokenizer({str(path)!r}) needs the Hugging Face tokenizers package: pip install tokenizers"
            ) from error
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist; give the path of a tokenizer.json")
        self.path = path
        self.name = str(path.resolve())
        self._tokenizer = Tokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token is not None else self.DEFAULT_EOS_TOKENS
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                self.eos_id = token_id
                break
        else:
            raise ValueError(
                f"{str(path)!r} has none of the tokens {list(candidates)}; "
                "pass eos_token=<the tokenizer's end-of-document token>"
            )

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without the special tokens a template would add.

        Args:
            text: the text to tokenize.

        Returns:
            Its token ids, each in [0, ``vocab_size``).
        """
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens kept.

        Args:
            ids: token ids, each in [0, ``vocab_size``).

        Returns:
            The decoded text.
        """
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def load_tokenizer(spec: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """``"bytes"`` -> ByteTokenizer; anything else is read as the path of a tokenizer.json.

    Args:
        spec: ``"bytes"``, or the path of a Hugging Face ``tokenizer.json``.

    Returns:
        A ``ByteTokenizer``, or an ``HFTokenizer`` of that file.

    Raises:
        ValueError: ``spec`` is neither ``"bytes"`` nor a file (``HFTokenizer`` has the other cases).

    Examples:
        >>> from lit_cbs.data import load_tokenizer
        >>> load_tokenizer("bytes").vocab_size
        256
        >>> load_tokenizer("no/such/tokenizer.json")
        Traceback (most recent call last):
        ...
        ValueError: tokenizer file 'no/such/tokenizer.json' does not exist; give the path of a tokenizer.json
    """
    if str(spec) == "bytes":
        return ByteTokenizer()
    return HFTokenizer(spec)
