"""Memory-mapped ``.bin``/``.idx`` token datasets, as written by fairseq and Megatron-LM.

Both projects share the same index layout (little-endian)::

    magic     b"MMIDIDX\\x00\\x00"       9 bytes
    version   u64 = 1
    dtype     u8 code of the token type in .bin
    N         u64 number of sequences
    [D        u64 number of documents]        Megatron only
    sizes     int32[N]   tokens per sequence
    pointers  int64[N]   byte offset of each sequence in .bin
    [doc_idx  int64[D]]                       Megatron only

fairseq's reader assumes its own layout and silently misreads a Megatron index (it takes
D as the first sizes). So the flavour is decided here from the file length, which
fits exactly one layout. The two projects also disagree about dtype code 7.
"""

from __future__ import annotations

import array
import os
import shutil
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from distlm.errors import UsageError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQ")  # magic, version, dtype code, N
_DOC_COUNT = struct.Struct("<Q")
FAIRSEQ = "fairseq"
MEGATRON = "megatron"

FAIRSEQ_DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float64,
    8: np.uint16,
    9: np.uint32,
    10: np.uint64,
}
# Megatron agrees on codes 1-6 and 8, reads 7 as float32, and has no 9 or 10.
MEGATRON_DTYPES: dict[int, type[np.generic]] = {
    **{code: dtype for code, dtype in FAIRSEQ_DTYPES.items() if code in (1, 2, 3, 4, 5, 6, 8)},
    7: np.float32,
}


def fairseq_dtype_code(dtype: np.dtype | type) -> int:
    """fairseq's code for ``dtype`` (float64 is written as 6, its first code)."""
    return _dtype_code(dtype, FAIRSEQ)


def megatron_dtype_code(dtype: np.dtype | type) -> int:
    """Megatron's code for ``dtype``."""
    return _dtype_code(dtype, MEGATRON)


def _dtype_code(dtype: np.dtype | type, flavour: str) -> int:
    dtype = np.dtype(dtype)
    codes = FAIRSEQ_DTYPES if flavour == FAIRSEQ else MEGATRON_DTYPES
    for code, candidate in codes.items():
        if np.dtype(candidate) == dtype:
            return code
    names = ", ".join(sorted({np.dtype(candidate).name for candidate in codes.values()}))
    raise UsageError(f"dtype {dtype} cannot be stored in a {flavour} index; use one of {names}")


