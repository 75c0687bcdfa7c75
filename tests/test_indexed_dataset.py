"""The .bin/.idx reader against files written by an independent writer in this file.

The writer below follows the published layouts byte by byte with ``struct``, without
going through distlm, so a shared misunderstanding cannot make both sides agree.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from distlm.data.indexed_dataset import MMapIndexedDataset, smallest_token_dtype, write_indexed_dataset
from distlm.errors import UsageError

MAGIC = b"MMIDIDX\x00\x00"

# (code, numpy type) as each project defines them; Megatron's 7 is float32, fairseq's is float64.
FAIRSEQ_CODES = [
    (1, "u1"), (2, "i1"), (3, "i2"), (4, "i4"), (5, "i8"), (6, "f8"), (7, "f8"), (8, "u2"), (9, "u4"), (10, "u8")
]
MEGATRON_CODES = [(1, "u1"), (2, "i1"), (3, "i2"), (4, "i4"), (5, "i8"), (6, "f8"), (7, "f4"), (8, "u2")]


def write_reference(
    prefix: Path,
    sequences: list[list[int]],
    code: int,
    type_char: str,
    megatron: bool = False,
    version: int = 1,
    magic: bytes = MAGIC,
) -> None:
    """Write .bin and .idx with plain struct calls (no numpy on the index side)."""
    itemsize = struct.calcsize("<" + _struct_char(type_char))
    with open(f"{prefix}.bin", "wb") as data:
        for sequence in sequences:
            data.write(struct.pack(f"<{len(sequence)}{_struct_char(type_char)}", *sequence))
    pointers, offset = [], 0
    for sequence in sequences:
        pointers.append(offset)
        offset += len(sequence) * itemsize
    count = len(sequences)
    doc_idx = list(range(count + 1))  # Megatron: one document per sequence, plus the end marker
    with open(f"{prefix}.idx", "wb") as index:
        index.write(magic)
        index.write(struct.pack("<Q", version))
        index.write(struct.pack("<B", code))
        index.write(struct.pack("<Q", count))
        if megatron:
            index.write(struct.pack("<Q", len(doc_idx)))
        index.write(struct.pack(f"<{count}i", *[len(s) for s in sequences]))
        index.write(struct.pack(f"<{count}q", *pointers))
        if megatron:
            index.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


STRUCT_CHARS = {"u1": "B", "i1": "b", "i2": "h", "i4": "i", "i8": "q", "u2": "H", "u4": "I", "u8": "Q", "f4": "f", "f8": "d"}


def _struct_char(type_char: str) -> str:
    return STRUCT_CHARS[type_char]


def sample_sequences(seed: int = 0, count: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [0, 1, *rng.integers(1, 40, size=count - 2).tolist()]
    return [rng.integers(0, 120, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("code,type_char", FAIRSEQ_CODES)
def test_reads_fairseq_layout_for_every_dtype_code(tmp_path, code, type_char):
    sequences = sample_sequences(code)
    write_reference(tmp_path / "train", sequences, code, type_char)
    dataset = MMapIndexedDataset(tmp_path / "train")
    assert dataset.flavour == "fairseq"
    assert dataset.dtype == np.dtype(type_char)
    assert len(dataset) == len(sequences)
    assert dataset.sizes.tolist() == [len(s) for s in sequences]
    for i, sequence in enumerate(sequences):
        item = dataset[i]
        assert item.dtype == np.int64
        assert item.tolist() == sequence


@pytest.mark.parametrize("code,type_char", MEGATRON_CODES)
def test_reads_megatron_layout_for_every_dtype_code(tmp_path, code, type_char):
    sequences = sample_sequences(100 + code)
    write_reference(tmp_path / "train", sequences, code, type_char, megatron=True)
    dataset = MMapIndexedDataset(tmp_path / "train")
    assert dataset.flavour == "megatron"
    assert dataset.dtype == np.dtype(type_char)
    assert dataset.sizes.tolist() == [len(s) for s in sequences]
    assert dataset.doc_idx.tolist() == list(range(len(sequences) + 1))
    assert [dataset[i].tolist() for i in range(len(dataset))] == sequences


def test_megatron_float32_code_7_is_not_read_as_float64(tmp_path):
    # Under fairseq's table, code 7 would be float64 and each 4-byte token would be
    # misread; the reader must use Megatron's table once it has detected the layout.
    sequences = [[5, 17, 255], [1000, 2, 3, 4]]
    write_reference(tmp_path / "mega", sequences, 7, "f4", megatron=True)
    dataset = MMapIndexedDataset(tmp_path / "mega")
    assert dataset.dtype == np.float32
    assert [dataset[i].tolist() for i in range(2)] == sequences


def test_fairseq_file_whose_first_sizes_look_like_a_document_count(tmp_path):
    # sizes [1, 0] read as one u64 give 1, a plausible Megatron document count; the exact
    # length must still pick fairseq.
    sequences = [[9], [], [4, 5, 6]]
    write_reference(tmp_path / "tricky", sequences, 8, "u2")
    dataset = MMapIndexedDataset(tmp_path / "tricky")
    assert dataset.flavour == "fairseq"
    assert [dataset[i].tolist() for i in range(3)] == sequences


def test_empty_dataset(tmp_path):
    write_reference(tmp_path / "empty", [], 8, "u2")
    dataset = MMapIndexedDataset(tmp_path / "empty")
    assert len(dataset) == 0 and dataset.num_tokens == 0


def test_get_slice_reads_part_of_a_sequence(tmp_path):
    sequences = [[1, 2, 3], [10, 11, 12, 13, 14]]
    write_reference(tmp_path / "d", sequences, 4, "i4")
    dataset = MMapIndexedDataset(tmp_path / "d")
    assert dataset.get_slice(1, 1, 3).tolist() == [11, 12, 13]
    with pytest.raises(IndexError):
        dataset.get_slice(1, 3, 3)


@pytest.mark.parametrize("type_char", ["u1", "u2", "i4", "i8", "u4", "f8"])
def test_library_writer_is_byte_identical_to_reference(tmp_path, type_char):
    code = {"u1": 1, "u2": 8, "i4": 4, "i8": 5, "u4": 9, "f8": 6}[type_char]
    sequences = sample_sequences(3)
    write_reference(tmp_path / "ref", sequences, code, type_char)
    write_indexed_dataset(tmp_path / "lib", sequences, np.dtype(type_char))
    for suffix in (".idx", ".bin"):
        assert (tmp_path / f"lib{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()


@pytest.mark.parametrize("type_char", ["u1", "u2", "i4", "i8"])
def test_library_writer_megatron_flavour_is_byte_identical_to_reference(tmp_path, type_char):
    code = {"u1": 1, "u2": 8, "i4": 4, "i8": 5}[type_char]
    sequences = sample_sequences(4)
    write_reference(tmp_path / "ref", sequences, code, type_char, megatron=True)
    write_indexed_dataset(tmp_path / "lib", sequences, np.dtype(type_char), flavour="megatron")
    for suffix in (".idx", ".bin"):
        assert (tmp_path / f"lib{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()
    dataset = MMapIndexedDataset(tmp_path / "lib")
    assert dataset.flavour == "megatron" and [dataset[i].tolist() for i in range(len(dataset))] == sequences


def test_megatron_flavour_refuses_dtypes_megatron_cannot_read(tmp_path):
    with pytest.raises(UsageError, match="megatron"):
        write_indexed_dataset(tmp_path / "x", [[1, 2]], np.uint32, flavour="megatron")


def test_smallest_token_dtype_holds_every_id():
    assert [smallest_token_dtype(n) for n in (2, 256, 257, 65536, 65537, 128_256)] == [
        np.uint8, np.uint8, np.uint16, np.uint16, np.int32, np.int32
    ]


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(UsageError, match="dtype"):
        write_indexed_dataset(tmp_path / "x", [[1, 300]], np.uint8)


# --------------------------------------------------------------------- corruption


def _valid_pair(tmp_path: Path, megatron: bool = False) -> Path:
    prefix = tmp_path / "data"
    write_reference(prefix, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], 8, "u2", megatron=megatron)
    return prefix


def _patch(path: Path, offset: int, payload: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(payload)] = payload
    path.write_bytes(bytes(raw))


def _bad_magic(prefix):
    _patch(Path(f"{prefix}.idx"), 0, b"NOTANIDX\x00")


def _bad_version(prefix):
    _patch(Path(f"{prefix}.idx"), 9, struct.pack("<Q", 2))


def _unknown_fairseq_code(prefix):
    _patch(Path(f"{prefix}.idx"), 17, struct.pack("<B", 11))


def _truncated_idx(prefix):
    path = Path(f"{prefix}.idx")
    path.write_bytes(path.read_bytes()[:-1])


def _idx_with_trailing_byte(prefix):
    path = Path(f"{prefix}.idx")
    path.write_bytes(path.read_bytes() + b"\x00")


def _idx_shorter_than_header(prefix):
    path = Path(f"{prefix}.idx")
    path.write_bytes(path.read_bytes()[:20])


def _truncated_bin(prefix):
    path = Path(f"{prefix}.bin")
    path.write_bytes(path.read_bytes()[:-2])


def _pointer_past_end(prefix):
    # fairseq layout: pointers start at 26 + 4N; point the last sequence past the .bin.
    _patch(Path(f"{prefix}.idx"), 26 + 4 * 3 + 8 * 2, struct.pack("<q", 10_000))


def _pointers_backwards(prefix):
    _patch(Path(f"{prefix}.idx"), 26 + 4 * 3 + 8 * 1, struct.pack("<q", 0))


def _negative_size(prefix):
    _patch(Path(f"{prefix}.idx"), 26, struct.pack("<i", -1))


CORRUPTIONS = {
    "bad magic": (_bad_magic, "magic"),
    "bad version": (_bad_version, "version"),
    "unknown dtype code": (_unknown_fairseq_code, "dtype code"),
    "truncated idx": (_truncated_idx, "neither"),
    "idx with a trailing byte": (_idx_with_trailing_byte, "neither"),
    "idx shorter than its header": (_idx_shorter_than_header, "header"),
    "truncated bin": (_truncated_bin, "past the end"),
    "pointer past the end": (_pointer_past_end, "past the end"),
    "pointers going backwards": (_pointers_backwards, "backwards"),
    "negative size": (_negative_size, "negative size"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupt_files_raise_one_line_usage_error_naming_the_file(tmp_path, name):
    corrupt, expected = CORRUPTIONS[name]
    prefix = _valid_pair(tmp_path)
    MMapIndexedDataset(prefix)  # valid before the damage
    corrupt(prefix)
    with pytest.raises(UsageError) as info:
        MMapIndexedDataset(prefix)
    message = str(info.value)
    assert "\n" not in message
    assert expected in message
    assert str(prefix) in message


def test_megatron_unknown_dtype_code_9(tmp_path):
    # 9 is uint32 for fairseq but does not exist in Megatron.
    prefix = _valid_pair(tmp_path, megatron=True)
    _patch(Path(f"{prefix}.idx"), 17, struct.pack("<B", 9))
    with pytest.raises(UsageError, match="megatron"):
        MMapIndexedDataset(prefix)


def test_truncated_megatron_index_is_an_error_not_a_misread(tmp_path):
    prefix = _valid_pair(tmp_path, megatron=True)
    path = Path(f"{prefix}.idx")
    path.write_bytes(path.read_bytes()[:-8])  # drop the last document index
    with pytest.raises(UsageError, match="neither"):
        MMapIndexedDataset(prefix)


@pytest.mark.parametrize("missing", [".idx", ".bin"])
def test_missing_file_is_named(tmp_path, missing):
    prefix = _valid_pair(tmp_path)
    Path(f"{prefix}{missing}").unlink()
    with pytest.raises(UsageError, match=f"data{missing}.*does not exist"):
        MMapIndexedDataset(prefix)


@pytest.mark.parametrize("flavour", ["fairseq", "megatron"])
def test_the_builder_writes_the_same_files_whatever_its_chunk(tmp_path, monkeypatch, flavour):
    """The builder keeps INDEX_CHUNK sizes in memory at a time and writes the index from its
    sizes file in chunks: with chunks of 3 sizes, 10 added sequences and a merged part of 7 give
    byte for byte the files of one chunk."""
    import distlm.data.indexed_dataset as indexed

    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 50, size=rng.integers(0, 9)) for _ in range(17)]
    written = {}
    for chunk in (1 << 16, 3):
        monkeypatch.setattr(indexed, "INDEX_CHUNK", chunk)
        root = tmp_path / str(chunk)
        root.mkdir()
        write_indexed_dataset(root / "part", sequences[10:], np.uint16, flavour)
        builder = indexed.IndexedDatasetBuilder(root / "data", np.uint16, flavour)
        for sequence in sequences[:10]:
            builder.add(sequence)
        builder.merge(root / "part")
        assert len(builder) == 17 and builder.num_tokens == sum(map(len, sequences))
        builder.finish()
        assert sorted(p.name for p in root.iterdir()) == ["data.bin", "data.idx", "part.bin", "part.idx"]
        written[chunk] = [(root / name).read_bytes() for name in ("data.bin", "data.idx")]
        read = MMapIndexedDataset(root / "data")
        assert [read[i].tolist() for i in range(len(read))] == [s.tolist() for s in sequences]
    assert written[3] == written[1 << 16]
