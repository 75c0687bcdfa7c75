"""Byte-level tokenizer: one symbol per UTF-8 byte, so any text encodes with no download.

The 256 byte symbols are spelled ``<0x00>`` ... ``<0xFF>`` in ``dict.txt`` (the spelling
sentencepiece uses for byte fallback). That makes the tokenizer a pure function of the
dictionary, and the dictionary's symbol list is what checkpoints store.

:func:`write_hf_tokenizer` writes the same tokenizer as Hugging Face files, so a model
trained on the built-in corpus can be used with ``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from distlm.choices import TASKS
from distlm.data.dictionary import (
    BOS_SYMBOL,
    EOS_SYMBOL,
    MASK_SYMBOL,
    PAD_SYMBOL,
    SPECIAL_SYMBOLS,
    UNK_SYMBOL,
    Dictionary,
)
from distlm.errors import UsageError

NUM_BYTES = 256


def byte_symbol(value: int) -> str:
    """The dictionary symbol for one byte value, e.g. ``<0x41>`` for ``A``."""
    return f"<0x{value:02X}>"


def byte_dictionary(byte_counts: Iterable[int] | None = None) -> Dictionary:
    """A dictionary of the 4 specials followed by the 256 byte symbols in byte order."""
    counts = list(byte_counts) if byte_counts is not None else [0] * NUM_BYTES
    if len(counts) != NUM_BYTES:
        raise ValueError(f"byte_counts must have {NUM_BYTES} entries, got {len(counts)}")
    dictionary = Dictionary()
    for value, count in enumerate(counts):
        dictionary.add_symbol(byte_symbol(value), count=int(count))
    return dictionary


class ByteTokenizer:
    """Encodes text as the dictionary indices of its UTF-8 bytes, and back."""

    def __init__(self, dictionary: Dictionary) -> None:
        missing = [byte_symbol(value) for value in range(NUM_BYTES) if byte_symbol(value) not in dictionary]
        if missing:
            raise UsageError(
                f"the dictionary lacks {len(missing)} of the 256 byte symbols (e.g. {missing[0]}); "
                f"ByteTokenizer needs a byte-level dict.txt such as the built-in corpus's"
            )
        self.dictionary = dictionary
        # Lookup tables in both directions make encode/decode single numpy gathers.
        self._index_of_byte = np.array([dictionary.index(byte_symbol(v)) for v in range(NUM_BYTES)], dtype=np.int64)
        self._byte_of_index = np.full(len(dictionary), -1, dtype=np.int64)
        self._byte_of_index[self._index_of_byte] = np.arange(NUM_BYTES)

    def encode(self, text: str) -> list[int]:
        """Dictionary indices of ``text``'s UTF-8 bytes (no ``</s>`` appended)."""
        return self.encode_bytes(text.encode("utf-8")).tolist()

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Dictionary indices of raw bytes, as an int64 array."""
        return self._index_of_byte[np.frombuffer(data, dtype=np.uint8)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text for ``ids`` (a list, array or tensor); special and non-byte symbols are dropped."""
        # Broken UTF-8 (a block can start mid-character) decodes to U+FFFD, not an error.
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        in_range = (ids >= 0) & (ids < len(self._byte_of_index))
        values = self._byte_of_index[ids[in_range]]
        return values[values >= 0].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def task_post_processor(task: str, ids: dict[str, int]) -> dict:
    """The ``post_processor`` of a ``tokenizer.json`` (a TemplateProcessing) that adds the
    special tokens distlm's data pipeline puts around one document for ``task``: ``<s> A </s>``
    for masked_lm (a sample starts with ``<s>``, each document ends in ``</s>``), ``A </s>``
    for causal_lm. ``ids`` maps ``<s>`` and ``</s>`` to their ids."""
    if task not in TASKS:
        raise UsageError(f"task {task!r} is not one of {', '.join(TASKS)}")
    bos, eos = BOS_SYMBOL, EOS_SYMBOL
    if task == "masked_lm":
        single, pair = [bos, "A", eos], [bos, "A", eos, eos, "B", eos]
    else:
        single, pair = ["A", eos], ["A", eos, "B", eos]

    def pieces(template: list[str]) -> list[dict]:  # "A" and "B" are the sequences, the rest special tokens
        return [{"Sequence" if piece in "AB" else "SpecialToken": {"id": piece, "type_id": 0}} for piece in template]

    used = [bos, eos] if task == "masked_lm" else [eos]
    return {
        "type": "TemplateProcessing",
        "single": pieces(single),
        "pair": pieces(pair),
        "special_tokens": {symbol: {"id": symbol, "ids": [ids[symbol]], "tokens": [symbol]} for symbol in used},
    }