def smallest_token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype both index flavours can store that holds ids ``0 .. vocab_size - 1``."""
    for dtype in (np.uint8, np.uint16, np.int32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def index_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def data_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


class MMapIndexedDataset:
    """Sequences of token ids read lazily from ``{prefix}.bin`` through ``{prefix}.idx``.

    Opening validates the whole index against the ``.bin`` length (vectorised), so a
    truncated or corrupt file fails here with one line naming it, not later deep in a
    training step.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        self._read_index(index_path(prefix))
        self._open_data(data_path(prefix))

    def _read_index(self, path: Path) -> None:
        def corrupt(reason: str) -> UsageError:
            return UsageError(f"index file {path} is corrupt or truncated: {reason}; re-run fairseq-preprocess")

        try:
            length = path.stat().st_size
            with open(path, "rb") as handle:
                head = handle.read(_HEADER.size + _DOC_COUNT.size)
        except FileNotFoundError:
            raise UsageError(
                f"index file {path} does not exist; expected fairseq-preprocess output ({path.stem}.idx and .bin)"
            ) from None
        except OSError as err:
            raise UsageError(f"index file {path} cannot be read ({err.strerror})") from None

        if len(head) < _HEADER.size:
            raise corrupt(f"{length} bytes is shorter than the {_HEADER.size}-byte header")
        magic, version, dtype_code, count = _HEADER.unpack_from(head)
        if magic != INDEX_MAGIC:
            raise corrupt(f"bad magic {magic!r}, expected {INDEX_MAGIC!r} (not an MMap indexed dataset)")
        if version != INDEX_VERSION:
            raise corrupt(f"unsupported version {version}, expected {INDEX_VERSION}")

        # Decide the flavour by the exact length: 26+12N for fairseq, 34+12N+8D for
        # Megatron. The two can never both fit (that would need D = -1).
        fairseq_length = _HEADER.size + 12 * count
        doc_count = megatron_length = None
        if len(head) == _HEADER.size + _DOC_COUNT.size:
            doc_count = _DOC_COUNT.unpack_from(head, _HEADER.size)[0]
            megatron_length = _HEADER.size + _DOC_COUNT.size + 12 * count + 8 * doc_count
        if length == fairseq_length:
            self.flavour, dtypes, sizes_offset, doc_count = FAIRSEQ, FAIRSEQ_DTYPES, _HEADER.size, 0
        elif length == megatron_length:
            self.flavour, dtypes, sizes_offset = MEGATRON, MEGATRON_DTYPES, _HEADER.size + _DOC_COUNT.size
        else:
            megatron = f" or Megatron's {megatron_length} (D={doc_count})" if megatron_length is not None else ""
            raise corrupt(f"length {length} bytes matches neither fairseq's {fairseq_length} (N={count}){megatron}")
        if dtype_code not in dtypes:
            raise corrupt(f"unknown dtype code {dtype_code} for a {self.flavour} index (known: {sorted(dtypes)})")
        self.dtype = np.dtype(dtypes[dtype_code])

        index = np.memmap(path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(index, dtype="<i4", count=count, offset=sizes_offset)
        self.pointers = np.frombuffer(index, dtype="<i8", count=count, offset=sizes_offset + 4 * count)
        self.doc_idx = np.frombuffer(index, dtype="<i8", count=doc_count, offset=sizes_offset + 12 * count)
        if (self.sizes < 0).any():
            raise corrupt(f"negative size at sequence {int(np.argmax(self.sizes < 0))}")

    def _open_data(self, path: Path) -> None:
        try:
            data_length = path.stat().st_size
        except FileNotFoundError:
            raise UsageError(
                f"data file {path} does not exist; expected fairseq-preprocess output ({path.stem}.idx and .bin)"
            ) from None

        ends = self.pointers + self.sizes.astype(np.int64) * self.dtype.itemsize
        problems = [
            (self.pointers < 0, "a negative pointer"),
            (self.pointers > data_length, f"a pointer past the end of the {data_length}-byte .bin"),
            (ends > data_length, f"data past the end of the {data_length}-byte .bin"),
        ]
        if len(self.pointers) > 1:
            # Sequences must follow each other without overlapping; anything else means
            # the index belongs to another .bin or was damaged.
            overlapping = np.concatenate([[False], self.pointers[1:] < ends[:-1]])
            problems.append((overlapping, "pointers that go backwards or overlap"))
        for bad, what in problems:
            if bad.any():
                first = int(np.argmax(bad))
                raise UsageError(
                    f"index {index_path(self.prefix)} does not match data file {path}: {what} at sequence {first}; "
                    f"the pair is truncated or corrupt, re-run fairseq-preprocess"
                )
        # numpy cannot memory-map an empty file; an empty .bin can only hold empty sequences.
        self._data = np.memmap(path, mode="r", dtype=np.uint8) if data_length > 0 else np.zeros(0, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> np.ndarray:
        """Sequence ``index`` as an int64 array (a copy; the file stays read-only)."""
        return self.get_slice(index, 0, int(self.sizes[index]))

    def find_id_outside(self, low: int, high: int, part: tuple[int, int] = (0, 1)) -> tuple[int, int] | None:
        """The first token id outside ``[low, high)`` and its sequence; None if every id is inside.

        ``part=(index, count)`` reads only the index-th of ``count`` equal consecutive runs of
        the ids, so ``count`` readers share one pass. One pass over the .bin in chunks of
        64 Mi ids: about a second per few GB.
        """
        if not len(self.sizes) or not self._data.size:
            return None
        start = int(self.pointers[0])
        end = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize
        ids = np.frombuffer(self._data, dtype=self.dtype.newbyteorder("<"), count=(end - start) // self.dtype.itemsize,
                            offset=start)
        index, count = part
        ours = range(len(ids) * index // count, len(ids) * (index + 1) // count)
        chunk = 1 << 26
        for first in range(ours.start, ours.stop, chunk):
            piece = ids[first:min(first + chunk, ours.stop)]
            if piece.min() >= low and piece.max() < high:
                continue
            position = first + int(np.argmax((piece < low) | (piece >= high)))
            byte = start + position * self.dtype.itemsize
            sequence = int(np.searchsorted(self.pointers, byte, side="right")) - 1
            return int(ids[position]), sequence
        return None

    def get_slice(self, index: int, offset: int, length: int) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index``, reading only those bytes."""
        if not 0 <= index < len(self.sizes):
            raise IndexError(f"sequence {index} out of range for {len(self.sizes)} sequences in {self.prefix}")
        size = int(self.sizes[index])
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) out of range for sequence {index} of size {size}")
        start = int(self.pointers[index]) + offset * self.dtype.itemsize
        tokens = np.frombuffer(self._data, dtype=self.dtype.newbyteorder("<"), count=length, offset=start)
        return tokens.astype(np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))


INDEX_CHUNK = 1 << 16
"""Sequences whose sizes the builder holds at a time: its memory, whatever the dataset's size."""


class IndexedDatasetBuilder:
    """Writes ``{prefix}.bin`` as sequences arrive, and ``{prefix}.idx`` on :meth:`finish`.

    ``flavour="megatron"`` adds Megatron's document index, with one document per
    sequence (``doc_idx = 0, 1, ..., N``, as Megatron's builder writes it).

    Memory stays the same whatever the number of sequences: their sizes go to a file beside
    the index (``{prefix}.idx.partial``) as they come, and :meth:`finish` writes the index
    from it ``INDEX_CHUNK`` sizes at a time.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16, flavour: str = FAIRSEQ) -> None:
        if flavour not in (FAIRSEQ, MEGATRON):
            raise UsageError(f"index flavour {flavour!r} is not one of {FAIRSEQ}, {MEGATRON}")
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.flavour = flavour
        self._code = _dtype_code(self.dtype, flavour)
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._count = 0
        self._tokens = 0
        self._pending = array.array("q")
        """Sizes not yet in the sizes file (at most INDEX_CHUNK)."""
        self._data_file = open(data_path(prefix), "wb")
        self._sizes_path = Path(f"{index_path(prefix)}.partial")
        self._sizes_file = open(self._sizes_path, "w+b")

    def add(self, sequence: Iterable[int] | np.ndarray) -> None:
        """Append one sequence (one document)."""
        values = np.asarray(sequence)
        number = self._count
        if values.ndim != 1:
            raise UsageError(f"write_indexed_dataset {self.prefix}: sequence {number} must be one-dimensional")
        limits = self._limits
        if limits is not None and values.size and (values.min() < limits.min or values.max() > limits.max):
            raise UsageError(
                f"write_indexed_dataset {self.prefix}: sequence {number} has ids outside {self.dtype}'s range; "
                f"pass a wider dtype"
            )
        self._data_file.write(values.astype(self.dtype).tobytes())
        self._pending.append(values.size)
        self._count += 1
        self._tokens += values.size
        if len(self._pending) >= INDEX_CHUNK:
            self._flush_sizes()

    def _flush_sizes(self) -> None:
        self._sizes_file.write(np.asarray(self._pending, dtype="<i8").tobytes())
        del self._pending[:]

    def merge(self, prefix: str | os.PathLike) -> None:
        """Append every sequence of the finished dataset at ``prefix``, which must hold this
        builder's dtype (Megatron's ``merge_file_``): parts written in parallel become one."""
        part = MMapIndexedDataset(prefix)
        if part.dtype != self.dtype:
            raise UsageError(f"write_indexed_dataset {self.prefix}: {prefix} holds {part.dtype}, not {self.dtype}")
        with open(data_path(prefix), "rb") as data_file:
            shutil.copyfileobj(data_file, self._data_file)
        self._flush_sizes()
        for start in range(0, len(part), INDEX_CHUNK):
            self._sizes_file.write(part.sizes[start:start + INDEX_CHUNK].astype("<i8").tobytes())
        self._count += len(part)
        self._tokens += part.num_tokens

    def __len__(self) -> int:
        return self._count

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def _size_chunks(self) -> Iterator[np.ndarray]:
        """The sizes written so far, INDEX_CHUNK at a time."""
        self._flush_sizes()
        self._sizes_file.seek(0)
        while True:
            chunk = np.fromfile(self._sizes_file, dtype="<i8", count=INDEX_CHUNK)
            if not len(chunk):
                return
            yield chunk

    def finish(self) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self._data_file.close()
        count = self._count
        with open(index_path(self.prefix), "wb") as index_file:
            index_file.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, self._code, count))
            if self.flavour == MEGATRON:
                index_file.write(_DOC_COUNT.pack(count + 1))
            for chunk in self._size_chunks():
                index_file.write(chunk.astype("<i4").tobytes())
            offset = 0  # each sequence's byte offset in the .bin
            for chunk in self._size_chunks():
                ends = offset + np.cumsum(chunk * self.dtype.itemsize)
                index_file.write(np.concatenate([[offset], ends[:-1]]).astype("<i8").tobytes())
                offset = int(ends[-1])
            if self.flavour == MEGATRON:
                for start in range(0, count + 1, INDEX_CHUNK):
                    index_file.write(np.arange(start, min(count + 1, start + INDEX_CHUNK), dtype="<i8").tobytes())
        self._close_sizes()

    def close(self) -> None:
        """Stop without writing an index (after an error)."""
        self._data_file.close()
        self._close_sizes()

    def _close_sizes(self) -> None:
        self._sizes_file.close()
        self._sizes_path.unlink(missing_ok=True)


def write_indexed_dataset(
    prefix: str | os.PathLike,
    sequences: Iterable[Iterable[int]],
    dtype: np.dtype | type = np.uint16,
    flavour: str = FAIRSEQ,
) -> None:
    """Write ``{prefix}.bin`` and ``{prefix}.idx`` in fairseq's layout, or Megatron's with ``flavour="megatron"``."""
    builder = IndexedDatasetBuilder(prefix, dtype, flavour)
    try:
        for sequence in sequences:
            builder.add(sequence)
    except BaseException:
        builder.close()
        raise
    builder.finish()
