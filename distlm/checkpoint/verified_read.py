"""Loading a checkpoint's shards straight into the tensors, verifying their checksums from the
same reads, so that each byte is read once and copied once.

DCP's file reader loads every record with torch.load, which allocates a new tensor for it,
and copies that into the tensor being loaded: a load allocated and faulted in as much memory
as the checkpoint holds, and copied it twice. Here a record's layout (dtype, shape, where its
bytes lie) is read alone (torch.load onto the meta device), and where the slice a rank loads
is one run of bytes and its tensor is contiguous (a whole tensor, or FSDP's shards along the
first dimension) the bytes are read from the file into the tensor itself. Any other record
(a tensor-parallel slice across columns, another dtype, a record written on a big-endian
machine) is loaded as DCP loads it.

A save records each file's checksum (integrity.py). Verifying the shards before the load
read every shard twice: once whole for its checksum, once more for the tensors. Here the
checksum of a shard file is computed from the very reads that load its tensors. Each shard
file is verified by one rank: the one that reads most of it (ties go to the rank with the
fewest bytes to verify so far), chosen by the coordinator from every rank's read plan. That
rank reads the file from start to end: its own records as it loads them, the bytes in
between (other ranks' records, read by them) only for the checksum. A rank loading its own
shards back (the same layout) so reads each of its files once, and one process resharding a
whole checkpoint reads every file once. A file no rank reads is read whole by a rank with
the fewest bytes to verify.

A checksum is over the bytes in file order, but a record is read out of order (the zip's
directory at its end first, then headers, then the tensor's bytes). A read that continues
where the checksum stands extends it; a read a few bytes ahead first hashes the gap (the
zip's file names and padding, which torch.load skips); a read behind it or far ahead (the
directory) is not hashed then, and the checksum reads those bytes again, from the page cache,
when it reaches them. Large reads are split into pieces that fit a core's cache, each hashed
right after the kernel copied it in.

A file that differs from what was written is named in ``problem`` rather than raised, so
that the loader reports it on every rank whatever else failed: a damaged record may make
the rank that reads it fail before the rank verifying the file reaches its end.

What this reads of torch's internals, as torch 2.13 has them: DCP's file reader's
``storage_data`` (each item's file, offset, length and stream extensions, as DCP's own
reader uses it), and the ``_checkpoint_offset`` that torch.load onto the meta device puts on
each storage (where its bytes start in the record). Without the offset a record is loaded as
DCP loads it.
"""

from __future__ import annotations

import dataclasses
import io
import os
import struct
import sys
import zipfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from distlm.checkpoint import integrity
from distlm.checkpoint.storage import SafeReader

_PIECE = 1 << 20
"""Bytes read and hashed at a time: the piece is still in the core's cache when it is hashed."""
_AHEAD = 64 << 20
"""Bytes the kernel is asked to read ahead of the load."""
_GAP = 1 << 16
"""A read at most this far ahead of the checksum hashes the bytes in between first."""


