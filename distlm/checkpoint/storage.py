"""Reading a sharded checkpoint without running anything it holds.

torch.distributed.checkpoint (DCP) keeps its metadata as a pickle in ``.metadata`` and
reads a non-tensor entry with ``torch.load(weights_only=False)``: either would run
whatever code a crafted checkpoint carries. Here the metadata is unpickled admitting
only the classes DCP's metadata is made of, every shard a file inside the checkpoint
directory, and non-tensor entries are read with ``weights_only=True``. Every read of a
checkpoint (resume, restore, finetune, export, the offline reader) goes through
``read_metadata`` and ``load``. The metadata's sizes are checked against the shard files
before anything is allocated from them (``check_shards_present``, ``check_tensor_sizes``):
checksums are not signatures, and a crafted shape would ask the allocator for terabytes.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pathlib
import pickle
import re
import warnings
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from distlm.checkpoint import directory
from distlm.errors import UsageError, first_line

# Every global a .metadata written by torch 2.x refers to, and nothing that can run code:
# the constructors below only build values (a size, a path, a dtype or layout by name).
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): OrderedDict,
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_CLASSES.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found


class _Refused(Exception):
    pass


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata of the checkpoint directory ``path``, unpickled admitting only its own classes."""
    file = path / directory.DCP_METADATA_FILE
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as refused:
        raise UsageError(f"{file} refers to {refused}, which DCP's metadata never holds: the file was crafted "
                         "or damaged, and distlm runs no code from a checkpoint; use a checkpoint you trust") from None
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises anything
        raise UsageError(f"{file}: not readable ({first_line(err)}); the checkpoint is damaged") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UsageError(f"{file} is not DCP metadata; the checkpoint is damaged")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if (not isinstance(info, _StorageInfo) or not isinstance(name, str) or Path(name).name != name
                or name in ("", ".", "..")):
            raise UsageError(f"{file} names a shard {name!r} outside the checkpoint directory; "
                             "the checkpoint is damaged")
    return metadata


def refuse_non_tensor(path: Path, key: str) -> None:
    """A weight that DCP's metadata marks as a non-tensor entry: not what distlm writes."""
    raise UsageError(f"{path / directory.DCP_METADATA_FILE} holds {key} as a non-tensor entry, which distlm writes "
                     "as a tensor: the checkpoint was crafted or damaged; use a checkpoint you trust")


def shard_files(metadata: Metadata) -> set[str]:
    """The names of the shard files DCP's metadata points into."""
    return {info.relative_path for info in metadata.storage_data.values()}


def check_shards_present(path: Path, metadata: Metadata) -> None:
    """UsageError naming the first shard file the metadata lists that ``path`` lacks, or
    whose records the metadata places beyond the file's end (a read would ask for that many bytes)."""
    files = shard_files(metadata)
    missing = sorted(name for name in files if not (path / name).is_file())
    if missing:
        raise UsageError(f"{path} lacks shard {missing[0]} (of {len(files)}); the checkpoint is incomplete")
    sizes = {name: os.stat(path / name).st_size for name in files}
    for index, info in metadata.storage_data.items():
        offset, length, size = info.offset, info.length, sizes[info.relative_path]
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length
                and offset + length <= size):
            raise UsageError(f"{path / directory.DCP_METADATA_FILE} places {length!r} bytes of {index.fqn} at byte "
                             f"{offset!r} of {info.relative_path}, which has {size}: the checkpoint was crafted or "
                             "damaged; use a checkpoint you trust")


def check_tensor_sizes(path: Path, metadata: Metadata) -> None:
    """Refuse a tensor whose shape needs more bytes than the shards hold for it.

    A reader that allocates a tensor whole from its shape (an export) so never allocates
    more than the checkpoint's files hold; every tensor DCP writes takes at least its own
    bytes in a shard.
    """
    stored: dict[str, int] = defaultdict(int)
    for index, info in metadata.storage_data.items():
        stored[index.fqn] += info.length
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        size, dtype = list(entry.size), getattr(entry.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or any(not isinstance(dim, int) or dim < 0 for dim in size):
            raise UsageError(f"{path / directory.DCP_METADATA_FILE} gives {key} the shape {size} of {dtype}, which "
                             "no tensor has: the checkpoint was crafted or damaged; use a checkpoint you trust")
        needed = math.prod(size) * dtype.itemsize
        if needed > stored[key]:
            raise UsageError(f"{path / directory.DCP_METADATA_FILE} gives {key} the shape {size}, {needed:,} bytes, "
                             f"but its shards hold {stored[key]:,} bytes of it: the checkpoint was crafted or "
                             "damaged; use a checkpoint you trust")


_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*m")


def cause_line(err: BaseException) -> str:
    """The line that names an error of torch's, without terminal escape codes: DCP wraps each
    rank's exception in a CheckpointException whose text carries the whole traceback before it."""
    text = _TERMINAL_CODES.sub("", str(err)).strip()
    for line in text.splitlines():
        if "Error" in line and ":" in line:
            return line.strip()
    return text.splitlines()[0] if text else type(err).__name__


def read_failure(err: BaseException) -> str:
    """Why torch could not read checkpoint data, in one plain line. torch's own text for a
    refused Python object spans lines, carries terminal escape codes, and suggests loading
    with weights_only=False, which would run whatever code the checkpoint holds."""
    text = _TERMINAL_CODES.sub("", str(err))
    refused = re.search(r"GLOBAL (\S+)", text)
    if refused:
        return f"it holds a Python object, {refused.group(1)}, that only code could rebuild; distlm never runs it"
    if "Weights only load failed" in text:
        return "it holds a pickle that torch's weights-only unpickler refuses; distlm never runs code from a checkpoint"
    return cause_line(err)


@contextlib.contextmanager
def no_pickle_protocol_warning() -> Iterator[None]:
    """Silences torch's warning that a record's pickle protocol is not its own: a crafted record
    is refused in distlm's one line, and what loads is checked data."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        yield


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes a single process when no process group exists; that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def load_data_only(source: Any, **kwargs: Any) -> Any:
    """``torch.load(weights_only=True)``, quietly (``no_pickle_protocol_warning``)."""
    with no_pickle_protocol_warning():
        return torch.load(source, weights_only=True, **kwargs)


class SafeReader(FileSystemReader):
    """DCP's file reader with the restricted metadata unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner reading non-tensor entries as data only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = load_data_only(value)
        except Exception as err:  # noqa: BLE001 - whatever the restricted unpickler refuses
            raise UsageError(f"checkpoint entry {read_item.dest_index.fqn} is not plain data ({read_failure(err)}); "
                             "distlm runs no code from a checkpoint") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load(state: dict[str, Any], path: Path, no_dist: bool, process_group=None,
         reader: SafeReader | None = None) -> None:
    """``dcp.load`` of ``state`` from ``path`` through the safe reader (or ``reader``, one
    derived from it) and planner."""
    with no_pickle_protocol_warning():  # DCP reads tensor records with torch.load too
        dcp.load(state, storage_reader=reader or SafeReader(str(path)), planner=SafeLoadPlanner(),
                 process_group=process_group, no_dist=no_dist)
