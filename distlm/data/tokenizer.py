"""Byte-level tokenizer: one symbol per UTF-8 byte, so any text encodes with no download.

The 256 byte symbols are spelled ``<0x00>`` ... ``<0xFF>`` in ``dict.txt`` (the spelling
sentencepiece uses for byte fallback). That makes the tokenizer a pure function of the
dictionary, and the dictionary's symbol list is what checkpoints store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from distlm.data.dictionary import Dictionary
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