class VerifyingReader(SafeReader):
    """The safe reader (storage.py) that verifies the checksums ``recorded`` for the shard
    files (name -> the save's entry) as it reads them; ``problem`` names a file that differs."""

    def __init__(self, path: str | os.PathLike, recorded: dict[str, dict[str, Any]]):
        super().__init__(str(path))
        self.recorded = recorded
        self.problem: str | None = None

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)
        return [dataclasses.replace(plan, storage_data=names) for plan, names in zip(plans, self._verifiers(plans))]

    def _verifiers(self, plans: list[LoadPlan]) -> list[list[str]]:
        """The shard files each rank verifies (coordinator)."""
        shards = {info.relative_path for info in self.storage_data.values()} & set(self.recorded)
        read = [Counter() for _ in plans]
        for counter, plan in zip(read, plans):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                counter[info.relative_path] += info.length
        names: list[list[str]] = [[] for _ in plans]
        assigned = [0] * len(plans)
        for name in sorted(shards, key=lambda name: (-self.recorded[name].get("size", 0), name)):
            most = max(counter[name] for counter in read)
            rank = min((rank for rank in range(len(plans)) if read[rank][name] == most),
                       key=lambda rank: (assigned[rank], rank))
            names[rank].append(name)
            assigned[rank] += self.recorded[name].get("size", 0)
        return names

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        mine = set(plan.storage_data or ())
        by_file: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            by_file[self.storage_data[item.storage_index].relative_path].append(item)
        extended = []  # DCP's stream extensions, which distlm never writes: DCP reads them
        for name in sorted(mine | set(by_file)):
            items = by_file.get(name, [])
            if any(self.storage_data[item.storage_index].transform_descriptors for item in items):
                extended += items
                if name in mine:
                    self._note(integrity.verify(Path(self.path), self.recorded, [name]))
            else:
                self._read_file(name, items, planner, verify=name in mine)
        if extended:
            super().read_data(dataclasses.replace(plan, items=extended), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _note(self, problem: str | None) -> None:
        self.problem = self.problem or problem

    def _read_file(self, name: str, items: list[ReadItem], planner: LoadPlanner, verify: bool) -> None:
        """Load ``items`` from the shard file ``name``; with ``verify``, read it whole for its checksum."""
        file = Path(self.path) / name
        algorithm = integrity.algorithm_of(self.recorded[name]) if verify else None
        if verify and algorithm is None:
            self._note(integrity.unknown_checksum(file))
            return
        failure: Exception | None = None
        items = sorted(items, key=lambda item: self.storage_data[item.storage_index].offset)
        records = [(info.offset, info.offset + info.length)
                   for info in (self.storage_data[item.storage_index] for item in items)]
        fd = os.open(file, os.O_RDONLY)
        try:
            checksum = _FileChecksum(fd, integrity.ALGORITHMS[algorithm]()) if verify else None
            shard = _ShardFile(fd, checksum)
            ahead = _ReadAhead(fd, [(0, os.fstat(fd).st_size)] if verify else records)
            for item, (start, end) in zip(items, records):
                info = self.storage_data[item.storage_index]
                ahead.reach(start, end)
                if checksum is not None:
                    checksum.extend_to(info.offset)
                if failure is None:
                    try:
                        _load_item(_RecordView(shard, info.offset, info.length), item, planner)
                    except Exception as err:  # noqa: BLE001 - damage makes a load fail anyhow
                        failure = err
                if checksum is not None:
                    checksum.extend_to(info.offset + info.length)
            if checksum is not None:
                checksum.extend_to(os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if checksum is not None and checksum.hexdigest() != self.recorded[name][algorithm]:
            self._note(integrity.differs(file, algorithm))
        elif failure is not None:
            raise failure  # the file is as written (or not this rank's to verify): the failure is not damage


def _load_item(record: _RecordView, item: ReadItem, planner: LoadPlanner) -> None:
    """One record (or the slice of it ``item`` wants) into its place: read straight into the
    tensor where it can be, else as DCP's FileSystemReader loads it."""
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(record.read()))
        return
    target = planner.resolve_tensor(item).detach()
    if not _read_into(record, item, target):
        record.seek(0)
        tensor = narrow_tensor_by_index(torch.load(record, map_location="cpu", weights_only=True),
                                        item.storage_offsets, item.lengths)
        if target.size() != tensor.size():
            raise ValueError(f"{item.storage_index.fqn}: the checkpoint holds {tuple(tensor.size())} for "
                             f"{tuple(target.size())}")
        target.copy_(tensor)
    planner.commit_tensor(item, target)


def _read_into(record: _RecordView, item: ReadItem, target: torch.Tensor) -> bool:
    """Read the slice of ``record`` that ``item`` wants straight into ``target``, if it is one
    run of bytes laid out as ``target`` is; False (nothing read into ``target``) otherwise."""
    if target.device.type != "cpu" or sys.byteorder != "little" or not record.little_endian():
        return False
    record.seek(0)
    # The layout, not the bytes. DCP writes one tensor a record, so the offset of its storage
    # is read from the record's zip header, not computed from the ones before it.
    stored = torch.load(record, map_location="meta", weights_only=True)
    start = getattr(stored.untyped_storage(), "_checkpoint_offset", None) if isinstance(stored, torch.Tensor) else None
    if start is None:
        return False
    part = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
    if (part.dtype != target.dtype or part.size() != target.size() or not part.is_contiguous()
            or not target.is_contiguous()):
        return False
    start += part.storage_offset() * part.element_size()
    length = part.numel() * part.element_size()
    if start + length > len(record):
        raise ValueError(f"{item.storage_index.fqn}: its record places {length} bytes at {start}, beyond its "
                         f"{len(record)} bytes")
    record.seek(start)
    if record.readinto(memoryview(target.reshape(-1).view(torch.uint8).numpy())) != length:
        raise ValueError(f"{item.storage_index.fqn}: its record ends before its {length} bytes")
    return True


class _FileChecksum:
    """The checksum of a file's bytes from its start, in order, up to ``end``."""

    def __init__(self, fd: int, hasher: Any):
        self.fd = fd
        self.hasher = hasher
        self.end = 0
        self._buffer: memoryview | None = None

    def saw(self, offset: int, data: memoryview) -> None:
        """Take in the bytes a load read at ``offset`` where they continue the checksum."""
        if self.end < offset <= self.end + _GAP:
            self.extend_to(offset)
        if offset <= self.end < offset + len(data):
            self.hasher.update(data[self.end - offset:])
            self.end = offset + len(data)

    def extend_to(self, offset: int) -> None:
        """Read and hash the bytes up to ``offset`` that no load read in order."""
        if self.end >= offset:
            return
        if self._buffer is None:
            self._buffer = memoryview(bytearray(_PIECE))
        while self.end < offset:
            piece = self._buffer[:min(_PIECE, offset - self.end)]
            count = os.preadv(self.fd, [piece], self.end)
            if count == 0:  # the file ends early: its checksum differs
                return
            self.hasher.update(piece[:count])
            self.end += count

    def hexdigest(self) -> str:
        return self.hasher.hexdigest()


class _ReadAhead:
    """Asks the kernel to read the byte ranges a load will read, up to ``_AHEAD`` bytes before
    it reads them. A record is read out of order (its end first), which the kernel's own
    read-ahead takes for random access, starting again small at every record; this keeps the
    disk busy with large reads instead, as a reader of a whole file would."""

    def __init__(self, fd: int, ranges: list[tuple[int, int]]):
        self._fd = fd
        self._ranges = [(start, end) for start, end in ranges if end > start]
        self._asked = 0
        """Everything the ranges hold before this offset was asked for."""

    def reach(self, start: int, end: int) -> None:
        """The load is about to read ``start`` to ``end``: have it and ``_AHEAD`` more asked for."""
        if self._asked >= end + _AHEAD // 2:
            return
        position, until = max(self._asked, start), end + _AHEAD
        for first, last in self._ranges:
            if last <= position:
                continue
            if first >= until:
                break
            low, high = max(first, position), min(last, until)
            _advise_will_need(self._fd, low, high - low)
        self._asked = until


def _advise_will_need(fd: int, offset: int, length: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


class _ShardFile:
    """An open shard file: its descriptor, its checksum if this rank verifies it, and the byte
    order of its records (one process wrote them all: read from its first record)."""

    def __init__(self, fd: int, checksum: _FileChecksum | None):
        self.fd, self.checksum = fd, checksum
        self.little_endian: bool | None = None


class _RecordView(io.RawIOBase):
    """One record of a shard file (``length`` bytes at ``offset``) as a file of its own, for
    torch.load or a read into a tensor; every read is handed to the file's checksum."""

    def __init__(self, file: _ShardFile, offset: int, length: int):
        super().__init__()
        self._file, self._offset, self._length = file, offset, length
        self._position = 0

    def __len__(self) -> int:
        return self._length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._length}[whence]
        self._position = base + position
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[:max(0, self._length - self._position)]
        done = 0
        while done < len(view):
            piece = view[done:done + _PIECE]
            at = self._offset + self._position + done
            count = os.preadv(self._file.fd, [piece], at)
            if count == 0:
                break
            if self._file.checksum is not None:
                self._file.checksum.saw(at, piece[:count])
            done += count
        self._position += done
        return done

    def little_endian(self) -> bool | None:
        """Whether the file's tensor bytes are little-endian, as torch.save recorded (torch.load
        takes a record without the mark for little-endian); None for a record that is no zip
        archive, which torch.load reads (or refuses) itself."""
        if self._file.little_endian is None:
            try:
                self._file.little_endian = self._byteorder() in (None, b"little")
            except zipfile.BadZipFile:
                return None
        return self._file.little_endian

    def _byteorder(self) -> bytes | None:
        """The record's ``byteorder`` entry, read past the zip's CRC-32: distlm's saves leave it
        0 (integrity.py), which Python's zipfile would refuse."""
        self.seek(0)
        with zipfile.ZipFile(self) as archive:
            entry = next((entry for entry in archive.infolist() if entry.filename.endswith("/byteorder")), None)
        if entry is None:
            return None
        self.seek(entry.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", self.read(4))
        self.seek(entry.header_offset + 30 + name_length + extra_length)
        return self.read(entry.file_size)