def write_hf_tokenizer(dictionary: Dictionary, out_dir: str | os.PathLike, task: str) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    for the byte-level ``dictionary``, and return their paths.

    ``transformers.AutoTokenizer.from_pretrained(out_dir)`` then encodes a text to the ids
    distlm trains on for one document: for ``masked_lm`` ``<s> bytes </s>`` (a sample is
    ``<s>`` before a block of documents that each end in ``</s>``), for ``causal_lm``
    ``bytes </s>`` (documents end in ``</s>`` and nothing is prepended); pass
    ``add_special_tokens=False`` for the bytes alone, e.g. for a generation prompt.
    ``decode(ids, skip_special_tokens=True)`` gives the text back.

    The bytes are a BPE model with no merges whose only tokens are ``<0x00>`` ... ``<0xFF>``:
    byte fallback then spells every character as its UTF-8 bytes, at the dictionary's ids.
    Special tokens typed in the text are encoded as bytes, as distlm does
    (``split_special_tokens``).
    """
    if task not in TASKS:
        raise UsageError(f"task {task!r} is not one of {', '.join(TASKS)}")
    ByteTokenizer(dictionary)  # checks that every byte has a symbol
    allowed = {*SPECIAL_SYMBOLS, MASK_SYMBOL, *(byte_symbol(value) for value in range(NUM_BYTES))}
    others = [symbol for symbol in dictionary.symbols if symbol not in allowed]
    if others:
        raise UsageError(
            f"the dictionary holds {len(others)} symbols that are not bytes (e.g. {others[0]!r}); only a byte-level "
            f"dictionary can be written as a Hugging Face tokenizer, copy the tokenizer your data was made with"
        )
    ids = {symbol: index for index, symbol in enumerate(dictionary.symbols)}
    specials = sorted((ids[symbol], symbol) for symbol in (*SPECIAL_SYMBOLS, MASK_SYMBOL) if symbol in ids)
    bos, eos = BOS_SYMBOL, EOS_SYMBOL
    # tokenizer.json is written as JSON rather than through the tokenizers package, so the
    # default run (installed without the hf extra) carries its tokenizer too.
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": index, "content": symbol, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for index, symbol in specials
        ],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": task_post_processor(task, ids),
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": UNK_SYMBOL, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True, "ignore_merges": False,
                  "vocab": ids, "merges": []},
    }

    special_tokens_map = {"bos_token": bos, "eos_token": eos, "pad_token": PAD_SYMBOL, "unk_token": UNK_SYMBOL}
    if MASK_SYMBOL in ids:
        special_tokens_map["mask_token"] = MASK_SYMBOL
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens_map,
        # A "<s>" typed in a document is text: distlm encodes its bytes.
        "split_special_tokens": True,
        # The default clean-up would change decoded text (" ." -> ".").
        "clean_up_tokenization_spaces": False,
    }
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} is a file; name a directory to write the tokenizer files into")
    paths = [out / "tokenizer.json", out / "tokenizer_config.json", out / "special_tokens_map.json"]
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths[0].write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n", encoding="utf-8")
        paths[1].write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        paths[2].write_text(json.dumps(special_tokens_map, indent=2) + "\n", encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write the tokenizer files into {out} ({err.strerror})") from None
    return paths
